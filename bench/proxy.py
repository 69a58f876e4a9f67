"""Agent proxy overhead: turns per second and buffer CPU per turn, against calling the engine directly.

`--sessions` agents run at once in one asyncio client (aiohttp, no SDK overhead). Each agent loops over
episodes of `--turns` turns on the calculator task: a turn that calls the tool, a turn that answers, then
follow-up questions, each a turn with the whole history; then the next episode. Two systems, measured in one
run on the same simulated engine:

- **direct**: the agents call the engine's own `/v1/chat/completions` (the engine renders the chat template
  and tokenizes);
- **proxy**: the agents call their session's `/sessions/{id}/v1/chat/completions` in a buffer holding an
  agent run; the buffer renders, keeps exact tokens, calls the engine's `/generate`, parses the tool calls,
  and stores each episode's record when the agent posts its reward to the session's `finish_url` (a new session
  per episode; with session workers that is the worker's, which hands the records to the buffer in batches).

Rates are taken over a window after a warm-up. The buffer's CPU per turn counts everything it did in the
window (session opening and finishing, the tokenization check and SQLite writes included) over the turns it
served. The machine has 2 cores shared by the engine stand-in, the buffer and this client, so the table also
shows how many cores the machine kept busy and the engine's CPU per request.

    python -m bench.proxy                                  # 256 sessions, 1000 ms engine latency
    python -m bench.proxy --sessions 64 --latency-ms 200 --window-s 10
    python -m bench.proxy --long-session     # CPU per turn against context length (bench/long_session.py)
    python -m bench.proxy --opens            # the buffer's CPU per POST /sessions (bench/session_opens.py)
    python -m bench.proxy --workers 0,1,2,4  # the proxy served by N session workers (0: the buffer itself)
    python -m bench.proxy --workers 1 --batch-ms 25   # workers' records waiting 25 ms for company
    python -m bench.proxy --workers 0,1 --front       # also through a forwarding front (bench/forwarding_front.py)

With `--workers`, the proxy is measured once per worker count (`serve --session-workers N`), and the table
splits the CPU per turn between the buffer process (placing, finishing and storing) and its workers (each
turn's parsing, rendering, tokenizing, engine call and journal). "Of which storing" is the buffer's store thread
(its SQLite writes), metered apart from its event loop. With `--front`, each worker count is measured again with
the agents' turns and finishes sent through a forwarding front (one address for every session) instead of to the
worker's own URL: the front's CPU per turn is what the buffer would pay on top of its own if it forwarded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
from rich.console import Console
from rich.table import Table

from bench import long_session, profiler, session_opens
from bench.forwarding_front import forwarding_front, through
from bench.harness import REPO, MachineCpu, Meter, Service, ThreadCpu, free_ports, rollout_buffer, sim_engine
from rollout_buffer.delivery.store import STORE_THREAD
from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path

console = Console(width=200)
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MAX_TOKENS = 256


@dataclass
class Result:
    """One measured system."""

    system: str
    turns_per_s: float
    buffer_cores: float | None
    engine_cores: float
    machine_cores: float
    worker_cores: list[float] = field(default_factory=list)
    store_cores: float | None = None  # the buffer's store thread (SQLite writes), part of buffer_cores
    front_cores: float | None = None  # the forwarding front's (`--front`)

    @property
    def workers_ms_per_turn(self) -> float:
        return 1000 * sum(self.worker_cores) / self.turns_per_s

    @property
    def buffer_ms_per_turn(self) -> float | None:
        return None if self.buffer_cores is None else 1000 * self.buffer_cores / self.turns_per_s

    @property
    def store_ms_per_turn(self) -> float | None:
        return None if self.store_cores is None else 1000 * self.store_cores / self.turns_per_s

    @property
    def front_ms_per_turn(self) -> float | None:
        return None if self.front_cores is None else 1000 * self.front_cores / self.turns_per_s

    @property
    def engine_ms_per_turn(self) -> float:
        return 1000 * self.engine_cores / self.turns_per_s


def _question(i: int) -> tuple[list[dict[str, Any]], str]:
    """The opening messages of episode `i`, and the value of its expression (what the calculator says)."""
    a, b, c = 10 + i % 89, 2 + (i * 7) % 53, i % 7
    return ([{"role": "system", "content": "You are a careful assistant. Use the calculator."},
             {"role": "user", "content": f"What is {a} * {b} + {c}?"}], str(a * b + c))


class Agents:
    """`sessions` agents looping over episodes of `turns` turns until `stop` (a tool call, its answer, then
    follow-up questions); turn completion times in `done_at`."""

    def __init__(self, sessions: int, turns: int, latency_s: float, target: str, engine_url: str,
                 buffer_url: str | None, front_url: str | None = None):
        self.sessions = sessions
        self.turns = turns
        self.latency_s = latency_s
        self.target = target  # direct | proxy
        self.engine_url = engine_url
        self.buffer_url = buffer_url
        self.front_url = front_url  # sessions' URLs reached through this forwarding front instead
        self.done_at: list[float] = []
        self.errors = 0
        self.stop = asyncio.Event()

    async def _post(self, http: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str = "") -> Any:
        headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
        async with http.post(url, data=orjson.dumps(body), headers=headers) as resp:
            data = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{url}: HTTP {resp.status}: {data[:300]!r}")
            return orjson.loads(data)

    async def _episode(self, http: aiohttp.ClientSession, i: int, turns: int) -> None:
        messages, value = _question(i)
        if self.target == "proxy":
            assert self.buffer_url is not None
            opened = await self._post(http, f"{self.buffer_url}/sessions", {"instance_id": f"e{i}"})
            url = through(self.front_url, opened["base_url"] + "/chat/completions")
            key = opened["api_key"]
        else:
            url, key = self.engine_url + "/v1/chat/completions", ""
        for turn in range(turns):
            body = {"model": "policy", "messages": messages, "tools": TOOLS, "max_tokens": MAX_TOKENS}
            reply = (await self._post(http, url, body, key))["choices"][0]["message"]
            self.done_at.append(time.monotonic())
            if reply.get("tool_calls"):  # the proxy's answer
                messages += [{"role": "assistant", "content": None, "tool_calls": reply["tool_calls"]},
                             {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": value}]
            elif turn == 0:  # the engine's own endpoint sends the call as text
                messages += [{"role": "assistant", "content": reply["content"]}, {"role": "tool", "content": value}]
            else:
                messages += [{"role": "assistant", "content": reply["content"]},
                             {"role": "user", "content": f"Check it once more ({turn})."}]
        if self.target == "proxy":
            await self._post(http, through(self.front_url, opened["finish_url"]), {"reward": 1.0})

    async def _agent(self, http: aiohttp.ClientSession, k: int) -> None:
        # Agents start spread over one engine latency, and their first episodes are cut short by 0 to turns-1
        # turns: turns and finishes then come at an even pace, as from agents that did not start together.
        await asyncio.sleep(k / self.sessions * self.latency_s)
        i, turns = k, self.turns - k % self.turns
        while not self.stop.is_set():
            try:
                await self._episode(http, i, turns)
                turns = self.turns
            except Exception as e:
                self.errors += 1
                console.print(f"[red]{self.target} agent {k}: {e}[/]")
                await asyncio.sleep(1)
            i += self.sessions

    async def run(self, warmup_s: float, window_s: float, meters: list[Any],
                  at_end: Callable[[], None]) -> tuple[int, float]:
        """Turns completed in the window, and its length. `meters` are marked when the window opens and
        `at_end` runs when it closes, before the agents finish the episodes they are in."""
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600),
                                         headers={"Content-Type": "application/json"}) as http:
            tasks = [asyncio.create_task(self._agent(http, k)) for k in range(self.sessions)]
            await asyncio.sleep(warmup_s)
            for m in meters:
                m.mark()
            start = time.monotonic()
            await asyncio.sleep(window_s)
            end = time.monotonic()
            at_end()
            self.stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        return sum(1 for t in self.done_at if start <= t < end), end - start


class _Profile:
    """py-spy on the buffer during the window (`mark` starts it, like a meter's)."""

    def __init__(self, pid: int, seconds: float, out: Path):
        self.pid, self.seconds, self.out = pid, seconds, out
        self.spy: Any = None

    def mark(self) -> None:
        self.spy = profiler.record(self.pid, self.seconds, self.out)


def measure(system: str, engine: Service, buffer: Service | None, sessions: int, turns: int, latency_s: float,
            warmup_s: float, window_s: float, profile: Path | None = None, front: Service | None = None) -> Result:
    agents = Agents(sessions, turns, latency_s, "proxy" if buffer else "direct", engine.url,
                    buffer.url if buffer else None, front.url if front else None)
    machine = MachineCpu()
    cpu_s: dict[str, float] = {}
    worker_pids = [w["pid"] for w in httpx.get(f"{buffer.url}/status", timeout=10).json().get(
        "session_workers", [])] if buffer else []
    with contextlib.ExitStack() as stack:
        engine_meter = stack.enter_context(Meter(engine.pid))
        buffer_meter = stack.enter_context(Meter(buffer.pid, children=False)) if buffer else None
        store_meter = ThreadCpu(buffer.pid, STORE_THREAD) if buffer else None
        worker_meters = [stack.enter_context(Meter(pid, children=False)) for pid in worker_pids]
        front_meter = stack.enter_context(Meter(front.pid)) if front else None
        spy = _Profile(buffer.pid, window_s, profile) if buffer and profile is not None else None
        worker_cpu_s: list[float] = []

        def window_closed() -> None:
            cpu_s["engine"], cpu_s["machine"] = engine_meter.usage().cpu_s, machine.busy_cores()
            if buffer_meter is not None and store_meter is not None:
                cpu_s["buffer"], cpu_s["store"] = buffer_meter.usage().cpu_s, store_meter.cpu_s()
            worker_cpu_s.extend(m.usage().cpu_s for m in worker_meters)
            if front_meter is not None:
                cpu_s["front"] = front_meter.usage().cpu_s

        meters = [engine_meter, machine, *([buffer_meter, store_meter] if buffer_meter else []), *worker_meters,
                  *([front_meter] if front_meter else []), *([spy] if spy else [])]
        turns, window = asyncio.run(agents.run(warmup_s, window_s, meters, window_closed))
    if spy is not None and spy.spy is not None:
        spy.spy.wait(window_s + 30)
        profiler.print_profile(spy.out, f"buffer serving {sessions} agent sessions", console)
    if agents.errors:
        console.print(f"[yellow]{system}: {agents.errors} failed episodes[/]")
    buffer_cores = cpu_s["buffer"] / window if "buffer" in cpu_s else None
    return Result(system, turns / window, buffer_cores, cpu_s["engine"] / window, cpu_s["machine"],
                  [c / window for c in worker_cpu_s], cpu_s["store"] / window if "store" in cpu_s else None,
                  cpu_s["front"] / window if "front" in cpu_s else None)


def start_agent_run(buffer: Service, engine: Service, workers: int = 0, **options: Any) -> None:
    """Start the agent run the measured sessions open in (sessions only, no input), with extra run `options`, and
    open and finish a session first (one on each of the session `workers`): a first session waits for the run to
    load its tokenizer and engine client (in the buffer, and on its worker), which is not what is measured."""
    httpx.post(f"{buffer.url}/start_rollout", timeout=60, json={
        "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": bundled_tokenizer_path(),
        "num_repeat_per_sample": 8, "max_tokens": 4 * MAX_TOKENS, **options}).raise_for_status()

    async def warm() -> None:
        async with httpx.AsyncClient(base_url=buffer.url, timeout=120) as http:
            opened = await asyncio.gather(*(http.post("/sessions", json={"instance_id": "warm-up"})
                                            for _ in range(max(workers, 1))))
            for answer in opened:
                await http.post(f"/sessions/{answer.raise_for_status().json()['session_id']}/finish",
                                json={"reward": 0.0})

    asyncio.run(warm())


def warmup_s(given: float | None, latency_ms: float) -> float:
    """The warm-up before a window: `given`, or 3 engine latencies + 3 s (every agent past its first turns)."""
    return given if given is not None else 3 + 3 * latency_ms / 1000


def main(argv: list[str] | None = None) -> None:
    if "--long-session" in (sys.argv[1:] if argv is None else argv):
        long_session.main(argv)
        return
    if "--opens" in (sys.argv[1:] if argv is None else argv):
        session_opens.main(argv)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long-session", action="store_true",
                        help="CPU per turn against context length instead (bench/long_session.py, its own options)")
    parser.add_argument("--opens", action="store_true",
                        help="the buffer's CPU per POST /sessions instead (bench/session_opens.py, its own options)")
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--latency-ms", type=float, default=1000.0)
    parser.add_argument("--turns", type=int, default=8, help="model turns per session (episode)")
    parser.add_argument("--warmup-s", type=float, default=None, help="default: 3 engine latencies + 3 s")
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--profile", action="store_true", help="py-spy the buffer during its window")
    parser.add_argument("--no-journal", action="store_true",
                        help="sessions not written to their files turn by turn (run option session_journal: false)")
    parser.add_argument("--batch-ms", type=float, default=None,
                        help="how long a worker's finished records wait for company (serve's "
                        "--session-worker-batch-ms; default: serve's)")
    parser.add_argument("--workers", default="0",
                        help="comma-separated session worker counts to measure the proxy with (0: the buffer "
                        "serves the sessions itself; default %(default)s)")
    parser.add_argument("--front", action="store_true",
                        help="measure each worker count again with the sessions reached through a forwarding front")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")]
    warmup = warmup_s(args.warmup_s, args.latency_ms)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    workdir.mkdir(parents=True, exist_ok=True)
    with sim_engine(workdir, args.latency_ms) as engine:
        shape = (args.sessions, args.turns, args.latency_ms / 1000, warmup, args.window_s)
        direct = measure("direct", engine, None, *shape)
        proxies: list[Result] = []
        for n in counts:
            extra = ["--session-workers", str(n), "--session-worker-port", str(free_ports(n))] if n else []
            if n and args.batch_ms is not None:
                extra += ["--session-worker-batch-ms", str(args.batch_ms)]
            with rollout_buffer(workdir, REPO, *extra) as buffer:
                start_agent_run(buffer, engine, n, session_journal=not args.no_journal)
                name = f"proxy, {n} workers" if n else "proxy"
                proxies.append(measure(name, engine, buffer, *shape,
                                       workdir / f"profile-proxy-{n}.txt" if args.profile else None))
                if n and args.front:
                    with forwarding_front(workdir, buffer.url) as front:
                        proxies.append(measure(f"{name}, through a front", engine, buffer, *shape, front=front))
    for r in (direct, *proxies):
        if r.turns_per_s == 0:
            raise SystemExit(f"{r.system}: no turn finished within the {args.window_s:g} s window; "
                             "give a longer --window-s (or --warmup-s)")
    table = Table(title=f"Agent proxy: {args.sessions} sessions of {args.turns} turns, engine latency "
                  f"{args.latency_ms:g} ms, window {args.window_s:g} s")
    for column in ("system", "turns/s", "% of direct", "buffer CPU ms/turn", "of which storing", "workers CPU ms/turn",
                   "per worker cores", "front CPU ms/turn", "engine CPU ms/turn", "machine busy cores"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for r in (direct, *proxies):
        table.add_row(r.system, f"{r.turns_per_s:.1f}", f"{100 * r.turns_per_s / direct.turns_per_s:.0f}%",
                      "-" if r.buffer_ms_per_turn is None else f"{r.buffer_ms_per_turn:.3f}",
                      "-" if r.store_ms_per_turn is None else f"{r.store_ms_per_turn:.3f}",
                      f"{r.workers_ms_per_turn:.2f}" if r.worker_cores else "-",
                      " ".join(f"{c:.2f}" for c in r.worker_cores) or "-",
                      "-" if r.front_ms_per_turn is None else f"{r.front_ms_per_turn:.3f}",
                      f"{r.engine_ms_per_turn:.2f}", f"{r.machine_cores:.2f}")
    console.print(table)
    for proxy in proxies:
        workers = f", {proxy.workers_ms_per_turn:.2f} ms in workers" if proxy.worker_cores else ""
        if proxy.front_ms_per_turn is not None:
            workers += f", {proxy.front_ms_per_turn:.3f} ms in the front"
        console.print(f"SUMMARY {proxy.system} {args.sessions}@{args.latency_ms:g}ms: {proxy.turns_per_s:.1f} "
                      f"turns/s, {100 * proxy.turns_per_s / direct.turns_per_s:.0f}% of direct, "
                      f"{proxy.buffer_ms_per_turn:.3f} ms buffer CPU per turn ({proxy.store_ms_per_turn:.3f} storing)"
                      f"{workers}")


if __name__ == "__main__":
    main()
