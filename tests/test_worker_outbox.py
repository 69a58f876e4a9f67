"""A session worker's outbox (`proxy.outbox`) and its link to the buffer (`proxy.worker_run.BufferLink`): a harness's
finish at its worker is answered once the records are on the worker's disk; they reach the buffer in one batch
per batch wait, are sent again while the buffer cannot take them, are kept aside when it refuses them for good,
and survive the worker's process: a worker killed before its batch went sends it when it is back, and a buffer
that stops stores what its workers' outboxes hold. Nothing is lost, nothing is stored twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from servers import Server, free_port, free_ports, sim_engine
from sessions import open_session

from rollout_buffer.config import ServerConfig
from rollout_buffer.proxy import worker_run
from rollout_buffer.proxy.outbox import Outbox
from rollout_buffer.proxy.worker_run import WORKER_SECRET_ENV, WORKER_SECRET_HEADER, BufferLink


class StubBuffer:
    """A buffer's `POST /workers/records` on a stdlib HTTP server: records what it is sent, answers `answers` in
    turn (then a plain success)."""

    def __init__(self, answers: list[tuple[int, dict[str, Any]]] | None = None, port: int = 0):
        self.posts: list[dict[str, Any]] = []
        self.posted = threading.Event()
        self.answers = list(answers or [])
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                stub.posts.append({"path": self.path, "secret": self.headers[WORKER_SECRET_HEADER], "at": time.time(),
                                   "body": json.loads(self.rfile.read(int(self.headers["content-length"])))})
                stub.posted.set()
                status, body = stub.answers.pop(0) if stub.answers else (200, {"success": True, "refused": {}})
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def stub() -> Iterator[StubBuffer]:
    found = StubBuffer()
    yield found
    found.close()


def wire(uid: str, episode: str) -> dict[str, Any]:
    return {"uid": uid, "instance_id": "i", "episode": episode}


def parcel_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.parcels"))


def test_records_wait_in_the_outbox_for_one_batch_and_go_once_the_buffer_took_them(stub: StubBuffer,
                                                                                     tmp_path: Path) -> None:
    """`--session-worker-batch-ms`: a finish is answered as soon as its records are on disk; the records of the
    sessions closed within the wait go in one request, and leave the disk once the buffer answered."""

    async def deliver_two() -> tuple[float, list[str], list[str]]:
        link = BufferLink(stub.url, 3, "worker-secret", None, 0.3, Outbox(tmp_path), 1 << 20)
        link.start()
        started = time.monotonic()
        await link.deliver("run-a", [wire("u1", "e1")])
        await link.deliver("run-a", [wire("u2", "e2")])
        answered = time.monotonic() - started
        assert stub.posts == [], "the finishes did not wait for the batch"
        on_disk = parcel_files(tmp_path)
        await link.flush()
        after = parcel_files(tmp_path)
        await link.aclose()
        return answered, on_disk, after

    answered, on_disk, after = asyncio.run(deliver_two())
    assert answered < 0.3
    assert on_disk == ["000000000000.parcels"] and after == [], "on disk until the buffer took them"
    assert len(stub.posts) == 1 and stub.posts[0]["path"] == "/workers/records"
    assert stub.posts[0]["secret"] == "worker-secret" and stub.posts[0]["body"]["worker"] == 3
    assert stub.posts[0]["body"]["records"] == [{"run_id": "run-a", "records": [wire("u1", "e1")]},
                                                {"run_id": "run-a", "records": [wire("u2", "e2")]}]
    with pytest.raises(ValueError, match="session_worker_batch_ms"):
        ServerConfig(session_worker_batch_ms=-1)


def test_records_the_buffer_cannot_take_yet_are_sent_again_and_those_it_refuses_are_kept_aside(
        tmp_path: Path) -> None:
    stub = StubBuffer([(503, {"success": False, "message": "the store is busy"}),
                       (200, {"success": True, "refused": {"1": "records[1]: no run 'gone'"}})])

    async def deliver() -> None:
        link = BufferLink(stub.url, 0, "s", None, 0.0, Outbox(tmp_path), 1 << 20)
        link.start()
        await link.deliver("run-a", [wire("u1", "e1")])
        await link.deliver("gone", [wire("u2", "e2")])
        async with asyncio.timeout(30):
            await link.flush()
        await link.aclose()

    try:
        asyncio.run(deliver())
    finally:
        stub.close()
    assert len(stub.posts) == 2 and stub.posts[0]["body"]["records"] == stub.posts[1]["body"]["records"]
    assert parcel_files(tmp_path) == [], "stored or set aside: nothing left to send"
    kept = Outbox(tmp_path / "refused").files.load()
    assert len(kept) == 1 and json.loads(kept[0][1][0]) == ["gone", [wire("u2", "e2")], "records[1]: no run 'gone'"]


def test_session_events_alone_wait_for_a_buffer_out_of_reach(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """A batch of session events without records (a session failed) that cannot reach the buffer keeps its events:
    they go once the buffer is back (its accounting needs each one)."""
    monkeypatch.setattr(worker_run, "_RETRY_S", (0.05, 0.05))
    port = free_port()
    closed = {"kind": "closed", "session_id": "s-1"}

    async def tell() -> StubBuffer:
        link = BufferLink(f"http://127.0.0.1:{port}", 0, "s", None, 0.0, Outbox(tmp_path), 1 << 20)
        link.start()
        link.event(closed)
        await asyncio.sleep(1.0)  # several rounds of the ladder against nothing
        stub = StubBuffer(port=port)
        try:
            assert await asyncio.to_thread(stub.posted.wait, 30)
        finally:
            await link.aclose()
        return stub

    stub = asyncio.run(tell())
    stub.close()
    assert [p["body"]["events"] for p in stub.posts] == [[closed]]


def test_a_batch_larger_than_a_request_goes_in_several(stub: StubBuffer, tmp_path: Path) -> None:
    big = "x" * 3000

    async def deliver() -> None:
        link = BufferLink(stub.url, 0, "s", None, 5.0, Outbox(tmp_path), 10_000)  # requests of 5000 bytes
        link.start()
        for k in range(4):
            await link.deliver("run-a", [{**wire(f"u{k}", f"e{k}"), "record": big}])
        async with asyncio.timeout(30):
            await link.flush()  # the waits add up to a request's worth: sent without waiting out the 5 s
        await link.aclose()

    started = time.monotonic()
    asyncio.run(deliver())
    assert time.monotonic() - started < 5.0
    sizes = [len(p["body"]["records"]) for p in stub.posts]
    assert sum(sizes) == 4 and max(sizes) == 1, sizes


def test_the_outbox_of_a_process_that_died_is_checked_by_the_buffer_before_it_goes_again(tmp_path: Path) -> None:
    first = Outbox(tmp_path)
    first.load()
    first.add("run-a", [wire("u1", "e1")])
    first.add("run-a", [wire("u2", "e2"), wire("u3", "e2")])
    first.take()  # under way when the process was killed
    first.add("run-b", [wire("u4", "e4")])
    with open(tmp_path / "000000000001.parcels", "ab") as torn:  # killed in the middle of a write
        torn.write(b"\x10\x00\x00\x00garbage")

    again = Outbox(tmp_path)
    held = again.load()
    assert [(p.run_id, p.episodes()) for p in held] == [
        ("run-a", [("run-a", "i", "e1")]), ("run-a", [("run-a", "i", "e2")]), ("run-b", [("run-b", "i", "e4")])]
    assert again.waiting == [] and again.take() == [], "held until the buffer said what it stored"
    again.release({"e1", "e4"})
    assert [p.records for p in again.take()] == [[wire("u2", "e2"), wire("u3", "e2")]]
    assert parcel_files(tmp_path) == ["000000000000.parcels"], "the segment of the parcels stored already went"
    again.add("run-a", [wire("u5", "e5")])
    assert parcel_files(tmp_path) == ["000000000000.parcels", "000000000002.parcels"]


# ---- with a real buffer and its worker --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with sim_engine(tmp_path_factory.mktemp("outbox-sim"), qwen_tokenizer_path, "--correct-rate", "1") as srv:
        yield srv


def stored(db: Path, run_id: str) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as conn:
        return sorted(conn.execute("SELECT uid, status FROM trajectories WHERE run_id = ?", (run_id,)).fetchall())


def store_writes(url: str) -> float:
    """How many writes the buffer's store took (its `rollout_buffer_store_write_seconds` histogram's count)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("rollout_buffer_store_write_seconds_count")))


def test_records_in_the_outbox_survive_a_killed_worker_and_a_stopped_buffer(
        tmp_path: Path, engine: Server, qwen_tokenizer_path: str) -> None:
    """A batch wait of ten seconds: finished sessions' records wait in the worker's outbox. The worker killed, its
    next process sends them (each stored once; the sessions are not recorded failed); the buffer stopped, it
    stores what the outbox holds before its worker goes."""
    port = free_port()
    srv = Server(["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--session-workers", "1",
                  "--session-worker-port", str(free_ports(1)),
                  "--session-worker-batch-ms", "10000"], "/healthz", port, tmp_path / "buffer.log").start()
    db = tmp_path / "data" / "buffer.sqlite"
    try:
        run_id = httpx.post(f"{srv.url}/start_rollout", timeout=30, json={
            "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path,
            "num_repeat_per_sample": 2}).json()["run_id"]

        def play(instance_id: str) -> dict[str, Any]:
            session = open_session(srv.url, instance_id)
            client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 2 + 3?"}])
            answer = httpx.post(session["finish_url"], json={"reward": 1.0}, timeout=30)
            assert answer.status_code == 200 and answer.json()["status"] == "finished", answer.text
            return session

        # Parts of a batch the buffer cannot store (malformed, of a run it does not have) are refused alone.
        deadline = time.monotonic() + 60  # the secret is read from the worker's process once it is up
        while not (worker := httpx.get(f"{srv.url}/status", timeout=10).json()["session_workers"][0])["up"]:
            assert time.monotonic() < deadline, "the session worker did not come up"
            time.sleep(0.1)
        environ = Path(f"/proc/{worker['pid']}/environ").read_bytes().split(b"\0")
        secret = next(v for k, _, v in (e.partition(b"=") for e in environ) if k == WORKER_SECRET_ENV.encode())
        answer = httpx.post(f"{srv.url}/workers/records", headers={WORKER_SECRET_HEADER: secret.decode()}, json={
            "worker": 0, "events": [], "metrics": [], "records": [
                {"run_id": run_id, "records": []}, {"run_id": run_id, "records": [{"uid": 1}]},
                {"run_id": "no-such-run", "records": []}]}, timeout=10)
        assert answer.status_code == 200, answer.text
        assert sorted(answer.json()["refused"]) == ["1", "2"] and "no run" in answer.json()["refused"]["2"]

        killed = [play("killed") for _ in range(2)]
        assert stored(db, run_id) == [], "waiting in the outbox"
        worker = httpx.get(f"{srv.url}/status", timeout=10).json()["session_workers"][0]
        writes = store_writes(srv.url)
        os.kill(worker["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while len(stored(db, run_id)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stored(db, run_id) == sorted((s["uid"], "completed") for s in killed), "sent again by its next process"
        # The two sessions' records came in one request, and went to the store in one write.
        assert store_writes(srv.url) == writes + 1
        progress = httpx.get(f"{srv.url}/status", timeout=10).json()["run"]["progress"]
        assert (progress["done"], progress["failed"], progress["in_flight"]) == (2, 0, 0)

        last = play("stopped")
        finish_again = httpx.post(f"{srv.url}/sessions/{last['session_id']}/finish", json={"reward": 0}, timeout=30)
        assert finish_again.status_code == 409
    finally:
        srv.stop()
    assert stored(db, run_id) == sorted([(s["uid"], "completed") for s in killed] + [(last["uid"], "completed")])
    assert "records in its outbox were not stored" not in srv.log()

    restarted = srv.start()  # its worker finds the parcel stored already: nothing is stored twice
    try:
        outbox = tmp_path / "data" / "session-workers" / "0" / "outbox"
        deadline = time.monotonic() + 30
        while parcel_files(outbox) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert parcel_files(outbox) == []
    finally:
        restarted.stop()
    assert len(stored(db, run_id)) == 3
