"""Session workers (`serve --session-workers 2`): harness sessions served by worker processes of their own, with
the official `openai` and `anthropic` clients on the simulated engine and the real Qwen3 tokenizer.

Sessions are placed on the worker holding the fewest and reached at its own port; records come back to the buffer,
which groups and delivers them with exact tokens. A worker killed with SIGKILL comes back on the same port with
its sessions (the client's retry of the turn in flight succeeds at the same URL); unjournaled sessions it held
are recorded failed; a buffer killed and started again restores every worker's sessions. Calls to the wrong
worker or without the worker's secret are refused in the caller's protocol."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import psutil
import pytest
from agent_files import AGENTS
from environment_venvs import VERIFIERS_ENVS
from masks import spans
from runs import drain, wait_finished
from servers import Server, free_port, free_ports, sim_engine
from sessions import (
    ANTHROPIC_TOOLS,
    OPENAI_TOOLS,
    PARALLEL_TASK,
    assert_engine_tokens,
    decode_tail,
    finish,
    open_session,
    record,
    tool_results,
    view,
)

from generators.agent.sandbox import namespaces_work
from rollout_buffer.config import ServerConfig
from rollout_buffer.proxy.worker_launch import LocalLauncher
from rollout_buffer.proxy.worker_pool import SessionWorkers
from rollout_buffer.proxy.worker_sessions import WorkerUnavailable
from rollout_buffer.server.session_worker import create_worker_app


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    # Always right: an output is then a function of its prompt, which `assert_engine_tokens` regenerates.
    with sim_engine(tmp_path_factory.mktemp("workers-sim"), qwen_tokenizer_path, "--correct-rate", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def slow_engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    """Each request takes 1.5 s: long enough to kill a worker while a turn is in flight."""
    with sim_engine(tmp_path_factory.mktemp("workers-slow-sim"), qwen_tokenizer_path, "--correct-rate", "1",
                    "--latency-ms", "1500") as srv:
        yield srv


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A buffer with two session workers; each test starts its own agent run (sessions only) in it."""
    tmp = tmp_path_factory.mktemp("workers-buffer")
    port, first = free_port(), free_ports(2)
    srv = Server(["serve", "--port", str(port), "--data-dir", str(tmp / "data"), "--session-workers", "2",
                  "--session-worker-port", str(first)], "/healthz", port, tmp / "buffer.log").start()
    srv.db = tmp / "data" / "buffer.sqlite"  # type: ignore[attr-defined]
    srv.first_worker_port = first  # type: ignore[attr-defined]
    try:
        yield srv
    finally:
        srv.stop()


def start_run(srv: Server, engine: Server, tokenizer: str, **options: Any) -> str:
    answer = httpx.post(f"{srv.url}/start_rollout", timeout=30, json={
        "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": tokenizer,
        "num_repeat_per_sample": 2, "max_tokens": 4096, **options})
    assert answer.status_code == 200, answer.text
    run_id: str = answer.json()["run_id"]
    return run_id


def workers(srv: Server) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = httpx.get(f"{srv.url}/status", timeout=10).json()["session_workers"]
    return found


def stored_uids(srv: Server, run_id: str) -> list[str]:
    with sqlite3.connect(srv.db) as db:  # type: ignore[attr-defined]
        return [u for (u,) in db.execute("SELECT uid FROM trajectories WHERE run_id = ?", (run_id,))]


def wait_until(check: Any, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise TimeoutError("the condition did not hold in time")


def chat_turns(session: dict[str, Any], stream: bool) -> None:
    """A tool call, its results, the final answer: two turns."""
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": PARALLEL_TASK}]
    for _ in range(2):
        if stream:
            with client.chat.completions.stream(model="m", messages=messages, tools=OPENAI_TOOLS) as events:
                message = events.get_final_completion().choices[0].message
        else:
            message = client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS
                                                     ).choices[0].message
        if not message.tool_calls:
            assert message.content == "The results are: 12 * 7 + 3 = 87, 45 - 6 = 39."
            return
        messages.append({"role": "assistant", "content": None,
                         "tool_calls": [c.model_dump() for c in message.tool_calls]})
        messages += tool_results(message.tool_calls)
    raise AssertionError("no final answer")


def test_sessions_spread_over_workers_with_exact_tokens_and_whole_groups(
        buffer: Server, engine: Server, qwen_tokenizer_path: str) -> None:
    run_id = start_run(buffer, engine, qwen_tokenizer_path)
    sessions = [open_session(buffer.url, f"spread-{i // 2}") for i in range(4)]
    ports = {s["base_url"].split("/")[2] for s in sessions}
    first = buffer.first_worker_port  # type: ignore[attr-defined]
    assert ports == {f"127.0.0.1:{first}", f"127.0.0.1:{first + 1}"}, "least loaded first: both workers hold two"
    assert sorted(s["worker"] for s in sessions) == [0, 0, 1, 1]

    chat_turns(sessions[0], stream=False)
    chat_turns(sessions[1], stream=True)
    # Anthropic's client at the worker's address, tool use and its result.
    client = anthropic.Anthropic(base_url=sessions[2]["anthropic_base_url"], api_key=sessions[2]["api_key"],
                                 max_retries=0)
    asked: list[dict[str, Any]] = [{"role": "user", "content": PARALLEL_TASK}]
    reply = client.messages.create(model="c", max_tokens=512, messages=asked, tools=ANTHROPIC_TOOLS)
    uses = [b for b in reply.content if b.type == "tool_use"]
    asked += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "87"}
                                           for u in uses]}]
    assert client.messages.create(model="c", max_tokens=512, messages=asked, tools=ANTHROPIC_TOOLS
                                  ).stop_reason == "end_turn"
    # The Responses API, chained by previous_response_id.
    responses = openai.OpenAI(base_url=sessions[3]["base_url"], api_key=sessions[3]["api_key"], max_retries=0)
    first_answer = responses.responses.create(model="m", input="What is 2 + 3?")
    assert responses.responses.create(model="m", input="And 4 + 4?", previous_response_id=first_answer.id
                                      ).status == "completed"

    listed = httpx.get(f"{buffer.url}/sessions", params={"run_id": run_id}, timeout=10).json()["sessions"]
    assert sorted((s["session_id"], s["worker"]) for s in listed) == sorted(
        (s["session_id"], s["worker"]) for s in sessions), "the list holds every worker's sessions"
    assert [b["turns"] for b in view(buffer.url, sessions[0])["branches"]] == [2]
    assert all(w["up"] and w["sessions"] == 2 for w in workers(buffer))

    # Finished at the worker (the session's `finish_url`: the records reach the buffer in a batch) or at the buffer.
    assert [s["finish_url"] for s in sessions] == [s["anthropic_base_url"] + "/finish" for s in sessions]
    stored = [httpx.post(s["finish_url"], json={"reward": float(i)}, timeout=60).json() if i % 2 == 0
              else finish(buffer.url, s, float(i)) for i, s in enumerate(sessions)]
    assert [(s["success"], s["records"], s["status"]) for s in stored] == [(True, 1, "finished")] * 4
    again = httpx.post(sessions[0]["finish_url"], json={"reward": 1.0}, timeout=60)
    assert again.status_code == 409 and "already finished" in again.json()["message"]
    records = drain(buffer.url)
    assert sorted(r["uid"] for r in records) == sorted(u for s in stored for u in s["uids"])
    by_group: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_group.setdefault(r["instance_id"], []).append(r)
    assert sorted(len(g) for g in by_group.values()) == [2, 2], "whole groups of two, across workers"
    for r in records:
        assert r["status"] == "completed" and len(spans(r["loss_mask"])) == 2
        assert_engine_tokens(engine, r)
    assert sorted(r["extra_info"]["protocols"][0] for r in records) == ["anthropic", "openai", "openai", "responses"]
    status = wait_until(lambda: (lambda s: s if s["run"]["progress"]["in_flight"] == 0 else None)(
        httpx.get(f"{buffer.url}/status", timeout=10).json()), 10)  # the workers tell of their closes in batches
    assert status["run"]["progress"]["done"] == 4
    assert all(w["sessions"] == 0 for w in status["session_workers"])
    # Closed on their workers, the sessions are still answered for as the buffer's own are: a finish again is a
    # 409, whether it was finished at the worker or at the buffer, and the view stays.
    for s in sessions[:2]:
        again = httpx.post(f"{buffer.url}/sessions/{s['session_id']}/finish", json={"reward": 0.0}, timeout=60)
        assert again.status_code == 409 and "already finished" in again.json()["message"], again.text
    assert view(buffer.url, sessions[1])["state"] == "finished"
    assert sorted(stored_uids(buffer, run_id)) == sorted(r["uid"] for r in records), "each record stored once"

    def turns_counted() -> bool:  # the workers' metrics reach the buffer's /metrics
        text = httpx.get(f"{buffer.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("rollout_buffer_proxy_turns_total{")) >= 8

    wait_until(turns_counted, 10)


def test_an_agent_run_opens_on_every_worker_before_its_first_session(
        buffer: Server, engine: Server, qwen_tokenizer_path: str) -> None:
    """Each worker loads the run's tokenizer and engine client when the run gets ready, not when the first
    session lands on it: a harness's first sessions do not wait seconds for that."""
    served = [w["served"] for w in workers(buffer)]
    run_id = start_run(buffer, engine, qwen_tokenizer_path)
    opened = wait_until(lambda: (ws := workers(buffer)) and all(run_id in w["runs"] for w in ws) and ws)
    assert [w["served"] for w in opened] == served  # no session placed meanwhile
    assert all(w["runs"] == [run_id] for w in opened)  # the runs before it ended on the workers too


def test_the_workers_and_the_simulated_engine_tokenize_without_torch(
        buffer: Server, engine: Server, qwen_tokenizer_path: str) -> None:
    """They run only the buffer's own code and use transformers for a tokenizer alone: torch, which transformers
    imports whenever it is installed, stays out of them (its start-up CPU and memory, in every worker)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here: there is nothing to keep out")
    run_id = start_run(buffer, engine, qwen_tokenizer_path)
    wait_until(lambda: all(run_id in w["runs"] for w in workers(buffer)))  # each loaded the run's tokenizer
    chat_turns(open_session(buffer.url, "no-torch"), stream=False)
    procs = [p for p in psutil.Process(buffer.proc.pid).children(recursive=True)
             if "session-worker" in " ".join(p.cmdline())]
    assert len(procs) == 2
    for proc in [*procs, psutil.Process(engine.proc.pid)]:
        mapped = {m.path for m in proc.memory_maps()}
        assert any("/tokenizers/" in path for path in mapped), proc.cmdline()  # its tokenizer is loaded
        assert not any("libtorch" in path for path in mapped), proc.cmdline()


def test_a_worker_killed_mid_turn_comes_back_with_its_sessions(
        buffer: Server, slow_engine: Server, qwen_tokenizer_path: str) -> None:
    run_id = start_run(buffer, slow_engine, qwen_tokenizer_path)
    victim, other = open_session(buffer.url, "killed"), open_session(buffer.url, "killed")
    assert victim["worker"] != other["worker"]
    client = openai.OpenAI(base_url=victim["base_url"], api_key=victim["api_key"], max_retries=10)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
    first = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And 4 + 4?"}]

    answers: list[Any] = []
    turn = threading.Thread(target=lambda: answers.append(client.chat.completions.create(model="m",
                                                                                      messages=messages)))
    turn.start()
    time.sleep(0.5)  # the turn waits for the engine
    pid = workers(buffer)[victim["worker"]]["pid"]
    sockets = Path(tempfile.gettempdir())
    assert list(sockets.glob(f"rollout-buffer-agents-{pid}-*")), "the worker's agent socket folder"
    os.kill(pid, signal.SIGKILL)
    # The other worker's session goes on meanwhile.
    other_client = openai.OpenAI(base_url=other["base_url"], api_key=other["api_key"], max_retries=0)
    assert other_client.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 1 + 1?"}]
                                                ).choices[0].finish_reason == "stop"
    turn.join(120)
    assert answers and answers[0].choices[0].finish_reason == "stop", "the client's retry at the same URL succeeded"
    after = workers(buffer)[victim["worker"]]
    assert after["restarts"] == 1 and after["pid"] != pid and after["up"]
    assert not list(sockets.glob(f"rollout-buffer-agents-{pid}-*")), "the dead worker's folder went with it"
    assert list(sockets.glob(f"rollout-buffer-agents-{after['pid']}-*"))
    assert [b["turns"] for b in view(buffer.url, victim)["branches"]] == [2], "restored, with the retried turn"

    uids = [u for s in (victim, other) for u in finish(buffer.url, s, 1.0)["uids"]]
    records = drain(buffer.url)
    assert sorted(r["uid"] for r in records) == sorted(uids) and len(records) == 2
    assert sorted(stored_uids(buffer, run_id)) == sorted(uids), "nothing lost, nothing stored twice"
    victim_record = next(r for r in records if r["uid"] == victim["uid"])
    assert len(spans(victim_record["loss_mask"])) == 2
    assert_engine_tokens(slow_engine, victim_record)
    progress = httpx.get(f"{buffer.url}/status", timeout=10).json()["run"]["progress"]
    assert progress["in_flight"] == 0 and progress["done"] == 2 and progress["failed"] == 0
    assert "worker 0 exited" in buffer.log() or "worker 1 exited" in buffer.log()


def test_unjournaled_sessions_of_a_lost_worker_are_recorded_failed(
        buffer: Server, engine: Server, qwen_tokenizer_path: str) -> None:
    run_id = start_run(buffer, engine, qwen_tokenizer_path, session_journal=False, num_repeat_per_sample=1)
    session = open_session(buffer.url, "unjournaled")
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 2 + 3?"}])
    before = workers(buffer)[session["worker"]]
    os.kill(before["pid"], signal.SIGKILL)
    wait_until(lambda: (w := workers(buffer)[session["worker"]])["up"] and w["restarts"] == before["restarts"] + 1)
    failed = record(buffer.url, session["uid"])
    assert failed["status"] == "failed" and failed["extra_info"]["error_kind"] == "session_failed"
    assert "was not journaled" in failed["extra_info"]["error"]
    with pytest.raises(openai.NotFoundError) as gone:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 2 + 3?"}])
    assert "unknown session" in str(gone.value)
    assert stored_uids(buffer, run_id) == [session["uid"]]
    assert httpx.get(f"{buffer.url}/status", timeout=10).json()["run"]["progress"]["in_flight"] == 0


def test_a_restarted_buffer_restores_every_workers_sessions(
        buffer: Server, engine: Server, qwen_tokenizer_path: str) -> None:
    run_id = start_run(buffer, engine, qwen_tokenizer_path, num_repeat_per_sample=2)
    sessions = [open_session(buffer.url, "restart") for _ in range(2)]
    clients = [openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=10) for s in sessions]
    histories: list[list[dict[str, Any]]] = []
    for client in clients:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
        answer = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
        histories.append([*messages, {"role": "assistant", "content": answer},
                          {"role": "user", "content": "And 4 + 4?"}])
    old_pids = {w["pid"] for w in workers(buffer)}
    buffer.kill9()
    wait_until(lambda: not any(_alive(pid) for pid in old_pids), 10)  # they died with the buffer
    buffer.start()
    assert {w["pid"] for w in workers(buffer)}.isdisjoint(old_pids)
    for client, messages in zip(clients, histories, strict=True):
        assert client.chat.completions.create(model="m", messages=messages).choices[0].finish_reason == "stop"
    uids = [u for s in sessions for u in finish(buffer.url, s, 1.0)["uids"]]
    records = drain(buffer.url)
    assert sorted(r["uid"] for r in records) == sorted(uids) == sorted(stored_uids(buffer, run_id))
    for r in records:
        assert len(spans(r["loss_mask"])) == 2, "the turn before the restart and the one after, one branch"
        assert_engine_tokens(engine, r)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_calls_to_the_wrong_worker_or_without_its_secret_are_refused(
        buffer: Server, engine: Server, qwen_tokenizer_path: str) -> None:
    start_run(buffer, engine, qwen_tokenizer_path, num_repeat_per_sample=1)
    session = open_session(buffer.url, "wrong-worker")
    first = buffer.first_worker_port  # type: ignore[attr-defined]
    wrong = f"http://127.0.0.1:{first + 1 - session['worker']}/sessions/{session['session_id']}/v1"
    client = openai.OpenAI(base_url=wrong, api_key=session["api_key"], max_retries=0)
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["message"] == (  # type: ignore[index]
        f"session {session['session_id']} was placed on session worker {session['worker']}, not on this one "
        f"({1 - session['worker']}): send its requests to the base_url that POST /sessions answered")
    worker_url = session["base_url"].rsplit("/sessions/", 1)[0]
    for path in ["/worker/sessions/list", "/worker/sessions", "/worker/journal", "/worker/restore",
                 f"/worker/sessions/{session['session_id']}/finish", f"/worker/sessions/{session['session_id']}/view"]:
        answer = httpx.post(worker_url + path, json={}, timeout=10)
        assert answer.status_code == 403 and "the buffer's" in answer.json()["message"], (path, answer.text)
    assert httpx.head(f"{worker_url}/sessions/{session['session_id']}", timeout=10).status_code == 200
    # The worker's agent socket (for sandboxed agents) serves a session's endpoints with its key, nothing else.
    pid = workers(buffer)[session["worker"]]["pid"]
    path = next(c.laddr for c in psutil.Process(pid).net_connections(kind="unix") if c.laddr.endswith("agents.sock"))
    with httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://worker", timeout=10) as on_socket:
        assert on_socket.post("/worker/sessions/list", json={}).status_code == 403
        assert on_socket.post(f"/sessions/{session['session_id']}/finish", json={"reward": 1.0}).status_code == 403
        assert on_socket.get("/healthz").status_code == 403
        turn = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        chat = f"/sessions/{session['session_id']}/v1/chat/completions"
        assert on_socket.post(chat, json=turn).status_code == 401
        answer = on_socket.post(chat, json=turn, headers={"Authorization": f"Bearer {session['api_key']}"})
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"], answer.text
    elsewhere = httpx.post(session["finish_url"].replace(session["base_url"].split("/")[2], wrong.split("/")[2]),
                           json={"reward": 1.0}, timeout=10)
    assert elsewhere.status_code == 404 and not elsewhere.json()["success"], "finished at the wrong worker"
    forged = httpx.post(f"{buffer.url}/workers/records", json={"records": []}, timeout=10)
    assert forged.status_code == 403 and "session workers" in forged.json()["message"]
    assert finish(buffer.url, session, 1.0)["records"] == 1


def test_a_harness_finishes_at_a_worker_with_the_servers_token_never_a_sessions_key(tmp_path: Path) -> None:
    config = ServerConfig(data_dir=tmp_path, auth_token="server-token")
    app = create_worker_app(config, 0, "http://127.0.0.1:9", "worker-secret")

    async def calls() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as worker:
            finish_url, reward = "/sessions/s-1/finish", {"reward": 1.0}
            token = {"Authorization": "Bearer server-token"}
            assert (await worker.post(finish_url, json=reward)).status_code == 401
            as_agent = await worker.post(finish_url, json=reward, headers={"Authorization": "Bearer a-session-key"})
            assert as_agent.status_code == 401 and not as_agent.json()["success"]
            as_harness = await worker.post(finish_url, json=reward, headers=token)
            # Past the checks: this worker has not been told which sessions it restores yet.
            assert as_harness.status_code == 503 and "send the request again" in as_harness.json()["message"]
            bad = await worker.post(finish_url, json={"reward": "high"}, headers=token)
            assert bad.status_code == 422 and "reward" in bad.json()["message"]
            listed = await worker.post("/worker/sessions/list", json={}, headers=token)
            assert listed.status_code == 403, "the token finishes sessions; the rest is the buffer's"

    asyncio.run(calls())


def test_session_worker_ports_are_checked() -> None:
    with pytest.raises(ValueError, match="session_worker_port"):
        ServerConfig(port=9000, session_workers=2, session_worker_port=8999)
    with pytest.raises(ValueError, match="session_worker_port"):
        ServerConfig(port=9000, session_workers=2, session_worker_port=65535)
    assert ServerConfig(port=9000, session_workers=2).first_worker_port == 9001


def test_a_session_goes_to_a_worker_on_the_node_named_else_to_the_least_loaded() -> None:
    config = ServerConfig(session_workers=3)
    pool = SessionWorkers(config, LocalLauncher(config))
    a, b1, b2 = pool.slots
    a.where, b1.where, b2.where = ({"node": "10.0.0.1", "node_id": "n-a"}, {"node": "10.0.0.2", "node_id": "n-b"},
                                   {"node": "10.0.0.2", "node_id": "n-b"})
    with pytest.raises(WorkerUnavailable, match="no session worker is up"):
        pool.slots.pick()
    for slot in pool.slots:
        slot.up.set()
    b1.sessions.add("s-1")
    a.sessions.update({"s-2", "s-3"})
    # By the node's address or its Ray id, the least loaded there; elsewhere (or no hint): the least loaded.
    assert pool.slots.pick("10.0.0.2") is b2 and pool.slots.pick("n-b") is b2 and pool.slots.pick("n-a") is a
    assert pool.slots.pick("10.9.9.9") is b2 and pool.slots.pick() is b2
    a.up.clear()
    assert pool.slots.pick("n-a") is b2  # a hint, not a requirement: the run goes on with the workers it has


def test_a_session_opened_while_the_workers_start_waits_for_one_unless_they_failed_to_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A harness opening sessions right after start-up (or while its workers start again) is answered once a
    worker is up, not refused, even past a failed try; a worker that failed to start three times in a row is
    not waited for, and the refusal says why."""
    config = ServerConfig(session_workers=2)
    pool = SessionWorkers(config, LocalLauncher(config))
    a, b = pool.slots

    async def scenario() -> None:
        monkeypatch.setattr("rollout_buffer.proxy.worker_ledger.UP_WAIT_S", 3600.0)
        picked = asyncio.create_task(pool.slots.pick_when_up())
        await asyncio.sleep(0.05)
        assert not picked.done()  # both are starting: it waits
        pool.slots.start_ended(a, "the port is taken")
        await asyncio.sleep(0.05)
        assert not picked.done()  # one failed once (it is tried again), the other is starting still
        pool.slots.start_ended(b)
        assert await asyncio.wait_for(picked, 5) is b
        b.up.clear()
        picked = asyncio.create_task(pool.slots.pick_when_up())
        for _ in range(3):
            await asyncio.sleep(0.05)
            assert not picked.done()  # waits through worker 1's first failed tries
            pool.slots.start_ended(b, "no node has 64 CPUs")
        pool.slots.start_ended(a, "the port is taken")
        pool.slots.start_ended(a, "the port is taken")
        with pytest.raises(WorkerUnavailable, match="worker 0 did not start: the port is taken; worker 1 did not "
                                                    "start: no node has 64 CPUs"):
            await asyncio.wait_for(picked, 5)  # refused once both failed three times, not after the wait
        with pytest.raises(WorkerUnavailable, match="worker 1 did not start"):
            await asyncio.wait_for(pool.slots.pick_when_up(), 5)  # at once: neither is waited for
        pool.slots.start_ended(a)
        a.up.clear()  # worker 0 exited after it was up: starting again, waited for
        monkeypatch.setattr("rollout_buffer.proxy.worker_ledger.UP_WAIT_S", 0.05)
        with pytest.raises(WorkerUnavailable, match="worker 1 did not start"):
            await pool.slots.pick_when_up()  # but not up in time

    asyncio.run(scenario())


def test_agent_runs_open_their_sessions_on_the_workers(
        buffer: Server, engine: Server, qwen_tokenizer_path: str, stdlib_agent: Path, tmp_path: Path
) -> None:
    """An `agent_command` run (the sandboxed subprocess agent) and a callable agent's run: each trajectory's
    session on a worker, records stored by the runner with exact tokens, whole groups."""
    prompt = "What is 12 * 7 + 3? Use the calculator."
    rows = tmp_path / "tasks.jsonl"
    rows.write_text("".join(json.dumps({"instance_id": f"agent-{i}", "prompt": prompt, "label": "87"}) + "\n"
                            for i in range(2)))
    for agent in ({"agent_command": [str(stdlib_agent)]}, {"agent": f"{AGENTS / 'openai_agent.py'}:agent"}):
        served = [w["served"] for w in workers(buffer)]
        run_id = start_run(buffer, engine, qwen_tokenizer_path, input_file=str(rows), num_process=4, **agent)
        status = wait_finished(buffer.url, timeout_s=120)
        assert status["run"]["run_id"] == run_id and status["run"]["progress"]["failed"] == 0, status["run"]
        now = [w["served"] for w in workers(buffer)]
        assert [n - before for n, before in zip(now, served, strict=True)] == [2, 2], (served, now)
        records = drain(buffer.url)
        assert sorted(r["instance_id"] for r in records) == ["agent-0", "agent-0", "agent-1", "agent-1"]
        for r in records:
            assert r["status"] == "completed" and r["raw_reward"] == 1.0 and r["extra_info"]["tool_calls"] == 1
            assert r["uid"].startswith(f"{run_id}:") and len(spans(r["loss_mask"])) == 2
            assert_engine_tokens(engine, r)
            if "agent_command" in agent and namespaces_work():  # sandboxed without a network: the worker's socket
                assert r["extra_info"]["agent"]["network"] == "isolated", r["extra_info"]["agent"]
        assert sorted(stored_uids(buffer, run_id)) == sorted(r["uid"] for r in records)


def test_role_streams_and_the_staleness_bound_across_workers(
        buffer: Server, engine: Server, qwen_tokenizer_path: str, tmp_path: Path) -> None:
    # Role streams: each episode (a group of one) has a planner session and an actor session, on different workers.
    start_run(buffer, engine, qwen_tokenizer_path, num_repeat_per_sample=1)
    for episode in range(2):
        for role in ("planner", "actor"):
            session = open_session(buffer.url, f"roles-{episode}")
            client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"What is {episode} + 2?"}])
            done = httpx.post(f"{buffer.url}/sessions/{session['session_id']}/finish", timeout=60, json={
                "reward": 1.0, "extra_info": {"agent_id": role, "episode_id": f"episode-{episode}"}})
            assert done.status_code == 200, done.text
    for role in ("planner", "actor"):
        batch = fetch(buffer.url, agent_id=role, max_groups=4)
        assert batch["meta_info"]["agent_id"] == role and len(batch["data"]) == 2
        assert {r["extra_info"]["agent_id"] for r in batch["data"]} == {role}
    drain(buffer.url)

    # The staleness bound: an agent run's trajectories start as admission allows, their sessions on the workers.
    rows = tmp_path / "stale.jsonl"
    rows.write_text("".join(json.dumps({"instance_id": f"stale-{i}", "prompt": "What is 12 * 7 + 3? Use the "
                                        "calculator.", "label": "87"}) + "\n" for i in range(4)))
    served = sum(w["served"] for w in workers(buffer))
    start_run(buffer, engine, qwen_tokenizer_path, input_file=str(rows), agent=f"{AGENTS / 'openai_agent.py'}:agent",
              max_staleness=1, rollout_batch_size=1, current_version=0, num_process=8)

    def paused() -> dict[str, Any] | None:
        s = httpx.get(f"{buffer.url}/status", timeout=10).json()
        adm = s["control"]["admission"]
        idle = s["run"]["progress"].get("in_flight") == 0
        return adm if adm.get("state") == "paused_staleness" and idle else None

    assert wait_until(paused)["started_groups"] == 2, "(η + 1) × B = 2 groups before the trainer moves"
    assert sum(w["served"] for w in workers(buffer)) - served == 4
    records: list[dict[str, Any]] = []
    for _ in range(4):  # each batch the trainer takes lets one more group start
        batch = fetch(buffer.url, max_groups=1, current_version=0, wait_s=60)
        assert len(batch["data"]) == 2, batch["meta_info"]
        records += batch["data"]
    status = wait_finished(buffer.url, timeout_s=120)
    assert status["run"]["progress"]["done"] == 8 and status["run"]["progress"]["failed"] == 0
    assert sum(w["served"] for w in workers(buffer)) - served == 8
    assert sorted(r["instance_id"] for r in records) == sorted(f"stale-{i}" for i in range(4) for _ in range(2))
    for r in records:
        assert_engine_tokens(engine, r)


def fetch(url: str, **body: Any) -> dict[str, Any]:
    """One leased fetch, acked; the answer's data."""
    answer = httpx.post(f"{url}/get_rollout_data", json={"lease_s": 60, "wait_s": 5, **body}, timeout=120)
    assert answer.status_code == 200, answer.text
    data: dict[str, Any] = answer.json()["data"]
    if data["meta_info"].get("batch_id"):
        ack = {"batch_id": data["meta_info"]["batch_id"], **({"agent_id": body["agent_id"]} if "agent_id" in body
                                                             else {})}
        httpx.post(f"{url}/ack", json=ack, timeout=10).raise_for_status()
    return data


def test_an_environments_episodes_run_through_sessions_on_the_workers(
        buffer: Server, engine: Server, qwen_tokenizer_path: str, verifiers_python: str) -> None:
    """verifiers' tool-using environment in its own venv: each episode's session on a worker, the harness's command
    output between the two model turns at loss 0, the engine's exact tokens."""
    served = [w["served"] for w in workers(buffer)]
    answer = httpx.post(f"{buffer.url}/start_rollout", timeout=600, json={
        "task_type": "verifiers", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path,
        "env_python": verifiers_python, "env_id": "rb_shell", "env_paths": [str(VERIFIERS_ENVS)],
        "num_repeat_per_sample": 1, "max_tokens": 4096})
    assert answer.status_code == 200, answer.text
    status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["statuses"] == {"completed": 2}, status["run"]["progress"]
    assert [w["served"] - before for w, before in zip(workers(buffer), served, strict=True)] == [1, 1]
    for rec in drain(buffer.url):
        n = int(rec["instance_id"].split("-")[1])
        trained = spans(rec["loss_mask"])
        assert len(trained) == 2 and f"rb-marker-{n * 7}" in decode_tail(rec["tokens"][trained[0][1]:trained[1][0]])
        assert_engine_tokens(engine, rec)
