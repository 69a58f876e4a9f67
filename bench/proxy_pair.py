"""Agent proxy, paired: a baseline buffer and a candidate buffer served at the same time, the ratio of their CPU
per turn.

This VM's speed drifts by ±20% between runs minutes apart, more than most changes to the proxy; two buffers
measured over the same windows see the same drift. One simulated engine serves both; each buffer gets its own
`--sessions` agents (the episodes of `bench.proxy`, started spread over one engine latency). The candidate differs
by its source tree (`--candidate-src`, e.g. a `git worktree` of a branch), its run options (`--candidate-option
session_journal=false`) and/or its `serve` flags (`--candidate-flag=--no-shortcuts`); with `--workers N` each
buffer serves its sessions from N session workers of its own, and the ratio is of the buffer processes alone
(placing and storing, as `bench.proxy --workers` meters them). Each round prints both buffers' CPU per turn and the
ratio; the last line is the mean ratio (candidate / baseline: below 1 is cheaper). Two copies of the same build
gave ratios of 0.95–1.01 over four 30 s rounds, with and without workers.

    python -m bench.proxy_pair --candidate-option session_journal=false
    python -m bench.proxy_pair --candidate-flag=--no-shortcuts   # what the shortcuts buy (docs/benchmarks)
    python -m bench.proxy_pair --baseline-src ../base-worktree --rounds 4
    python -m bench.proxy_pair --baseline-src ../base-worktree --workers 1
    python -m bench.proxy_pair --engine-flag=--enable-return-routed-experts --engine-flag=--moe-layers=48 \
        --engine-flag=--moe-top-k=8 --candidate-option return_routed_experts=true   # what routing replay costs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from bench.harness import REPO, Meter, Service, free_ports, rollout_buffer, sim_engine
from bench.proxy import Agents, start_agent_run, warmup_s

console = Console(width=200)


def _options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--candidate-option {pair!r}: expected KEY=JSON")
        out[key] = orjson.loads(value)
    return out


async def _round(engine: Service, buffers: list[Service], sessions: int, latency_s: float, warmup_s: float,
                 window_s: float, children: bool = False) -> list[tuple[float, float]]:
    """(turns/s, buffer CPU ms per turn) of each buffer (with its session workers: `children`) over one shared
    window."""
    results: dict[int, tuple[int, float]] = {}
    cpu: dict[int, float] = {}
    with contextlib.ExitStack() as stack:
        meters = [stack.enter_context(Meter(b.pid, children=children)) for b in buffers]

        async def drive(i: int) -> None:
            agents = Agents(sessions, 8, latency_s, "proxy", engine.url, buffers[i].url)
            results[i] = await agents.run(warmup_s, window_s, [meters[i]],
                                          lambda: cpu.__setitem__(i, meters[i].usage().cpu_s))

        await asyncio.gather(*(drive(i) for i in range(len(buffers))))
    return [(results[i][0] / results[i][1], 1000 * cpu[i] / results[i][0]) for i in range(len(buffers))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-src", type=Path, default=REPO, help="source tree of the baseline buffer")
    parser.add_argument("--candidate-src", type=Path, default=REPO, help="source tree of the candidate buffer")
    parser.add_argument("--candidate-option", action="append", default=[], metavar="KEY=JSON",
                        help="a run option of the candidate's /start_rollout, e.g. session_journal=false")
    parser.add_argument("--candidate-flag", action="append", default=[], metavar="FLAG",
                        help="a `serve` flag of the candidate, e.g. --candidate-flag=--no-shortcuts")
    parser.add_argument("--engine-flag", action="append", default=[], metavar="FLAG",
                        help="a flag of the simulated engine, e.g. --engine-flag=--enable-return-routed-experts")
    parser.add_argument("--sessions", type=int, default=128, help="agent sessions per buffer")
    parser.add_argument("--latency-ms", type=float, default=1000.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=None, help="default: 3 engine latencies + 3 s")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--count-workers", action="store_true",
                        help="with --workers, meter each buffer with its session workers (the turns' own CPU)")
    parser.add_argument("--workers", type=int, default=0,
                        help="session workers of each buffer (0: the buffers serve the sessions themselves)")
    args = parser.parse_args(argv)
    candidate_options = _options(args.candidate_option)
    warmup = warmup_s(args.warmup_s, args.latency_ms)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-proxy-pair-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ratios = []
    ports = free_ports(2 * args.workers) if args.workers else 0
    extra = [[], []] if not args.workers else [
        ["--session-workers", str(args.workers), "--session-worker-port", str(ports + k * args.workers)]
        for k in range(2)]
    with sim_engine(workdir, args.latency_ms, 0, *args.engine_flag) as engine, \
            rollout_buffer(workdir, args.baseline_src.resolve(), *extra[0]) as baseline, \
            rollout_buffer(workdir, args.candidate_src.resolve(), *extra[1], *args.candidate_flag) as candidate:
        for buffer, options in ((baseline, {}), (candidate, candidate_options)):
            start_agent_run(buffer, engine, args.workers, **options)
        for r in range(args.rounds):
            (base_rate, base_ms), (cand_rate, cand_ms) = asyncio.run(
                _round(engine, [baseline, candidate], args.sessions, args.latency_ms / 1000, warmup, args.window_s,
                       args.count_workers))
            if not base_rate or not cand_rate:
                raise SystemExit(f"no turn finished within the {args.window_s:g} s window; give a longer --window-s")
            ratios.append(cand_ms / base_ms)
            console.print(f"round {r + 1}: baseline {base_rate:.0f} turns/s {base_ms:.3f} ms/turn | candidate "
                          f"{cand_rate:.0f} turns/s {cand_ms:.3f} ms/turn | candidate/baseline {ratios[-1]:.3f}")
    console.print(f"SUMMARY proxy pair {args.sessions}x2@{args.latency_ms:g}ms: candidate/baseline CPU per turn "
                  f"{sum(ratios) / len(ratios):.3f} (rounds: {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
