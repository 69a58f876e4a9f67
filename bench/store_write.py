"""Store: records/s persisted with group commit, and `/buffer/write` latency under 1 000 concurrent writers.

1. In process, the real write path (`RolloutBuffer.write`: encode, SQLite WAL, group completion) with many
   concurrent writers, whose writes the store thread commits together, against the same records written
   one at a time (one commit each, what a store without group commit does).
2. Over HTTP, `--writers` clients each posting records to `/buffer/write` as fast as answers come back:
   `rollout-buffer serve` (durable) against the process-per-trajectory baseline's in-memory `/buffer/write`.

3. With `--long-tokens T`, instead: storing long records (T tokens each, built with the real Qwen3 tokenizer)
   as session workers hand them over (encoded, a few per batch): the process's CPU per record when every
   group of 8 completes, against the same records in groups that never complete (what completing costs).

    python -m bench.store_write            # 20 000 records in process, 15 s of HTTP load each
    python -m bench.store_write --quick    # 5 000 records, 5 s each
    python -m bench.store_write --long-tokens 128000 --records 64   # coding-agent-sized records
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

from bench.harness import Meter, Service, free_port
from bench.long_records import long_records
from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.delivery.encoded import EncodedRecord
from rollout_buffer.delivery.runs import StoredRun
from rollout_buffer.delivery.store import Store
from rollout_buffer.schemas import TrajectoryRecord
from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path

console = Console(width=160)
GROUP = 8


def record(writer: int, seq: int) -> dict[str, Any]:
    """A math-sized token-mode record (about 200 tokens); groups of 8 consecutive writes of one writer."""
    tokens = [151644 + (seq + k) % 5000 for k in range(200)]
    return {
        "uid": f"w{writer}-{seq}",
        "instance_id": f"w{writer}-{seq // GROUP}",
        "messages": [{"role": "user", "content": f"What is {seq} + {writer}?"},
                     {"role": "assistant", "content": f"It is \\boxed{{{seq + writer}}}."}],
        "reward": float(seq % 2),
        "extra_info": {"epoch": 0, "finish_reason": "stop", "timestamp": time.time()},
        "tokens": tokens,
        "loss_mask": [0] * 50 + [1] * 150,
        "rollout_log_probs": [-0.125 * (k % 9) for k in range(150)],
        "response_length": 150,
    }


@contextlib.asynccontextmanager
async def _bench_run(data_dir: Path, group_size: int) -> AsyncIterator[tuple[RolloutBuffer, StoredRun]]:
    """A buffer on a new store in `data_dir`, with a run of groups of `group_size`."""
    config = ServerConfig(data_dir=data_dir, group_size=group_size)
    store = Store(config.db_path)
    await store.open()
    try:
        buffer = RolloutBuffer(config, store, {})
        run = await buffer.runs.get(await buffer.create_run({"task_type": None, "source": "bench"}, group_size))
        assert run is not None
        yield buffer, run
    finally:
        await store.close()


async def _in_process(data_dir: Path, total: int, writers: int) -> float:
    """Records/s through `RolloutBuffer.write` with `writers` concurrent writers (1: one commit each)."""
    async with _bench_run(data_dir, GROUP) as (buffer, run):
        per_writer = total // writers
        records = [[TrajectoryRecord.model_validate(record(w, s)) for s in range(per_writer)] for w in range(writers)]

        async def writer(rs: list[TrajectoryRecord]) -> None:
            for r in rs:
                await buffer.write([r], run)

        start = time.perf_counter()
        await asyncio.gather(*(writer(rs) for rs in records))
        return per_writer * writers / (time.perf_counter() - start)


async def _long(data_dir: Path, records: list[EncodedRecord], group_size: int, per_batch: int = 4) -> float:
    """Process CPU ms per record through `RolloutBuffer.write_encoded` in batches of `per_batch`."""
    async with _bench_run(data_dir, group_size) as (buffer, run):
        start = time.process_time()
        for b in range(0, len(records), per_batch):
            await buffer.write_encoded(records[b:b + per_batch], run)
        return (time.process_time() - start) / len(records) * 1000


def long_records_table(tokens: int, count: int, workdir: Path) -> None:
    """Storing long records, groups completing or not (part 3); prints its table and summary line."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    records = [EncodedRecord.of(TrajectoryRecord.model_validate(r))
               for r in long_records(tokenizer, count, tokens, GROUP, distinct=2)]
    size_mb = sum(len(r.row.blob) for r in records) / len(records) / 1e6
    complete = asyncio.run(_long(workdir / "complete", records, GROUP))
    never = asyncio.run(_long(workdir / "open", records, count + 1))
    table = Table(title=f"Storing {count} records of {tokens} tokens ({size_mb:.2f} MB of JSON each), 4 per batch")
    for col in ("groups", "CPU ms per record"):
        table.add_column(col, justify="right")
    table.add_row(f"of {GROUP}, completing", f"{complete:.2f}")
    table.add_row("never complete", f"{never:.2f}")
    console.print(table)
    console.print(f"SUMMARY store long records: {complete:.2f} ms CPU per {tokens}-token record, of which completing "
                  f"its group {complete - never:.2f} ms ({(complete - never) / complete:.0%})")


async def _http_load(url: str, writers: int, warmup_s: float, window_s: float) -> dict[str, float]:
    """`writers` clients posting to `/buffer/write`; latency percentiles and records/s in the window."""
    latencies: list[tuple[float, float]] = []  # (end time, seconds)
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=writers, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, headers={"Content-Type": "application/json"},
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def writer(w: int) -> None:
            seq = 0
            while not stop.is_set():
                body = orjson.dumps(record(w, seq))
                start = time.monotonic()
                async with session.post(f"{url}/buffer/write", data=body) as resp:
                    await resp.read()
                    resp.raise_for_status()
                end = time.monotonic()
                latencies.append((end, end - start))
                seq += 1

        tasks = [asyncio.create_task(writer(w)) for w in range(writers)]
        await asyncio.sleep(warmup_s)
        t0 = time.monotonic()
        await asyncio.sleep(window_s)
        t1 = time.monotonic()
        stop.set()
        await asyncio.gather(*tasks)
    window = sorted(lat for end, lat in latencies if t0 <= end < t1)
    if not window:
        raise RuntimeError("no write finished in the window")
    return {"rate": len(window) / (t1 - t0), "p50": statistics.median(window),
            "p99": window[min(len(window) - 1, round(0.99 * (len(window) - 1)))], "max": window[-1]}


def http_load(service: Service, writers: int, warmup_s: float, window_s: float) -> dict[str, float]:
    """Run the HTTP load against a started service and add its CPU use."""
    with Meter(service.pid) as meter:
        result = asyncio.run(_http_load(service.url, writers, warmup_s, window_s))
        result["cpu_cores"] = meter.usage().cpu_s / (warmup_s + window_s)
    return result


def main(argv: list[str] | None = None) -> None:
    """Run both parts and print the tables and the summary line."""
    p = argparse.ArgumentParser(prog="python -m bench.store_write", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--writers", type=int, default=1000, help="concurrent writers")
    p.add_argument("--records", type=int, default=None, help="records of the group-commit part (20 000; quick 5 000)")
    p.add_argument("--window-s", type=float, default=None, help="measured window of the HTTP part (15 s; quick 5 s)")
    p.add_argument("--long-tokens", type=int, default=None,
                   help="instead: storing records of this many tokens (--records of them, default 64)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.long_tokens:
        long_records_table(args.long_tokens, args.records or 64, Path(tempfile.mkdtemp(prefix="bench-store-")))
        return
    total = args.records or (5000 if args.quick else 20000)
    window = args.window_s or (5.0 if args.quick else 15.0)
    workdir = Path(tempfile.mkdtemp(prefix="bench-store-"))

    grouped = asyncio.run(_in_process(workdir / "grouped", total, args.writers))
    single = asyncio.run(_in_process(workdir / "single", total // 5, 1))
    table = Table(title="Records persisted through RolloutBuffer.write (SQLite WAL, synchronous=NORMAL)")
    for col in ("writers", "records", "records/s", "× one commit per record"):
        table.add_column(col, justify="right")
    table.add_row(f"{args.writers} concurrent (group commit)", str(total), f"{grouped:.0f}", f"{grouped / single:.1f}")
    table.add_row("1 (one commit per record)", str(total // 5), f"{single:.0f}", "1.0")
    console.print(table)

    results: dict[str, dict[str, float]] = {}
    port = free_port()
    serve_args = ["serve", "--port", str(port), "--data-dir", str(workdir / "http"), "--group-size", str(GROUP),
                  "--log-level", "WARNING"]
    with Service("rollout_buffer", serve_args, port, "/healthz", workdir / "buffer.log") as buf:
        results["rollout-buffer (SQLite, durable)"] = http_load(buf, args.writers, 1.0, window)
    port = free_port()
    with Service("bench.baseline_buffer", ["--port", str(port)], port, "/healthz", workdir / "baseline.log") as base:
        results["baseline (in memory, nothing durable)"] = http_load(base, args.writers, 1.0, window)
    table = Table(title=f"/buffer/write under {args.writers} concurrent writers (math-sized token-mode records)")
    for col in ("server", "records/s", "p50 ms", "p99 ms", "max ms", "server CPU cores"):
        table.add_column(col, justify="left" if col == "server" else "right")
    for name, r in results.items():
        table.add_row(name, f"{r['rate']:.0f}", f"{1000 * r['p50']:.0f}", f"{1000 * r['p99']:.0f}",
                      f"{1000 * r['max']:.0f}", f"{r['cpu_cores']:.2f}")
    console.print(table)
    ours, base_r = results["rollout-buffer (SQLite, durable)"], results["baseline (in memory, nothing durable)"]
    console.print(f"SUMMARY store: {grouped:.0f} records/s with group commit ({grouped / single:.1f}× one commit "
                  f"per record); /buffer/write with {args.writers} writers: {ours['rate']:.0f} records/s, p50 "
                  f"{1000 * ours['p50']:.0f} ms, p99 {1000 * ours['p99']:.0f} ms "
                  f"(baseline in memory: {base_r['rate']:.0f} records/s, p99 {1000 * base_r['p99']:.0f} ms)")


if __name__ == "__main__":
    main()
