"""One session model: the manager routes every call to one of two backends (this process, the session workers),
both implementing the one protocol; numbering and the closed-session cache each live in one place."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

import pytest

from rollout_buffer.config import ServerConfig
from rollout_buffer.proxy.local_backend import ClosedSessions, LocalBackend
from rollout_buffer.proxy.manager import SessionManager
from rollout_buffer.proxy.session_backend import SessionBackend
from rollout_buffer.proxy.session_names import RepeatNumbers
from rollout_buffer.proxy.worker_backend import WorkerBackend

PROTOCOL = [name for name, f in inspect.getmembers(SessionBackend, inspect.isfunction) if not name.startswith("_")]


@pytest.mark.parametrize("backend", [LocalBackend, WorkerBackend])
def test_both_backends_implement_every_call_of_the_protocol_with_its_signature(backend: type) -> None:
    assert len(PROTOCOL) >= 15
    for name in PROTOCOL:
        declared, implemented = getattr(SessionBackend, name), getattr(backend, name)
        assert list(inspect.signature(implemented).parameters) == list(inspect.signature(declared).parameters), name
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared), name


def test_repeat_numbers_count_per_instance_and_run_and_step_over_restored_ones() -> None:
    numbers = RepeatNumbers()
    assert [numbers.take("r1", "a") for _ in range(3)] == [0, 1, 2]
    assert numbers.take("r1", "b") == 0 and numbers.take("r2", "a") == 0
    numbers.taken("r1", "b", 6)  # a session restored after a restart holds repeat 6
    assert numbers.take("r1", "b") == 7
    numbers.taken("r1", "b", 2)  # a lower one changes nothing
    assert numbers.take("r1", "b") == 8
    numbers.end_run("r1")
    assert numbers.take("r1", "a") == 0 and numbers.take("r2", "a") == 1


class _Closed:
    def __init__(self, session_id: str, state: str) -> None:
        self.session_id, self.state = session_id, state

    def view(self) -> dict[str, Any]:
        return {"session_id": self.session_id}


def test_closed_sessions_answer_why_and_stay_bounded() -> None:
    closed = ClosedSessions()
    closed.add(_Closed("s-1", "expired"), "expired")  # type: ignore[arg-type]
    assert closed["s-1"] == {"session_id": "s-1", "state": "expired", "outcome": "expired"}
    gone, unknown = closed.refusal("s-1"), closed.refusal("s-2", "session_id: ")
    assert (gone.status, str(gone)) == (409, "session s-1 is already expired")
    assert (unknown.status, str(unknown)) == (404, "session_id: unknown session 's-2'")
    for k in range(ClosedSessions.KEPT + 5):
        closed.add(_Closed(f"x-{k}", "finished"), "finished")  # type: ignore[arg-type]
    assert len(closed) == ClosedSessions.KEPT and "s-1" not in closed and f"x-{ClosedSessions.KEPT + 4}" in closed


class _Backend:
    """A backend that records what it is asked."""

    def __init__(self, runs: set[str], sessions: set[str]) -> None:
        self.runs, self.sessions, self.calls = runs, sessions, []  # type: list[tuple[str, Any]]

    def serves(self, run_id: str) -> bool:
        return run_id in self.runs

    def holds(self, session_id: str) -> bool:
        return session_id in self.sessions

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any) -> Any:
            self.calls.append((name, args[0]))
            return [] if name == "list" else {"by": self}
        return call


def _router(tmp_path: Path, local: _Backend, workers: _Backend) -> SessionManager:
    manager = SessionManager(ServerConfig(data_dir=tmp_path))
    manager.local, manager._backends = local, [workers, local]  # type: ignore[assignment,list-item]
    return manager


def test_the_manager_sends_each_call_where_the_session_is(tmp_path: Path) -> None:
    local, workers = _Backend(runs={"eval", "train"}, sessions={"s-here"}), _Backend({"train"}, {"s-w0-there"})
    manager = _router(tmp_path, local, workers)

    async def go() -> None:
        assert (await manager.view("s-w0-there"))["by"] is workers
        assert (await manager.view("s-here"))["by"] is local
        assert (await manager.finish("s-unknown", 1.0, {}))["by"] is local  # this process answers unknown ids
        place = await manager.place(object(), "i", {}, lambda: "http://here")  # type: ignore[arg-type]
        assert place["by"] is workers  # harness sessions go to the workers when there are some
        await manager.end_run("train")
        await manager.list(None)

    asyncio.run(go())
    assert manager._serving("train") is workers and manager._serving("eval") is local  # an eval stays here
    assert ("end_run", "train") in workers.calls and ("end_run", "train") in local.calls
    assert [c for c in local.calls if c[0] == "list"] and [c for c in workers.calls if c[0] == "list"]
