"""Engine restart: samples lost and engine time wasted when the engine restarts in the middle of a run.

A math run on the simulated engine; `--down-s` into it the engine is killed (SIGKILL) and started again on the same
port `--down-s` later, as an SGLang restart would. Measured twice in the same sitting, each run on a fresh buffer:

- **fail (before)**: `engine_outage_s: 0` and `failure_window: 0`, what the buffer did before outages: past the
  client's retries a trajectory fails, its group is dropped, and the run goes on taking new items and failing them;
- **wait (after)**: the default, the run waits out the outage: trajectories in flight retry, no new one starts.

For each: trajectories failed, groups dropped, groups delivered of those planned, the engine time spent on
trajectories whose group was then dropped (`wasted`: the answered requests of dropped groups × the engine's
latency), the engine time it takes to generate the dropped groups again (`to redo`: their trajectories × the
latency), and the run's wall time.

    python -m bench.engine_restart                 # 48 items × 4, engine down 10 s
    python -m bench.engine_restart --down-s 30
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from bench.harness import Service, rollout_buffer, sim_engine
from bench.workload import GROUP_SIZE, start_payload, write_tasks

console = Console(width=160)


def measure(workdir: Path, tasks: Path, items: int, args: argparse.Namespace, options: dict[str, Any]
            ) -> dict[str, Any]:
    """One run through an engine restart; its losses."""
    engine = sim_engine(workdir, args.latency_ms).start()
    try:
        with rollout_buffer(workdir) as buf:
            payload = {**start_payload(tasks, engine.url, args.in_flight, "token"), "max_retries": 2,
                       "backoff_s": 0.1, **options}
            started = time.monotonic()
            httpx.post(f"{buf.url}/start_rollout", json=payload, timeout=60).raise_for_status()
            while httpx.get(f"{buf.url}/status").json()["run"]["progress"]["done"] < items * GROUP_SIZE // 4:
                time.sleep(0.05)
            assert engine.proc is not None
            engine.proc.kill()  # SIGKILL: no goodbye to the requests in flight
            engine.proc.wait(10)
            time.sleep(args.down_s)
            engine = Service(engine.module, engine.args, engine.port, "/health", engine.log_path).start()
            while (status := httpx.get(f"{buf.url}/status").json())["run"]["state"] == "running":
                time.sleep(0.2)
            seconds = time.monotonic() - started
            groups = httpx.get(f"{buf.url}/groups", params={"state": "filtered", "limit": 10_000}).json()["groups"]
            dropped = {(g["instance_id"], g["epoch"]) for g in groups}
            wasted_requests = 0  # a math trajectory is one engine request: those of dropped groups that got answers
            for instance_id, epoch in dropped:
                for repeat in range(GROUP_SIZE):
                    uid = f"{status['run']['run_id']}:{instance_id}:{epoch}:{repeat}"
                    record = httpx.get(f"{buf.url}/trajectories/{uid}").json()
                    wasted_requests += record.get("status") not in (None, "failed")
    finally:
        engine.stop()
    progress = status["run"]["progress"]
    return {"failed": progress["failed"], "dropped": len(dropped),
            "delivered": status["groups"].get("ready", 0), "planned": items,
            "wasted_s": wasted_requests * args.latency_ms / 1000, "seconds": seconds, "state": status["run"]["state"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=48)
    parser.add_argument("--down-s", type=float, default=10.0, help="how long the engine is down")
    parser.add_argument("--latency-ms", type=float, default=200.0, help="the simulated engine's time per request")
    parser.add_argument("--in-flight", type=int, default=32)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-engine-restart-"))
    tasks = write_tasks(workdir / "tasks.jsonl", args.items)
    rows = {name: measure(workdir, tasks, args.items, args, options) for name, options in (
        ("fail (before)", {"engine_outage_s": 0, "failure_window": 0}), ("wait (after)", {}))}
    table = Table(title=f"engine down {args.down_s:g} s mid-run: {args.items} items × {GROUP_SIZE}, "
                        f"{args.in_flight} in flight, {args.latency_ms:g} ms per request")
    for column in ("buffer", "run", "trajectories failed", "groups dropped", "groups delivered", "engine s wasted",
                   "engine s to redo", "wall s"):
        table.add_column(column, justify="right")
    for name, r in rows.items():
        table.add_row(name, r["state"], str(r["failed"]), str(r["dropped"]), f"{r['delivered']}/{r['planned']}",
                      f"{r['wasted_s']:.1f}", f"{r['dropped'] * GROUP_SIZE * args.latency_ms / 1000:.1f}",
                      f"{r['seconds']:.1f}")
    console.print(table)
    console.print("SUMMARY " + "; ".join(f"{name}: {r['failed']} failed, {r['dropped']} dropped, "
                                         f"{r['delivered']}/{r['planned']} delivered" for name, r in rows.items()))


if __name__ == "__main__":
    main()
