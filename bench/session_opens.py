"""What opening a session costs the buffer: its CPU per `POST /sessions`, at given rates, sessions opened only.

A buffer with session workers and an agent run open; `--clients` clients open sessions (no turns, never
finished) at a total of about each of `--rates` opens a second, `--count` sessions at each rate. The buffer's event
loop (its main thread) and the whole process are metered apart; the idle timers (measured first, nothing sent)
are counted in each rate's figure, as they are in `bench.proxy`'s.

    python -m bench.proxy --opens                       # one worker, 32 and 700 opens a second
    python -m bench.proxy --opens --rates 32 --workers 2
    python -m bench.proxy --opens --rates 32 --src ../base-worktree   # the buffer of another commit
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

from bench.harness import REPO, free_ports, proc_cpu_s, rollout_buffer, sim_engine

console = Console(width=160)


async def open_sessions(url: str, count: int, clients: int, rate: float) -> float:
    """Open `count` sessions from `clients` clients at about `rate` a second; the seconds it took."""
    pause = clients / rate
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     headers={"Content-Type": "application/json"}) as http:
        async def client(k: int) -> None:
            await asyncio.sleep(k * pause / clients)  # spread over one pause, as clients that did not start together
            for i in range(count // clients):
                async with http.post(f"{url}/sessions", data=orjson.dumps({"instance_id": f"c{k}-{i}"})) as resp:
                    body = await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"POST /sessions: HTTP {resp.status}: {body[:300]!r}")
                await asyncio.sleep(pause)

        await asyncio.gather(*(client(k) for k in range(clients)))
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> None:
    from bench.proxy import start_agent_run  # the agent run bench.proxy measures in

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opens", action="store_true", help="(how bench.proxy selects this mode)")
    parser.add_argument("--rates", default="32,700", help="comma-separated opens a second (default %(default)s)")
    parser.add_argument("--count", type=int, default=3200, help="sessions opened at each rate")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--idle-s", type=float, default=20.0, help="how long the idle buffer is metered first")
    parser.add_argument("--workers", type=int, default=1, help="session workers (0: the buffer holds the sessions)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--src", type=Path, default=REPO,
                        help="the source tree the buffer runs from (default: this checkout), to measure another commit")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-session-opens-"))
    workdir.mkdir(parents=True, exist_ok=True)
    extra = ["--session-workers", str(args.workers), "--session-worker-port", str(free_ports(args.workers))
             ] if args.workers else []
    table = Table(title=f"Opening sessions: {args.count} at each rate, {args.clients} clients, {args.workers} workers")
    for column in ("opens/s asked", "opens/s", "event loop CPU ms/open", "process CPU ms/open"):
        table.add_column(column, justify="right")
    with sim_engine(workdir, 1000.0) as engine, rollout_buffer(workdir, args.src.resolve(), *extra) as buffer:
        start_agent_run(buffer, engine, args.workers)
        loop0, all0 = proc_cpu_s(buffer.pid, buffer.pid), proc_cpu_s(buffer.pid)
        time.sleep(args.idle_s)
        idle = (proc_cpu_s(buffer.pid, buffer.pid) - loop0) / args.idle_s
        table.add_row("idle", "-", f"{1000 * idle:.2f} ms/s",
                      f"{1000 * (proc_cpu_s(buffer.pid) - all0) / args.idle_s:.2f} ms/s")
        summary = [f"idle {1000 * idle:.2f} ms/s"]
        for rate in (float(r) for r in args.rates.split(",")):
            loop0, all0 = proc_cpu_s(buffer.pid, buffer.pid), proc_cpu_s(buffer.pid)
            took = asyncio.run(open_sessions(buffer.url, args.count, args.clients, rate))
            opened = args.count // args.clients * args.clients
            loop_ms = 1000 * (proc_cpu_s(buffer.pid, buffer.pid) - loop0) / opened
            table.add_row(f"{rate:g}", f"{opened / took:.0f}", f"{loop_ms:.3f}",
                          f"{1000 * (proc_cpu_s(buffer.pid) - all0) / opened:.3f}")
            summary.append(f"{opened / took:.0f}/s {loop_ms:.3f} ms/open")
    console.print(table)
    print(f"SUMMARY opens, {args.workers} workers: " + ", ".join(summary))
