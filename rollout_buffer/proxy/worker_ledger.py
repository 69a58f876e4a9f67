"""The session workers as the buffer keeps them: each worker's slot (`WorkerSlot`), which one a new session goes
to (`WorkerSlots`), which worker holds each session the buffer placed and what the buffer keeps of it
(`PlacedSessions`): its summary (what its failure record says if it is lost), how it was placed (to place it
again), and, once closed, which worker held it (that worker still answers for it for a while)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.generation.runner import Run
from rollout_buffer.proxy.placements import Placement, PlacementStream
from rollout_buffer.proxy.recovery import StoredSummary
from rollout_buffer.proxy.worker_sessions import WorkerUnavailable

_RECENT_KEPT = 4096  # closed sessions whose worker is still asked about them (their view; a finish again: 409)
UP_WAIT_S = 30.0  # how long opening a session waits for a worker to come up when none is (start-up, restarts)
# A worker whose start failed this many times in a row is not waited for: a passing cause (its port still taken,
# a slow first start) is gone by its second or third try, and the tries after are seconds apart.
_FAILED_STARTS_WAITED = 3


@dataclass(eq=False)
class WorkerSlot:
    """One session worker: its port and folder stay the same across its restarts."""

    index: int
    url: str = ""  # as the buffer reaches it (known once started)
    public_url: str = ""  # as agents reach it
    where: dict[str, Any] = field(default_factory=dict)  # which process it is (pid, node)
    up: asyncio.Event = field(default_factory=asyncio.Event)
    tried: asyncio.Event = field(default_factory=asyncio.Event)  # its first start succeeded or failed
    failed: str = ""  # why its latest start failed, until it is up again (it is tried again meanwhile)
    failed_starts: int = 0  # in a row, until it is up again
    sessions: set[str] = field(default_factory=set)
    runs: dict[str, asyncio.Task[Any]] = field(default_factory=dict)  # run id -> its opening on this process
    restarts: int = 0
    supervisor: asyncio.Task[None] | None = None
    released: list[str] = field(default_factory=list)  # sessions whose records were stored, to tell it
    served: int = 0  # sessions placed on it since the buffer started
    opening: int = 0  # sessions being opened on it
    moved: bool = False  # started again at another address (its Ray actor was lost): its sessions' URLs are dead
    taking: asyncio.Lock = field(default_factory=asyncio.Lock)  # storing a batch it sent
    stream: PlacementStream | None = None  # where its sessions are placed (`proxy.placements`)

    @property
    def load(self) -> int:
        """Its sessions, those being opened included (what placing a session compares)."""
        return len(self.sessions) + self.opening

    def has_run(self, run_id: str) -> bool:
        """Whether run `run_id` is open on its current process."""
        opening = self.runs.get(run_id)
        return opening is not None and opening.done() and not opening.cancelled() and opening.exception() is None


class WorkerSlots:
    """Every worker's slot, by index, and which one a new session goes to."""

    def __init__(self, count: int):
        self._slots = [WorkerSlot(k) for k in range(count)]
        self._start_ended = asyncio.Event()  # set, and replaced, each time a worker's start ends (up or failed)
        self.stopping = False  # the pool stops: nothing is started or waited for any more

    def __iter__(self) -> Iterator[WorkerSlot]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, index: int) -> WorkerSlot:
        return self._slots[index]

    def start_ended(self, slot: WorkerSlot, failure: str = "") -> None:
        """`slot`'s start ended: it is up, or it failed with `failure` (it is tried again)."""
        slot.failed = failure
        slot.failed_starts = slot.failed_starts + 1 if failure else 0
        if not failure:
            slot.up.set()
        slot.tried.set()
        self._start_ended.set()
        self._start_ended = asyncio.Event()

    def exited(self, slot: WorkerSlot) -> None:
        """`slot`'s process exited (or its start was given up): it is down, and no run is open on it."""
        slot.up.clear()
        slot.runs.clear()

    def stop(self) -> None:
        """The pool stops: nothing waits for a worker any more."""
        self.stopping = True
        self._start_ended.set()

    def pick(self, near: str | None = None) -> WorkerSlot:
        """The worker a new session goes to: of those up, the one holding the fewest, among those on node `near`
        (an address or a Ray node id) when any is (a hint: elsewhere is fine). WorkerUnavailable when none is up."""
        up = [s for s in self._slots if s.up.is_set()]
        if not up:
            failed = "; ".join(f"worker {s.index} did not start: {s.failed}" for s in self._slots if s.failed)
            raise WorkerUnavailable(f"no session worker is up ({failed or 'they are starting'}; they are tried "
                                    "again, see the buffer's log)")
        there = [s for s in up if near is not None and near in (s.where.get("node"), s.where.get("node_id"))]
        return min(there or up, key=lambda s: s.load)

    async def pick_when_up(self, near: str | None = None) -> WorkerSlot:
        """`pick`, once a worker is up: when none is but some are starting (the buffer just started, or they are
        starting again after an exit), waits up to `UP_WAIT_S` for the first, so a harness that opens sessions
        right after start-up is answered rather than refused. Workers that failed to start several times in a row
        are not waited for: the refusal says why they did not start."""
        deadline = asyncio.get_running_loop().time() + UP_WAIT_S
        while not self.stopping and not any(s.up.is_set() for s in self._slots) and any(
                s.failed_starts < _FAILED_STARTS_WAITED for s in self._slots):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._start_ended.wait(), left)
        return self.pick(near)


class PlacedSessions:
    """The sessions placed on the workers, each counted in its run while held (`current`: the running run of an
    id, if it is)."""

    def __init__(self, current: Callable[[str], Run | None]):
        self._current = current
        self.placed: dict[str, WorkerSlot] = {}  # session id -> the worker holding it
        self.recent: OrderedDict[str, WorkerSlot] = OrderedDict()  # closed session id -> the worker that held it
        self.summaries: dict[str, StoredSummary] = {}  # harness sessions' summaries
        self.placements: dict[str, Placement] = {}  # how each harness session was placed

    def hold(self, slot: WorkerSlot, summary: StoredSummary, placement: Placement | None = None) -> None:
        """A harness session is on `slot` (placed, or restored there from its journal)."""
        if summary.session_id in self.placed:
            return
        self.placed[summary.session_id] = slot
        self.summaries[summary.session_id] = summary
        if placement is not None:
            self.placements[summary.session_id] = placement
        slot.sessions.add(summary.session_id)
        slot.served += 1
        run = self._current(summary.run_id)
        if run is not None:
            run.session_opened(summary.session_id)

    def let_go(self, session_id: str) -> bool:
        """Forget a closed session (counted out of its run); False when it was not held."""
        slot = self.placed.pop(session_id, None)
        summary = self.summaries.pop(session_id, None)
        self.placements.pop(session_id, None)
        if slot is None:
            return False
        slot.sessions.discard(session_id)
        self.recent[session_id] = slot
        while len(self.recent) > _RECENT_KEPT:
            self.recent.popitem(last=False)
        run = self._current(summary.run_id) if summary is not None else None
        if run is not None:
            run.session_closed(session_id)
        return True

    def forget(self, session_id: str) -> None:
        """A generator's session closed (not counted in a run: its trajectory is)."""
        slot = self.placed.pop(session_id, None)
        if slot is not None:
            slot.sessions.discard(session_id)

    def holds(self, session_id: str) -> bool:
        """Whether a worker holds the session, or held it until it closed recently."""
        return session_id in self.placed or session_id in self.recent
