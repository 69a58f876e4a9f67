"""Harness sessions placed on a session worker one way (`proxy.placements`): `POST /sessions` is answered without
the worker; a placement the worker never read is placed again on its next process; a request that comes before
its placement waits for it; one the worker never gets, or could not open, is refused naming why; the worker's
stream takes the buffer's secret alone; records a worker sends again are stored and counted once."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from servers import Server, free_port, free_ports, sim_engine
from sessions import open_session
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from rollout_buffer.delivery.encoded import EncodedRecord
from rollout_buffer.proxy.placements import ARRIVAL_WAIT_S
from rollout_buffer.proxy.session_names import new_session_id, placed_on, well_formed
from rollout_buffer.proxy.worker_run import WORKER_SECRET_ENV, WORKER_SECRET_HEADER
from rollout_buffer.schemas import TrajectoryRecord

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with sim_engine(tmp_path_factory.mktemp("placements-sim"), qwen_tokenizer_path, "--correct-rate", "1") as srv:
        yield srv


@pytest.fixture()
def buffer(tmp_path: Path) -> Iterator[Server]:
    port = free_port()
    srv = Server(["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--session-workers", "1",
                  "--session-worker-port", str(free_ports(1))],
                 "/healthz", port, tmp_path / "buffer.log").start()
    try:
        yield srv
    finally:
        srv.stop()


def start_run(buffer: Server, engine: Server, tokenizer: str) -> str:
    answer = httpx.post(f"{buffer.url}/start_rollout", timeout=30, json={
        "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": tokenizer,
        "num_repeat_per_sample": 1})
    assert answer.status_code == 200, answer.text
    return str(answer.json()["run_id"])


def worker_of(buffer: Server) -> dict[str, Any]:
    return dict(httpx.get(f"{buffer.url}/status", timeout=10).json()["session_workers"][0])


def secret_of(worker: dict[str, Any]) -> str:
    environ = Path(f"/proc/{worker['pid']}/environ").read_bytes().split(b"\0")
    return next(v for k, _, v in (e.partition(b"=") for e in environ) if k == WORKER_SECRET_ENV.encode()).decode()


def stored(db: Path, run_id: str) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as conn:
        return sorted(conn.execute("SELECT uid, status FROM trajectories WHERE run_id = ?", (run_id,)).fetchall())


def wait_stored(db: Path, run_id: str, n: int) -> list[tuple[str, str]]:
    deadline = time.monotonic() + 60
    while len(stored(db, run_id)) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    return stored(db, run_id)


def test_a_placement_the_worker_never_read_is_placed_again_on_its_next_process(
        buffer: Server, engine: Server, qwen_tokenizer_path: str, tmp_path: Path) -> None:
    run_id = start_run(buffer, engine, qwen_tokenizer_path)
    open_session(buffer.url, "warm-up")  # the run is open on the worker: placing waits for nothing else
    worker = worker_of(buffer)
    os.kill(worker["pid"], signal.SIGSTOP)
    try:
        session = open_session(buffer.url, "unread")  # answered while the worker cannot read anything
    finally:
        os.kill(worker["pid"], signal.SIGKILL)  # gone with the placement unread
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=12)
    reply = client.chat.completions.create(model="m", messages=QUESTION)
    assert reply.choices[0].finish_reason == "stop"
    assert worker_of(buffer)["pid"] != worker["pid"]
    finished = httpx.post(session["finish_url"], json={"reward": 1.0}, timeout=30)
    assert finished.status_code == 200 and finished.json()["status"] == "finished", finished.text
    # Its record alone: the warm-up session was restored on the new process, open still.
    assert wait_stored(tmp_path / "data" / "buffer.sqlite", run_id, 1) == [(session["uid"], "completed")]
    assert "1 placed again (never opened)" in buffer.log()
    progress = httpx.get(f"{buffer.url}/status", timeout=10).json()["run"]["progress"]
    assert progress["failed"] == 0, progress


def test_requests_wait_for_their_placement_and_a_session_never_placed_or_refused_is_named(
        buffer: Server, engine: Server, qwen_tokenizer_path: str, tmp_path: Path) -> None:
    run_id = start_run(buffer, engine, qwen_tokenizer_path)
    held = open_session(buffer.url, "held")
    worker = worker_of(buffer)
    secret = secret_of(worker)
    url = f"ws://127.0.0.1:{worker['url'].rsplit(':', 1)[1]}/worker/placements"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, additional_headers={WORKER_SECRET_HEADER: "wrong"}).close()
    assert refused.value.response.status_code == 403

    def chat(session_id: str, key: str) -> httpx.Response:
        return httpx.post(f"{worker['url']}/sessions/{session_id}/v1/chat/completions", timeout=60,
                          headers={"authorization": f"Bearer {key}"}, json={"model": "m", "messages": QUESTION})

    early, refused_id, never = (new_session_id(0) for _ in range(3))  # ids of sessions placed on worker 0
    answers: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: answers.append(chat(early, "early-key")))
    waiting.start()
    deadline = time.monotonic() + 30  # the worker has the request, waiting for the placement
    while httpx.get(f"{worker['url']}/healthz", timeout=10).json()["waiting"] != 1:
        assert time.monotonic() < deadline and waiting.is_alive(), answers
        time.sleep(0.05)
    assert waiting.is_alive(), "the request waits for its placement"
    with connect(url, additional_headers={WORKER_SECRET_HEADER: secret}) as stream:
        stream.send('{"run_id": "no placement"}')  # malformed: dropped, the stream goes on
        for session_id, run in ((early, run_id), (refused_id, "no-such-run")):
            stream.send(orjson.dumps({"run_id": run, "session_id": session_id, "instance_id": "placed-here",
                                      "repeat": 0, "api_key": "early-key", "public_url": worker["url"]}).decode())
        waiting.join(60)
        assert answers and answers[0].status_code == 200, answers
        assert answers[0].json()["choices"][0]["finish_reason"] == "stop"

        refused_turn = chat(refused_id, "early-key")
        assert refused_turn.status_code == 404
        assert "could not be opened: run no-such-run is not open" in refused_turn.json()["error"]["message"]
        started = time.monotonic()
        unknown = chat(never, "any")
        assert unknown.status_code == 404 and never in unknown.json()["error"]["message"], unknown.text
        assert time.monotonic() - started >= ARRIVAL_WAIT_S - 0.5

        # Another worker's session, an id no worker was given and one naming this worker without its checksum
        # (mistyped, made up) are refused without waiting.
        started = time.monotonic()
        elsewhere, made_up = chat(new_session_id(1), "any"), chat("s-0123456789abcdef01234567", "any")
        mistyped = chat(never[:-1] + ("0" if never[-1] != "0" else "1"), "any")
        assert time.monotonic() - started < ARRIVAL_WAIT_S
        assert mistyped.status_code == 404 and "unknown session" in mistyped.json()["error"]["message"], mistyped.text
        assert elsewhere.status_code == 404 and "was placed on session worker 1, not on this one (0)" in \
            elsewhere.json()["error"]["message"], elsewhere.text
        assert made_up.status_code == 404 and made_up.json()["error"]["message"] == \
            "unknown session 's-0123456789abcdef01234567'", made_up.text

    # A session the worker tells it could not be opened is recorded failed, with the reason, and counted.
    answer = httpx.post(f"{buffer.url}/workers/records", headers={WORKER_SECRET_HEADER: secret}, timeout=10, json={
        "worker": 0, "records": [], "metrics": [],
        "events": [{"kind": "unplaced", "session_id": held["session_id"], "reason": "its journal was not written"}]})
    assert answer.status_code == 200, answer.text
    assert wait_stored(tmp_path / "data" / "buffer.sqlite", run_id, 1) == [(held["uid"], "failed")]
    progress = httpx.get(f"{buffer.url}/status", timeout=10).json()["run"]["progress"]
    assert (progress["failed"], progress["in_flight"]) == (1, 0), progress


def test_a_record_a_worker_sends_again_is_stored_and_counted_once(
        buffer: Server, engine: Server, qwen_tokenizer_path: str, tmp_path: Path) -> None:
    """A batch sent again (its answer was lost, or part of it was refused) counts its records in the run's
    progress once, as the store keeps them once."""
    run_id = start_run(buffer, engine, qwen_tokenizer_path)
    secret = secret_of(worker_of(buffer))
    record = EncodedRecord.of(TrajectoryRecord(
        uid=f"{run_id}:again:0", instance_id="again", reward=1.0,
        messages=[{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5"}])).wire()
    for batch in ([record], [record], [record, record]):
        answer = httpx.post(f"{buffer.url}/workers/records", headers={WORKER_SECRET_HEADER: secret}, timeout=10,
                            json={"worker": 0, "events": [], "metrics": [],
                                  "records": [{"run_id": run_id, "records": batch}]})
        assert answer.status_code == 200 and answer.json()["refused"] == {}, answer.text
    assert wait_stored(tmp_path / "data" / "buffer.sqlite", run_id, 1) == [(f"{run_id}:again:0", "completed")]
    progress = httpx.get(f"{buffer.url}/status", timeout=10).json()["run"]["progress"]
    assert (progress["done"], progress["failed"]) == (1, 0), progress


def test_a_placed_sessions_id_names_its_worker() -> None:
    assert placed_on(new_session_id(3)) == 3 and placed_on(new_session_id(0)) == 0
    assert placed_on(new_session_id()) is None
    placed = new_session_id(2)
    assert well_formed(placed) and not well_formed(placed[:-1] + ("a" if placed[-1] != "a" else "b"))
    assert not any(map(well_formed, ("s-w2-early", "s-w2-", "", "s-w2-0123456789abcdef01234567")))
    for other in ("s-w", "s-w-x", "s-w12-", "s-wx-1", "s-w\u0661-x", "w1-x", "s-1-w2-x"):
        assert placed_on(other) is None, other
