"""Throughput and version lag against the staleness bound η (`max_staleness`), with a trainer that moves on.

A simulated trainer runs slime's fully asynchronous loop against a fresh buffer per η: it takes one batch of
`--batch-groups` groups (long-poll with `current_version`, lease, ack), "trains" for `--train-s`, moves to the
next version and updates the engines' weights the way slime does (`/pause_generation` aborting in-flight
requests, `/update_weight_version` — which aborts whatever is still in the engine, SGLang's default —,
`/continue_generation`; with `--pause-mode in_place` / `retract` the update is sent with `abort_all_requests: false`
so the held requests survive it). Generation runs `--in-flight` trajectories on the
simulated engine at `--latency-ms` per turn. Reported per η: samples/s the trainer got (from its first batch to
its last, so start-up is left out) as a share of the unbounded run's, and the version lag of every delivered
group (trainer version − the oldest weight version in the group): mean, p90, max and its distribution, plus
stale drops. The unbounded run's lag per third of the run shows whether it grows.

    python -m bench.staleness            # η ∈ {0, 1, 2, 4, ∞}, 15 steps each
    python -m bench.staleness --quick    # 8 steps each
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from bench.harness import rollout_buffer, sim_engine
from bench.workload import start_payload, write_tasks
from rollout_buffer.delivery.versions import engine_version
from slime_adapter.client import BufferClient, RetryPolicy
from slime_adapter.groups import split_groups

console = Console(width=160)
UNBOUNDED = None


@dataclass
class Point:
    """What the trainer saw for one η."""

    eta: int | None
    samples: int = 0
    seconds: float = 0.0
    lags: list[int] = field(default_factory=list)  # one per delivered group, in delivery order
    stale: int = 0
    paused_fetches: int = 0  # fetches that found admission paused

    @property
    def rate(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def name(self) -> str:
        return "∞" if self.eta is None else str(self.eta)


def bump_engine(engine_url: str, version: int, mode: str) -> None:
    """slime's weight update seen from the engine: pause, new version, continue."""
    update: dict[str, object] = {"new_version": str(version)}
    if mode != "abort":  # SGLang's default abort_all_requests (true) would abort the requests the pause holds
        update["abort_all_requests"] = False
    with httpx.Client(base_url=engine_url, timeout=30) as http:
        http.post("/pause_generation", json={"mode": mode}).raise_for_status()
        http.post("/update_weight_version", json=update).raise_for_status()
        http.post("/continue_generation", json={}).raise_for_status()


def train(buffer_url: str, engine_url: str, point: Point, args: argparse.Namespace) -> None:
    """The trainer loop: `args.steps` batches, a version per step; fills `point`."""
    version, first_batch_at = 0, 0.0
    with BufferClient(buffer_url, retry=RetryPolicy(retries=3, backoff_s=0.2), timeout_s=60) as client:
        for step in range(args.steps):
            got = 0
            while got < args.batch_groups:
                d = client.get_rollout_data(max_groups=args.batch_groups - got, wait_s=30, lease_s=300,
                                            current_version=version)
                if d.batch_id:
                    client.ack(d.batch_id)
                point.stale += int(d.meta_info.get("stale_groups") or 0)
                point.paused_fetches += d.meta_info.get("admission_state", "running") != "running"
                for group in split_groups(d.records):
                    oldest = min(engine_version(r["extra_info"].get("weight_version_min")) or 0
                                 for r in group.records)
                    point.lags.append(version - oldest)
                    got += 1
                    if step:
                        point.samples += len(group.records)
            if step == 0:
                first_batch_at = time.monotonic()
            time.sleep(args.train_s)
            version += 1
            bump_engine(engine_url, version, args.pause_mode)
    # The last step's training time is not waiting for data: end the window at the last batch in hand.
    point.seconds = time.monotonic() - first_batch_at - args.train_s


def measure(workdir: Path, engine_url: str, eta: int | None, args: argparse.Namespace) -> Point:
    """A fresh buffer with the bound `eta` (None: unbounded) and the trainer loop against it."""
    bump_engine(engine_url, 0, args.pause_mode)
    groups_needed = args.steps * args.batch_groups * 4 + 64  # the unbounded run generates ahead
    tasks = write_tasks(workdir / f"tasks-{eta}.jsonl", groups_needed)
    payload = start_payload(tasks, engine_url, args.in_flight, "token")
    payload |= {"num_repeat_per_sample": args.group_size, "rollout_batch_size": args.batch_groups,
                "current_version": 0, "backoff_s": 0.05}
    if eta is not None:
        payload["max_staleness"] = eta
    point = Point(eta)
    with rollout_buffer(workdir) as buf:
        httpx.post(f"{buf.url}/start_rollout", json=payload, timeout=60).raise_for_status()
        train(buf.url, engine_url, point, args)
    return point


def _pct(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _thirds(lags: list[int]) -> list[float]:
    n = max(1, len(lags) // 3)
    return [statistics.fmean(lags[i * n:(i + 1) * n] or [0]) for i in range(3)]


def report(points: list[Point], args: argparse.Namespace) -> None:
    """Print the table, the lag distribution and the SUMMARY line."""
    base = next((p for p in points if p.eta is UNBOUNDED), None)
    table = Table(title=f"Staleness bound: {args.batch_groups} groups of {args.group_size} per step, train "
                        f"{args.train_s:g} s, {args.in_flight} in flight × {args.latency_ms:g} ms, "
                        f"{args.steps} steps, engines paused ({args.pause_mode}) at each update")
    for col in ("η", "samples/s", "% of ∞", "mean lag", "p90 lag", "max lag", "stale drops",
                "lag by thirds of the run", "fetches paused"):
        table.add_column(col, justify="right")
    for p in points:
        share = f"{100 * p.rate / base.rate:.0f}%" if base and base.rate else "—"
        table.add_row(p.name, f"{p.rate:.1f}", share, f"{statistics.fmean(p.lags):.2f}", str(_pct(p.lags, 0.9)),
                      str(max(p.lags)), str(p.stale), " → ".join(f"{t:.1f}" for t in _thirds(p.lags)),
                      str(p.paused_fetches))
    console.print(table)
    dist = Table(title="Lag distribution (groups delivered at each version lag)", min_width=60)
    top = max(max(p.lags) for p in points)
    dist.add_column("η", justify="right")
    for lag in range(top + 1):
        dist.add_column(str(lag), justify="right")
    for p in points:
        counts = Counter(p.lags)
        dist.add_row(p.name, *(str(counts.get(lag, 0)) for lag in range(top + 1)))
    console.print(dist)
    parts = [f"η={p.name} {p.rate:.1f}/s" + (f" {100 * p.rate / base.rate:.0f}%" if base and base.rate else "")
             + f" lag mean {statistics.fmean(p.lags):.2f} max {max(p.lags)}" for p in points]
    console.print("SUMMARY staleness: " + "; ".join(parts), soft_wrap=True)


def _etas(value: str) -> list[int | None]:
    out: list[int | None] = []
    for part in value.split(","):
        part = part.strip()
        out.append(UNBOUNDED if part in ("inf", "∞", "none") else int(part))
    return out


def main(argv: list[str] | None = None) -> None:
    """Measure every η and print the tables and the summary line."""
    p = argparse.ArgumentParser(prog="python -m bench.staleness", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 steps per η instead of 15")
    p.add_argument("--steps", type=int, default=None, help="trainer steps per η")
    p.add_argument("--etas", type=_etas, default=_etas("0,1,2,4,inf"), help="comma-separated η values; inf: unbounded")
    p.add_argument("--batch-groups", type=int, default=4, help="groups per trainer step (rollout_batch_size)")
    p.add_argument("--group-size", type=int, default=8, help="num_repeat_per_sample")
    p.add_argument("--train-s", type=float, default=1.0, help="time the trainer spends on each batch")
    p.add_argument("--latency-ms", type=float, default=350.0, help="simulated engine latency per turn")
    p.add_argument("--in-flight", type=int, default=32, help="num_process of the run")
    p.add_argument("--pause-mode", choices=("abort", "in_place", "retract"), default="abort",
                   help="/pause_generation mode at each weight update")
    args = p.parse_args(argv)
    args.steps = args.steps or (8 if args.quick else 15)
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(tempfile.mkdtemp(prefix="bench-staleness-"))
    points = []
    with sim_engine(workdir, args.latency_ms) as engine:
        for eta in args.etas:
            console.print(f"[dim]η = {'∞' if eta is None else eta}…[/]")
            points.append(measure(workdir, engine.url, eta, args))
    report(points, args)


if __name__ == "__main__":
    main()
