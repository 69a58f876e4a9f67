"""Harness sessions survive a buffer restart: a real buffer subprocess killed with SIGKILL and started again on the
same store and port, the official `openai` client continuing its sessions on the simulated engine with the real
Qwen3 tokenizer. Exact tokens across the restart, branches kept, idle time counted across it, and sessions of a
run that did not resume closed as failed."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from masks import spans
from runs import drain
from servers import Server, free_port, sim_engine
from sessions import OPENAI_TOOLS, PARALLEL_TASK, assert_engine_tokens, finish, open_session, record, tool_results, view

from rollout_buffer.engine.client import EngineClient
from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.proxy.journal import Journal, load_sessions, replay
from rollout_buffer.proxy.messages import message_key, tools_key
from rollout_buffer.proxy.openai_chat import OpenAIChatAdapter
from rollout_buffer.proxy.session import ProxyOptions, Session
from rollout_buffer.proxy.session_files import SessionFiles
from rollout_buffer.proxy.tree import SessionTree


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    # Always right: an output is then a function of its prompt, which `assert_engine_tokens` regenerates.
    with sim_engine(tmp_path_factory.mktemp("restart-sim"), qwen_tokenizer_path, "--correct-rate", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A buffer subprocess; each test starts its own agent run (sessions only) in it."""
    tmp = tmp_path_factory.mktemp("restart-buffer")
    port = free_port()
    srv = Server(["serve", "--port", str(port), "--data-dir", str(tmp / "data")], "/healthz", port,
                 tmp / "buffer.log").start()
    srv.db = tmp / "data" / "buffer.sqlite"  # type: ignore[attr-defined]
    try:
        yield srv
    finally:
        srv.stop()


def start_agent_run(srv: Server, engine: Server, tokenizer: str, **options: Any) -> None:
    """Start (or replace) the buffer's run with an agent run of sessions only, groups of one session."""
    start = httpx.post(f"{srv.url}/start_rollout", timeout=30, json={
        "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": tokenizer,
        "num_repeat_per_sample": 1, "max_tokens": 4096, **options})
    assert start.status_code == 200, start.text


def restart(srv: Server) -> None:
    """kill -9, then the same command again (same store, same port)."""
    srv.kill9()
    srv.start()


def test_sessions_continue_after_kill_9_with_exact_tokens_and_branches(
        buffer: Server, engine: Server, qwen_tokenizer_path: str) -> None:
    srv = buffer
    start_agent_run(srv, engine, qwen_tokenizer_path)
    # A plain session: two turns before the crash.
    plain = open_session(srv.url, "plain", metadata={"task": "restart"})
    client = openai.OpenAI(base_url=plain["base_url"], api_key=plain["api_key"])
    chat: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
    replies = []
    for follow_up in ("And times 4?", "Now subtract 1."):
        reply = client.chat.completions.create(model="m", messages=chat)
        replies.append(reply)
        chat += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": follow_up}]
    # A session whose history was rewritten: branch 1 forked from branch 0 after its first turn.
    tree = open_session(srv.url, "branching")
    tools_client = openai.OpenAI(base_url=tree["base_url"], api_key=tree["api_key"])
    messages: list[dict[str, Any]] = [{"role": "user", "content": PARALLEL_TASK}]
    first = tools_client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    results = tool_results(first.choices[0].message.tool_calls)
    tools_client.chat.completions.create(model="m", messages=[*messages, *results], tools=OPENAI_TOOLS)
    edited = [{**results[0], "content": "88"}, results[1]]
    forked = tools_client.chat.completions.create(model="m", messages=[*messages, *edited], tools=OPENAI_TOOLS)
    before = view(srv.url, tree)["branches"]
    assert [(b["branch"], b["parent_branch"], b["turns"]) for b in before] == [(0, None, 2), (1, 0, 2)]
    # A Responses session the client chains by `previous_response_id`.
    chained = open_session(srv.url, "chained")
    responses = openai.OpenAI(base_url=chained["base_url"], api_key=chained["api_key"]).responses
    opening = responses.create(model="m", instructions="Be brief.", input="What is 2 + 3?")

    restart(srv)

    after_restart = responses.create(model="m", instructions="Be brief.", input="And times 4?",
                                     previous_response_id=opening.id)
    assert after_restart.status == "completed"
    assert [(b["turns"], b["messages"]) for b in view(srv.url, chained)["branches"]] == [(2, 5)]
    assert_engine_tokens(engine, record(srv.url, finish(srv.url, chained, 1.0)["uids"][0]))

    assert view(srv.url, tree)["branches"] == before  # the same tree, token counts and all
    third = client.chat.completions.create(model="m", messages=chat)  # the same client, the same URL and key
    stored = finish(srv.url, plain, 1.0)
    assert stored["records"] == 1 and stored["uids"] == [plain["uid"]]
    rec = record(srv.url, plain["uid"])
    trained = spans(rec["loss_mask"])
    assert len(trained) == 3
    # The third turn continued from the exact tokens held before the crash: its prompt is everything before
    # its own output, and each output is the engine's own ids for exactly that prefix.
    assert third.usage.prompt_tokens == trained[2][0]
    assert [end - start for start, end in trained] == [r.usage.completion_tokens for r in [*replies, third]]
    assert_engine_tokens(engine, rec)
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant"] * 3
    assert rec["extra_info"]["metadata"] == {"task": "restart"} and rec["extra_info"]["branch_turns"] == 3

    # The fork goes on after the restart; both branches become records.
    tools_client.chat.completions.create(model="m", tools=OPENAI_TOOLS, messages=[
        *messages, *edited, {"role": "assistant", "content": forked.choices[0].message.content},
        {"role": "user", "content": "Thanks. Anything else?"}])
    after = view(srv.url, tree)["branches"]
    assert [(b["branch"], b["turns"]) for b in after] == [(0, 2), (1, 3)] and after[0] == before[0]
    branch_records = [record(srv.url, uid) for uid in finish(srv.url, tree, 0.5)["uids"]]
    assert [r["extra_info"]["branch"] for r in branch_records] == [0, 1]
    for r in branch_records:
        assert_engine_tokens(engine, r)

    delivered = {r["uid"] for r in drain(srv.url)}
    assert delivered == {plain["uid"], chained["uid"], *(r["uid"] for r in branch_records)}


def test_idle_time_counts_across_a_clean_restart_and_a_replaced_run_fails_its_sessions(
        buffer: Server, engine: Server, qwen_tokenizer_path: str) -> None:
    srv, ttl = buffer, 5.0  # long beside a busy machine's restart and requests, short to wait out
    start_agent_run(srv, engine, qwen_tokenizer_path, session_ttl_s=ttl)
    idle = open_session(srv.url, "idle")
    openai.OpenAI(base_url=idle["base_url"], api_key=idle["api_key"]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hello?"}])
    last_request = time.monotonic()
    srv.stop()  # a clean stop (SIGTERM, an upgrade) keeps the session stored too, rather than closing it
    time.sleep(max(0.0, last_request + ttl + 0.2 - time.monotonic()))
    srv.start()
    # Idle longer than its TTL before the restart: closed at once, not after a fresh TTL from the restart (and
    # expired, not closed as failed by the shutdown).
    deadline = time.monotonic() + ttl / 2
    while httpx.get(f"{srv.url}/trajectories/{idle['uid']}", timeout=10).status_code == 404:
        assert time.monotonic() < deadline, "the idle session was not expired right after the restart"
        time.sleep(0.05)
    expired = record(srv.url, idle["uid"])
    assert expired["status"] == "failed" and expired["extra_info"]["error_kind"] == "session_expired"
    assert len(spans(expired["loss_mask"])) == 1  # its branch, as stored before the restart

    # A session of a run that was replaced while the buffer was down: closed as failed, with the reason.
    orphan = open_session(srv.url, "orphan")
    orphan_client = openai.OpenAI(base_url=orphan["base_url"], api_key=orphan["api_key"], max_retries=0)
    orphan_client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}])
    srv.kill9()
    db = sqlite3.connect(srv.db)  # type: ignore[attr-defined]
    with db:
        assert db.execute("UPDATE runs SET state='replaced' WHERE state='running'").rowcount == 1
    db.close()
    srv.start()
    failed = record(srv.url, orphan["uid"])
    assert failed["status"] == "failed" and failed["extra_info"]["error_kind"] == "session_failed"
    assert "replaced while the buffer was down" in failed["extra_info"]["error"]
    with pytest.raises(openai.NotFoundError):
        orphan_client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}])


def test_a_run_without_the_journal_writes_no_session_rows(buffer: Server, engine: Server,
                                                         qwen_tokenizer_path: str) -> None:
    start_agent_run(buffer, engine, qwen_tokenizer_path, session_journal=False)
    session = open_session(buffer.url, "memory-only")
    openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hello?"}])
    assert not (Path(buffer.db).parent / "sessions" / f"{session['session_id']}.session").exists()  # type: ignore[attr-defined]
    done = httpx.post(f"{buffer.url}/sessions/{session['session_id']}/finish", json={"reward": 1.0}, timeout=30)
    assert done.status_code == 200 and record(buffer.url, session["uid"])["status"] == "completed"


def test_the_journal_replays_every_branch_exactly_and_forgets_turns_taken_back(
        tmp_path: Path, engine: Server, qwen_tokenizer: Any) -> None:
    """In process: a session's turns (continued, forked, rewritten afresh, and taken back) written to its file,
    replayed into a new tree: every branch equal, field by field, and the replayed tree routes alike."""
    files = SessionFiles(tmp_path / "sessions")

    async def main() -> None:
        resources = RunResources("run-j", "agent", {}, EngineClient([engine.url]), qwen_tokenizer, {}, 4096)
        try:
            await scenario(resources)
        finally:
            await resources.engine.aclose()

    async def scenario(resources: RunResources) -> None:
        ctx = RolloutContext(resources, "i", 0, 0, "run-j:i:s-j")
        session = Session("s-j", "key", ctx, "harness", ProxyOptions(), "http://x/v1", "http://x",
                          journal=Journal(files, "s-j"))
        session.journal.opened("run-j", "i", ctx.uid, {})  # type: ignore[union-attr]

        def ask(messages: list[dict[str, Any]]) -> Any:
            return session.turn(OpenAIChatAdapter().parse({"model": "m", "messages": messages, "tools": OPENAI_TOOLS}))

        user = [{"role": "user", "content": PARALLEL_TASK}]
        first = await ask(user)
        calls = [{"id": f"c{i}", "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                 for i, c in enumerate(first.reply.calls)]
        history = [*user, {"role": "assistant", "content": first.reply.text, "tool_calls": calls}]
        results = [{"role": "tool", "tool_call_id": c["id"], "content": "87"} for c in calls]
        second = await ask([*history, *results])  # branch 0 continues
        await ask([*history, {**results[0], "content": "88"}, *results[1:]])  # branch 1 forks after turn 1
        taken_back = await ask([{"role": "user", "content": "Something else entirely."}])  # branch 2, new
        assert taken_back.new_branch and session.undo(taken_back)
        echoed = {"role": "assistant", "content": second.reply.text}
        again = await ask([*history, *results, echoed, {"role": "user", "content": "Thanks."}])
        assert again.route == "continue" and again.branch.id == 0 and session.undo(again)
        assert sorted(session.tree.branches) == [0, 1]

        stored = load_sessions(files)
        assert [s.session_id for s in stored] == ["s-j"] and len(stored[0].turns) == 3
        tree = SessionTree()
        replay(stored[0], ctx, tree, {})
        assert sorted(tree.branches) == [0, 1] and tree.latest is not None and tree.latest.id == 1
        fields = ("keys", "messages", "tools_key", "marks", "own_from", "parent", "shared_messages", "forked_at",
                  "tool_calls", "ill_formed", "protocols", "id")
        conv_fields = ("messages", "tools", "token_ids", "loss_mask", "log_probs", "weight_versions", "version_spans",
                       "prompt_length", "truncated", "finish_reason")
        for i, branch in session.tree.branches.items():
            twin = tree.branches[i]
            assert [getattr(twin, f) for f in fields] == [getattr(branch, f) for f in fields]
            assert [getattr(twin.conv, f) for f in conv_fields] == [getattr(branch.conv, f) for f in conv_fields]
            assert twin.conv.mark() == branch.conv.mark() and twin.conv.check() == branch.conv.check()
            assert twin.updated_at <= branch.updated_at  # a turn taken back leaves its time on the live branch
        follow_up = OpenAIChatAdapter().parse({"model": "m", "tools": OPENAI_TOOLS, "messages": [
            *history, *results, echoed, {"role": "user", "content": "Thanks."}]})
        keys, tools = [message_key(m) for m in follow_up.messages], tools_key(follow_up.tools)
        replayed, live = tree.route(keys, tools), session.tree.route(keys, tools)
        assert replayed.branch is tree.branches[0] and live.branch is session.tree.branches[0]
        route = (replayed.kind, replayed.turns, replayed.start)
        assert route == (live.kind, live.turns, live.start) == ("continue", 2, 5)

        session.journal.closed()  # type: ignore[union-attr]
        assert load_sessions(files) == []

    asyncio.run(main())
