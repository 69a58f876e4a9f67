"""Trainer wait: time from the last group of a batch completing to the trainer holding the batch.

A simulated trainer takes batches of `--batch-groups` groups from a buffer running the math task on the
simulated engine, "trains" for `--train-s` per batch, and records for each batch the time between the
completion of its newest group (the latest `extra_info.timestamp` among its records, stamped when the
trajectory finished) and the moment the batch was in hand. Two fetch loops, each against a fresh buffer:

- **long-poll**: the slime adapter's loop (`wait_s` 30, lease, ack), surplus groups kept for the next batch;
- **5 s polling**: slime's original loop (`sleep(5)` then `/get_rollout_data`, until the batch is full).

    python -m bench.trainer_wait            # 60 s per loop
    python -m bench.trainer_wait --quick    # 20 s per loop
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from bench.harness import rollout_buffer, sim_engine
from bench.workload import GROUP_SIZE, start_payload, write_tasks
from slime_adapter.client import BufferClient, RetryPolicy
from slime_adapter.groups import split_groups

console = Console(width=160)
POLL_INTERVAL_S = 5.0

Fetch = Callable[[BufferClient], list[dict[str, Any]]]


def long_poll(client: BufferClient) -> list[dict[str, Any]]:
    """One adapter-style fetch: waits up to 30 s for the first ready group, leases and acks the batch."""
    got = client.get_rollout_data(wait_s=30, lease_s=300)
    if got.batch_id:
        client.ack(got.batch_id)
    return got.records


def polling(client: BufferClient) -> list[dict[str, Any]]:
    """One fetch of slime's original loop: sleep, then take whatever is ready."""
    time.sleep(POLL_INTERVAL_S)
    return client.get_rollout_data().records


def _newest(group_records: list[dict[str, Any]]) -> float:
    return max(float(r["extra_info"]["timestamp"]) for r in group_records)


def trainer(url: str, fetch: Fetch, batch_groups: int, train_s: float, duration_s: float) -> list[float]:
    """Run the trainer loop for `duration_s`; the wait of every batch, in seconds."""
    waits: list[float] = []
    surplus: list[list[dict[str, Any]]] = []
    deadline = time.monotonic() + duration_s
    with BufferClient(url, retry=RetryPolicy(retries=3, backoff_s=0.2), timeout_s=60) as client:
        while time.monotonic() < deadline:
            batch, surplus = surplus[:batch_groups], surplus[batch_groups:]
            while len(batch) < batch_groups:
                groups = [g.records for g in split_groups(fetch(client))]
                need = batch_groups - len(batch)
                batch += groups[:need]
                surplus += groups[need:]
            held = time.time()
            waits.append(held - max(_newest(g) for g in batch))
            time.sleep(train_s)
    return waits


def measure(workdir: Path, engine_url: str, name: str, fetch: Fetch, args: argparse.Namespace) -> list[float]:
    """A fresh buffer generating at a steady rate, and the trainer loop `fetch` against it."""
    rate = args.in_flight / (args.latency_ms / 1000)
    tasks = write_tasks(workdir / f"tasks-{name}.jsonl", int(rate * (args.duration_s + 30) / GROUP_SIZE) + 64)
    with rollout_buffer(workdir) as buf:
        httpx.post(f"{buf.url}/start_rollout", json=start_payload(tasks, engine_url, args.in_flight, "token"),
                   timeout=60).raise_for_status()
        return trainer(buf.url, fetch, args.batch_groups, args.train_s, args.duration_s)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> None:
    """Measure both loops and print the table and the summary line."""
    p = argparse.ArgumentParser(prog="python -m bench.trainer_wait", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="20 s per loop instead of 60")
    p.add_argument("--duration-s", type=float, default=None)
    p.add_argument("--latency-ms", type=float, default=200.0, help="simulated engine latency")
    p.add_argument("--in-flight", type=int, default=16, help="num_process of the run (generation slower than training)")
    p.add_argument("--batch-groups", type=int, default=8, help="groups per training batch")
    p.add_argument("--train-s", type=float, default=0.2, help="time the trainer spends on each batch")
    args = p.parse_args(argv)
    args.duration_s = args.duration_s or (20.0 if args.quick else 60.0)
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(tempfile.mkdtemp(prefix="bench-trainer-wait-"))
    results: dict[str, list[float]] = {}
    with sim_engine(workdir, args.latency_ms) as engine:
        for name, fetch in (("long-poll (adapter)", long_poll), (f"{POLL_INTERVAL_S:g} s polling (original)", polling)):
            console.print(f"[dim]{name}…[/]")
            results[name] = measure(workdir, engine.url, name.split()[0], fetch, args)
    table = Table(title=f"Trainer wait: last group of a batch completed → batch in the trainer's hands "
                        f"({args.batch_groups} groups of {GROUP_SIZE}, {args.in_flight} in flight, "
                        f"engine {args.latency_ms:g} ms)")
    for col in ("fetch loop", "batches", "median ms", "p99 ms", "max ms"):
        table.add_column(col, justify="left" if col == "fetch loop" else "right")
    for name, waits in results.items():
        table.add_row(name, str(len(waits)), f"{1000 * statistics.median(waits):.0f}",
                      f"{1000 * _pct(waits, 0.99):.0f}", f"{1000 * max(waits):.0f}")
    console.print(table)
    (_, lp), (po_name, po) = results.items()
    console.print(f"SUMMARY trainer wait: long-poll median {1000 * statistics.median(lp):.0f} ms, "
                  f"p99 {1000 * _pct(lp, 0.99):.0f} ms; {po_name} median {1000 * statistics.median(po):.0f} ms, "
                  f"p99 {1000 * _pct(po, 0.99):.0f} ms")


if __name__ == "__main__":
    main()
