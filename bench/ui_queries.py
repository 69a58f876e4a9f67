"""The dashboard's queries on a large store: latency of every `/ui/api/` read and of `/status` (what each
live-stream snapshot computes) over HTTP, with `--records` trajectories stored (default 100 000).

The store is filled in process through the real write path (`RolloutBuffer.write`, groups of 8 completing and
being normalized, some failed records, a planner/actor role on a tenth), a share of the groups is delivered in
batches, then `rollout-buffer serve` opens the store and each query runs `--repeat` times.

    python -m bench.ui_queries                  # 100 000 records
    python -m bench.ui_queries --records 5000   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from bench.harness import Service, free_port
from bench.store_write import GROUP, record
from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.delivery.store import Store
from rollout_buffer.schemas import TrajectoryRecord
from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path

console = Console(width=160)
WRITERS = 64


def _record(writer: int, seq: int) -> dict[str, Any]:
    rec = record(writer, seq)
    rec["tokens"] = [1000 + (seq * 7 + k) % 5000 for k in range(len(rec["tokens"]))]  # ids in the vocabulary
    rec["reward"] = (seq % 5) / 4
    if seq % 100 == 37:
        rec["status"] = "failed"
        rec["extra_info"]["error_kind"] = "engine" if seq % 200 == 37 else "timeout"
    if (seq // GROUP) % 10 == 3:
        rec["extra_info"]["agent_id"] = "planner" if seq % 2 else "actor"
    return rec


async def fill(data_dir: Path, total: int) -> tuple[str, int]:
    """Write `total` records in groups of 8 and deliver about half of the groups; (run id, batches)."""
    config = ServerConfig(data_dir=data_dir, group_size=GROUP)
    store = Store(config.db_path)
    await store.open()
    try:
        buffer = RolloutBuffer(config, store, {})
        run_id = await buffer.create_run({"task_type": None, "source": "bench",
                                          "tokenizer_path": bundled_tokenizer_path()}, GROUP)
        run = await buffer.runs.get(run_id)
        per_writer = total // WRITERS

        async def writer(w: int) -> None:
            for start in range(0, per_writer, GROUP):
                group = [TrajectoryRecord.model_validate(_record(w, s))
                         for s in range(start, min(start + GROUP, per_writer))]
                await buffer.write(group, run)

        await asyncio.gather(*(writer(w) for w in range(WRITERS)))
        batches = 0
        for _ in range(total // GROUP // 2 // 16):
            d = await buffer.deliver(16, 0.0, None)
            batches += d.success
        return run_id, batches
    finally:
        await store.close()


def timed(client: httpx.Client, path: str, params: dict[str, Any], repeat: int) -> tuple[list[float], int]:
    """Latencies (ms) of `repeat` GETs and the rows of the last answer (its first list or mapping, or a
    group's members)."""
    out = []
    size = 0
    for _ in range(repeat):
        start = time.perf_counter()
        resp = client.get(path, params=params)
        out.append(1000 * (time.perf_counter() - start))
        resp.raise_for_status()
        body = resp.json()
        found = [v for v in body.values() if isinstance(v, list | dict)]
        size = len(found[0]) if found and "group" not in body else len(body.get("group", {}).get("members") or [])
    return out, size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="rb-ui-bench-") as tmp:
        data = Path(tmp) / "data"
        t0 = time.perf_counter()
        run_id, batches = asyncio.run(fill(data, args.records))
        fill_s = time.perf_counter() - t0
        port = free_port()
        service = Service("rollout_buffer", ["serve", "--port", str(port), "--data-dir", str(data)], port,
                          "/healthz", Path(tmp) / "serve.log").start()
        try:
            with httpx.Client(base_url=service.url, timeout=60) as client:
                first = client.get("/ui/api/trajectories", params={"run_id": run_id, "limit": 50}).json()
                deep = first["items"][0]["rowid"] // 2  # a page in the middle of the store
                middle = client.get("/ui/api/trajectories", params={"run_id": run_id, "before": deep}).json()
                uid = middle["items"][0]["uid"]  # of a complete group (the newest groups may still be open)
                queries = [
                    ("newest page of the run", "/ui/api/trajectories", {"run_id": run_id, "limit": 50}),
                    ("a page in the middle (cursor)", "/ui/api/trajectories",
                     {"run_id": run_id, "before": deep, "limit": 50}),
                    ("status = failed", "/ui/api/trajectories", {"run_id": run_id, "status": "failed", "limit": 50}),
                    ("reward ≥ 1", "/ui/api/trajectories", {"run_id": run_id, "reward_min": 1, "limit": 50}),
                    ("0.4 ≤ reward ≤ 0.6", "/ui/api/trajectories",
                     {"run_id": run_id, "reward_min": 0.4, "reward_max": 0.6, "limit": 50}),
                    ("role = planner", "/ui/api/trajectories", {"run_id": run_id, "role": "planner", "limit": 50}),
                    ("status = completed, reward ≥ 1", "/ui/api/trajectories",
                     {"run_id": run_id, "status": "completed", "reward_min": 1, "limit": 50}),
                    ("role = planner, reward ≤ 0", "/ui/api/trajectories",
                     {"run_id": run_id, "role": "planner", "reward_max": 0, "limit": 50}),
                    ("uid prefix in the run", "/ui/api/trajectories", {"run_id": run_id, "uid": "w7-1"}),
                    ("instance (all runs)", "/ui/api/trajectories", {"instance_id": "w5-3"}),
                    ("uid prefix (all runs)", "/ui/api/trajectories", {"uid": "w7-12"}),
                    ("one trajectory + group", f"/ui/api/trajectories/{uid}", {}),
                    ("token view", f"/ui/api/trajectories/{uid}/tokens", {}),
                    ("12 newest batches", "/ui/api/batches", {"run_id": run_id}),
                    ("failures by kind", "/ui/api/failures", {"run_id": run_id}),
                    ("/status (one SSE snapshot)", "/status", {}),
                ]
                client.get(f"/ui/api/trajectories/{uid}/tokens")  # loads the tokenizer once
                table = Table(title=f"dashboard queries, {args.records} records stored, {args.repeat} runs each")
                for col in ("query", "rows", "p50 ms", "p95 ms", "max ms"):
                    table.add_column(col, justify="left" if col == "query" else "right")
                worst = 0.0
                for name, path, params in queries:
                    lat, size = timed(client, path, params, args.repeat)
                    p95 = sorted(lat)[int(0.95 * (len(lat) - 1))]
                    worst = max(worst, p95)
                    table.add_row(name, str(size), f"{statistics.median(lat):.1f}", f"{p95:.1f}", f"{max(lat):.1f}")
                console.print(table)
        finally:
            service.stop()
    console.print(f"store filled in {fill_s:.1f} s ({args.records / fill_s:.0f} records/s), {batches} batches")
    print(f"SUMMARY records={args.records} worst_p95_ms={worst:.1f}")


if __name__ == "__main__":
    main()
