"""Adapter conversion: trajectory records → slime Samples, exact tokens vs re-tokenizing the messages.

1. `SampleBuilder.build` on records that carry exact tokens, loss mask and log-probs (the buffer's token
   mode), against the same records with messages only, which go through `MultiTurnLossMaskGenerator`
   (the original adapter's path; `qwen3` loss masks);
2. the whole trip of that batch from the store to Samples in the adapter: a `rollout-buffer serve` holding
   the groups, `/get_rollout_data` through the adapter's client, then the Samples; and the server-side
   JSON serialisation of the batch on its own.

    python -m bench.conversion            # 1 024 samples × 8 k tokens
    python -m bench.conversion --quick    # 256 samples × 8 k tokens
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from bench.harness import Service, free_port
from bench.long_records import long_records
from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.delivery.encoded import encode_record
from rollout_buffer.delivery.store import Store
from rollout_buffer.schemas import TrajectoryRecord
from rollout_buffer.server.bodies import json_response
from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path, load_tokenizer
from slime_adapter.client import BufferClient, decode_json
from slime_adapter.records import SampleBuilder

console = Console(width=160)
GROUP = 8
_TOKEN_FIELDS = ("tokens", "loss_mask", "rollout_log_probs", "response_length", "weight_versions")


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def build_all(builder: SampleBuilder, records: list[dict[str, Any]]) -> list[Any]:
    """One Sample per record."""
    return [builder.build(r) for r in records]


async def _fill_store(data_dir: Path, records: list[dict[str, Any]]) -> None:
    """Write the records as complete groups of a run, the way the runner does, without a server."""
    config = ServerConfig(data_dir=data_dir, group_size=GROUP)
    store = Store(config.db_path)
    await store.open()
    try:
        buffer = RolloutBuffer(config, store, {})
        run_id = await buffer.create_run({"task_type": None, "source": "bench.conversion"}, GROUP)
        run = await buffer.runs.get(run_id)
        for i in range(0, len(records), GROUP):
            await buffer.write([TrajectoryRecord.model_validate(r) for r in records[i:i + GROUP]], run)
        await buffer.runs.set_state(run_id, "finished")
    finally:
        await store.close()


def store_to_samples(workdir: Path, records: list[dict[str, Any]], builder: SampleBuilder) -> dict[str, float]:
    """Seconds from a `/get_rollout_data` call to Samples in hand, for a store holding `records`."""
    data_dir = workdir / "data"
    asyncio.run(_fill_store(data_dir, records))
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(data_dir), "--log-level", "WARNING"]
    with Service("rollout_buffer", args, port, "/healthz", workdir / "buffer.log") as buf, \
            BufferClient(buf.url, timeout_s=120) as client:
        start = time.perf_counter()
        delivery = client.get_rollout_data(lease_s=300)
        fetched = time.perf_counter()
        samples = build_all(builder, delivery.records)
        built = time.perf_counter()
        if delivery.batch_id:
            client.ack(delivery.batch_id)
    if len(samples) != len(records):
        raise RuntimeError(f"fetched {len(samples)} samples, expected {len(records)}")
    return {"fetch_s": fetched - start, "build_s": built - fetched, "total_s": built - start}


def serialisation(records: list[dict[str, Any]]) -> dict[str, float]:
    """Server-side encoding of the `/get_rollout_data` answer (stored JSON spliced in, as the server does),
    and decoding it the adapter client's way vs the standard json module."""
    blobs = [encode_record(TrajectoryRecord.model_validate(r)) for r in records]
    body = {"success": True, "message": "", "data": {"data": [orjson.Fragment(b) for b in blobs], "meta_info": {}}}
    response, encode_s = _timed(json_response, body)
    raw = bytes(response.body)
    _, orjson_s = _timed(decode_json, raw)
    _, json_s = _timed(json.loads, raw)
    return {"bytes": len(raw), "encode_s": encode_s, "orjson_decode_s": orjson_s, "json_decode_s": json_s}


def main(argv: list[str] | None = None) -> None:
    """Run both measurements and print the tables and the summary line."""
    p = argparse.ArgumentParser(prog="python -m bench.conversion", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="256 samples instead of 1 024")
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--retokenize-samples", type=int, default=None,
                   help="how many samples the slow path converts (default: all; its rate is per sample)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    count = args.samples or (256 if args.quick else 1024)
    tokenizer = load_tokenizer(bundled_tokenizer_path())
    records = long_records(tokenizer, count, args.tokens, GROUP)
    builder = SampleBuilder(lambda: tokenizer, "qwen3")

    samples, exact_s = _timed(build_all, builder, records)
    slow_n = min(count, args.retokenize_samples or count)
    messages_only = [{k: v for k, v in r.items() if k not in _TOKEN_FIELDS} for r in records[:slow_n]]
    build_all(builder, messages_only[:1])  # the loss-mask generator's set-up is not per sample
    _, retok_s = _timed(build_all, builder, messages_only)
    speedup = (retok_s / slow_n) / (exact_s / count)

    table = Table(title=f"Records → Samples: {count} samples × {len(samples[0].tokens)} tokens")
    for col in ("path", "samples", "seconds", "ms / sample", "× exact"):
        table.add_column(col, justify="left" if col == "path" else "right")
    table.add_row("exact tokens (buffer token mode)", str(count), f"{exact_s:.3f}", f"{1000 * exact_s / count:.3f}",
                  "1.0")
    table.add_row("re-tokenize messages (MultiTurnLossMaskGenerator, qwen3)", str(slow_n), f"{retok_s:.3f}",
                  f"{1000 * retok_s / slow_n:.3f}", f"{speedup:.0f}")
    console.print(table)

    ser = serialisation(records)
    with tempfile.TemporaryDirectory(prefix="bench-conversion-") as tmp:
        trip = store_to_samples(Path(tmp), records, builder)
    table = Table(title=f"Store → Samples in the adapter ({count} samples, {ser['bytes'] / 2**20:.0f} MiB of JSON)")
    table.add_column("step")
    table.add_column("seconds", justify="right")
    table.add_row("/get_rollout_data: take from SQLite, serialise, send, parse in the adapter's client",
                  f"{trip['fetch_s']:.2f}")
    table.add_row("SampleBuilder.build (exact tokens)", f"{trip['build_s']:.2f}")
    table.add_row("total, store → Samples", f"{trip['total_s']:.2f}")
    table.add_row("  of which: server-side encoding of the answer (stored JSON spliced in)", f"{ser['encode_s']:.2f}")
    table.add_row("  decoding the answer as the adapter's client does (orjson, GC paused)",
                  f"{ser['orjson_decode_s']:.2f}")
    table.add_row("  decoding it with the standard json module instead", f"{ser['json_decode_s']:.2f}")
    console.print(table)
    console.print(f"SUMMARY conversion: exact tokens {speedup:.0f}× faster than re-tokenizing "
                  f"({1000 * exact_s / count:.2f} vs {1000 * retok_s / slow_n:.1f} ms/sample); "
                  f"{count} samples × {args.tokens // 1024}k tokens store → Samples in {trip['total_s']:.2f} s")


if __name__ == "__main__":
    main()
