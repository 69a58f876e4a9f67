"""Long sessions: the buffer's CPU for a turn against the context a coding agent resends with it.

Coding agents resend their whole history every turn. `--sessions` sessions advance in lockstep, one request at a
time, each turn resending everything plus a tool output of about `--new-tokens` tokens, until the context holds
`--context-tokens`. For every turn the buffer's CPU is read from the scheduler's per-thread counters
(`/proc/PID/task/*/schedstat`, nanoseconds) before and after the request, so it is that turn's alone, and of it
the serving process's event loop (its main thread; long texts are tokenized in other threads); beside it,
the CPU this process spends tokenizing the turn's new text with the same tokenizer, its fastest way (the Rust
tokenizer without offsets, as the buffer does): the floor any exact-token proxy pays. And the part of a turn no
proxy between a resending agent and SGLang's `/generate` avoids: the same body sent to a proxy that does nothing
but receive it and send a body the size of the turn's ids as JSON to another process (`bench/bytes_floor.py`), its
CPU read the same way. A turn's CPU should follow its new tokens, not its context: the late turns' ratio to the
tokenizing should equal the early turns', and what the late turns grow by should be what moving their bytes grows
by.

    python -m bench.proxy --long-session                                  # chat completions, to 128k tokens
    python -m bench.proxy --long-session --protocol responses --context-tokens 65536
    python -m bench.proxy --long-session --workers 2     # sessions on session workers: their CPU beside the buffer's
    python -m bench.proxy --long-session --workers 1 --front   # reached through a forwarding front: its CPU too
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from rich.console import Console
from rich.table import Table

from bench.bytes_floor import bytes_floor
from bench.forwarding_front import forwarding_front, through
from bench.harness import REPO, Service, free_ports, rollout_buffer, sim_engine
from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path, load_tokenizer

console = Console(width=200)
REPLY_TOKENS = 256
JSON = {"content-type": "application/json"}


@dataclass
class Turn:
    """One measured turn."""

    context_tokens: int
    new_tokens: int
    buffer_ms: float
    tokenize_ms: float
    worker_ms: float = 0.0  # the CPU of the session worker serving the session (`--workers`)
    engine_ms: float = 0.0  # the simulated engine's, on the same cores: its work can slow the buffer's (caches)
    loop_ms: float = 0.0  # of the serving process's CPU (buffer or worker), its event loop's (the rest: threads)
    front_ms: float = 0.0  # the forwarding front's (`--front`): what one address for every session would add
    bytes_ms: float = 0.0  # a bare proxy's, receiving the same body and sending the ids' bytes (`bytes_floor`)

    @property
    def total_ms(self) -> float:
        """The turn's CPU in the buffer and in its session worker."""
        return self.buffer_ms + self.worker_ms


def process_cpu_ns(pid: int) -> int:
    """CPU time of every thread of `pid` so far, in nanoseconds (threads that ended are not counted: the buffer's
    threads, a session worker's and the engine stand-in's live as long as they do)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def loop_cpu_ns(pid: int) -> int:
    """CPU time of `pid`'s main thread so far, in nanoseconds: the event loop of the buffer and of a session worker
    (tokenizing long texts and storing happen in other threads)."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0])


def tool_output(turn: int, tokens: int, tokenizer: Any) -> str:
    """A file listing of about `tokens` tokens, different every turn (as a tool's output would be)."""
    lines: list[str] = []
    while len(tokenizer.encode("\n".join(lines))) < tokens:
        lines += [f"def handler_{turn}_{i}(request, retries={i % 7}):\n    return dispatch(request, {turn * 31 + i})"
                  for i in range(len(lines), len(lines) + 16)]
    return "\n".join(lines)


class Protocol:
    """How a history is sent and a reply read back in one wire format."""

    def __init__(self, name: str, opened: dict[str, Any], front_url: str | None = None):
        self.name, self.session_id = name, opened["session_id"]
        self.base_url = through(front_url, opened["base_url"])
        self.anthropic_base_url = through(front_url, opened["anthropic_base_url"])
        self.history: list[dict[str, Any]] = []
        self.worker_pid: int | None = None  # the session worker serving it, if one does
        self.headers = {**JSON, "authorization": f"Bearer {opened['api_key']}"}

    def add_user(self, text: str) -> None:
        if self.name == "responses":
            self.history.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        else:
            self.history.append({"role": "user", "content": text})

    def request(self) -> tuple[str, dict[str, Any]]:
        if self.name == "chat":
            return f"{self.base_url}/chat/completions", {"model": "m", "messages": self.history,
                                                         "max_tokens": REPLY_TOKENS}
        if self.name == "responses":
            return f"{self.base_url}/responses", {"model": "m", "input": self.history, "store": False,
                                                  "max_output_tokens": REPLY_TOKENS}
        return f"{self.anthropic_base_url}/v1/messages", {"model": "m", "messages": self.history,
                                                          "max_tokens": REPLY_TOKENS}

    def add_reply(self, answer: dict[str, Any]) -> None:
        if self.name == "chat":
            self.history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        elif self.name == "responses":
            self.history += [item for item in answer["output"] if item["type"] == "message"]
        else:
            self.history.append({"role": "assistant", "content": [
                b for b in answer["content"] if b["type"] == "text"]})


def run(buffer: Service, engine: Service, floor: Service, protocol: str, sessions: int, new_tokens: int,
        context_tokens: int, front: Service | None = None) -> list[Turn]:
    """The turns of `sessions` sessions grown to `context_tokens`, each measured, and the same bodies sent to the
    bare proxy `floor` (`bench.bytes_floor`)."""
    tokenizer = load_tokenizer(bundled_tokenizer_path())
    httpx.post(f"{buffer.url}/start_rollout", timeout=60, json={
        "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": bundled_tokenizer_path(),
        "num_repeat_per_sample": 1, "max_tokens": 2 * context_tokens, "session_ttl_s": 3600}).raise_for_status()
    http = httpx.Client(timeout=120)
    convs = []
    workers = {w["worker"]: w["pid"] for w in http.get(f"{buffer.url}/status").json().get("session_workers", [])}
    for s in range(sessions):
        opened = http.post(f"{buffer.url}/sessions", json={"instance_id": f"long-{s}"}).json()
        conv = Protocol(protocol, opened, front.url if front else None)
        conv.worker_pid = workers.get(opened.get("worker", -1))
        conv.add_user("You are a coding agent. Read the files I show you and say what each does, briefly.")
        convs.append(conv)
    turns: list[Turn] = []
    context = 0
    turn = 0
    json_bytes_per_id = 0.0  # of the ids the engine gets: as in the tool outputs' ids
    while context < context_tokens:
        text = tool_output(turn, new_tokens, tokenizer)
        started = time.thread_time_ns()
        ids = tokenizer.backend_tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        tokenize_ms = (time.thread_time_ns() - started) / 1e6
        new = len(ids)
        json_bytes_per_id = json_bytes_per_id or len(orjson.dumps(ids)) / new
        for conv in convs:
            conv.add_user(text)
            url, request = conv.request()
            body = orjson.dumps(request)  # one serialization, sent to the buffer and to the bare proxy
            serving = conv.worker_pid or buffer.pid
            worker_before = process_cpu_ns(conv.worker_pid) if conv.worker_pid else 0
            before, engine_before = process_cpu_ns(buffer.pid), process_cpu_ns(engine.pid)
            loop_before = loop_cpu_ns(serving)
            front_before = process_cpu_ns(front.pid) if front else 0
            answer = http.post(url, content=body, headers=conv.headers)
            front_spent = process_cpu_ns(front.pid) - front_before if front else 0
            loop_spent = loop_cpu_ns(serving) - loop_before
            spent, engine_spent = process_cpu_ns(buffer.pid) - before, process_cpu_ns(engine.pid) - engine_before
            worker_spent = process_cpu_ns(conv.worker_pid) - worker_before if conv.worker_pid else 0
            answer.raise_for_status()
            reply = answer.json()
            conv.add_reply(reply)
            usage = reply["usage"]
            context = usage.get("prompt_tokens", usage.get("input_tokens", 0))
            floor_before = process_cpu_ns(floor.pid)
            http.post(floor.url, content=body, headers={
                **JSON, "x-forward-bytes": str(round(context * json_bytes_per_id))}).raise_for_status()
            floor_spent = process_cpu_ns(floor.pid) - floor_before
            turns.append(Turn(context, new, spent / 1e6, tokenize_ms, worker_spent / 1e6, engine_spent / 1e6,
                              loop_spent / 1e6, front_spent / 1e6, floor_spent / 1e6))
        turn += 1
    for conv in convs:  # a turn that did not continue its branch was rendered afresh: not what is measured
        branches = http.get(f"{buffer.url}/sessions/{conv.session_id}").json()["branches"]
        if [b["turns"] for b in branches] != [turn]:
            raise SystemExit(f"session {conv.session_id} did not continue one branch: {branches}")
    return turns


def report(turns: list[Turn], title: str) -> None:
    """A table of the turns by context length (median of each bucket) and the summary line."""
    table = Table(title=title)
    on_workers = any(t.worker_ms for t in turns)
    via_front = any(t.front_ms for t in turns)
    for column in ("context tokens", "new tokens", "buffer CPU ms/turn",
                   *(["worker CPU ms/turn"] if on_workers else []), *(["front CPU ms/turn"] if via_front else []),
                   "of which its event loop", "tokenizing new tokens ms",
                   "(buffer + worker) / tokenizing" if on_workers else "buffer / tokenizing",
                   "moving its bytes ms (a bare proxy)", "engine stand-in CPU ms/turn"):
        table.add_column(column, justify="right")
    buckets: dict[int, list[Turn]] = {}
    for t in turns:
        buckets.setdefault(t.context_tokens // 16384, []).append(t)
    for _, group in sorted(buckets.items()):
        cpu = statistics.median(t.buffer_ms for t in group)
        tok = statistics.median(t.tokenize_ms for t in group)
        worker = [f"{statistics.median(t.worker_ms for t in group):.2f}"] if on_workers else []
        worker += [f"{statistics.median(t.front_ms for t in group):.2f}"] if via_front else []
        table.add_row(f"{min(t.context_tokens for t in group)}–{max(t.context_tokens for t in group)}",
                      f"{statistics.median(t.new_tokens for t in group):.0f}", f"{cpu:.2f}", *worker,
                      f"{statistics.median(t.loop_ms for t in group):.2f}", f"{tok:.2f}",
                      f"{statistics.median(t.total_ms for t in group) / tok:.2f}",
                      f"{statistics.median(t.bytes_ms for t in group):.2f}",
                      f"{statistics.median(t.engine_ms for t in group):.2f}")
    console.print(table)
    quarter = max(1, len(turns) // 4)
    early, late = turns[:quarter], turns[-quarter:]
    early_cpu = statistics.median(t.total_ms for t in early)
    late_cpu = statistics.median(t.total_ms for t in late)
    late_tok = statistics.median(t.tokenize_ms for t in late)
    where = (f"CPU ({statistics.median(t.buffer_ms for t in late):.2f} in the buffer, "
             f"{statistics.median(t.worker_ms for t in late):.2f} in its session worker)" if on_workers
             else "buffer CPU")
    if via_front:
        where += f", and {statistics.median(t.front_ms for t in late):.2f} in the forwarding front"
    early_bytes = statistics.median(t.bytes_ms for t in early)
    late_bytes = statistics.median(t.bytes_ms for t in late)
    console.print(f"SUMMARY long session: late turns {late_cpu:.2f} ms {where} at ~{late[-1].context_tokens} tokens "
                  f"of context = {late_cpu / late_tok:.2f}x tokenizing their new tokens (the serving event loop "
                  f"{statistics.median(t.loop_ms for t in late):.2f} ms of it); late / early turns "
                  f"{late_cpu / early_cpu:.2f}x (the engine stand-in's CPU, early / late: "
                  f"{statistics.median(t.engine_ms for t in early):.2f} / "
                  f"{statistics.median(t.engine_ms for t in late):.2f} ms); bytes floor: a bare proxy moving the "
                  f"same bytes {early_bytes:.2f} ms early, {late_bytes:.2f} ms late (it grows "
                  f"{late_bytes - early_bytes:.2f} ms, the turn {late_cpu - early_cpu:.2f} ms); tokenizing and moving "
                  f"the bytes {late_tok + late_bytes:.2f} ms late = {(late_tok + late_bytes) / late_tok:.2f}x "
                  f"tokenizing, the late turn {late_cpu / (late_tok + late_bytes):.2f}x that", soft_wrap=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long-session", action="store_true", help="(how bench.proxy selects this mode)")
    parser.add_argument("--protocol", choices=["chat", "responses", "anthropic"], default="chat")
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=2000, help="tokens a turn adds (a tool's output)")
    parser.add_argument("--context-tokens", type=int, default=131072)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--workers", type=int, default=0, help="session workers serving the sessions (0: the buffer)")
    parser.add_argument("--front", action="store_true", help="the sessions reached through a forwarding front "
                        "(bench/forwarding_front.py; with --workers)")
    args = parser.parse_args(argv)
    if args.front and not args.workers:
        parser.error("--front forwards to session workers: give --workers")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-long-session-"))
    workdir.mkdir(parents=True, exist_ok=True)
    engine_context = str(2 * args.context_tokens + 4096)
    extra = ["--session-workers", str(args.workers), "--session-worker-port", str(free_ports(args.workers))
             ] if args.workers else []
    with sim_engine(workdir, 1.0, 0, "--context-length", engine_context) as engine, \
            rollout_buffer(workdir, REPO, *extra) as buffer, bytes_floor(workdir) as floor, \
            contextlib.ExitStack() as stack:
        front = stack.enter_context(forwarding_front(workdir, buffer.url)) if args.front else None
        turns = run(buffer, engine, floor, args.protocol, args.sessions, args.new_tokens, args.context_tokens,
                    front)
    report(turns, f"Long sessions ({args.protocol}): {args.sessions} sessions, ~{args.new_tokens} new tokens a turn, "
                  f"to {args.context_tokens} tokens of context")
