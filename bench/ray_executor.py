"""Local vs Ray executor: samples/s with a CPU-heavy reward, and what the Ray path costs per sample.

One simulated engine, one buffer per executor (`serve` and `serve --executor ray` joined to a Ray cluster started
here with `--ray-cpus` CPUs and `--actors` actors of one CPU each). The task is math with `reward_cpu_ms` of pure
Python per sample after the engine's answer (`bench/heavy_reward.py`): the local buffer spends it on its one
event loop, the Ray actors on their own cores. Per executor and reward cost: samples/s from `/start_rollout` to
the run's end (after a warm-up run, so the actors' start is left out), the buffer process's CPU per sample and
the CPU per sample of the trajectory path (the buffer process plus, on Ray, its actors' processes: the engine left
out) and the cores the whole machine kept busy. The SUMMARY line gives the Ray/local ratio
per reward cost and the crossover: the cheapest measured reward cost at which Ray is faster by more than the
run-to-run spread (`FASTER`).

    python -m bench.ray_executor                       # rewards 0, 1, 2, 5, 10, 20 ms; 512 samples each
    python -m bench.ray_executor --quick               # 128 samples each
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import ray
from rich.console import Console
from rich.table import Table

from bench.harness import REPO, MachineCpu, Meter, Service, free_port, ray_actors_cpu_s, sim_engine
from bench.workload import GROUP_SIZE, start_payload, write_tasks

console = Console(width=160)
PLUGIN = REPO / "bench" / "heavy_reward.py"
FASTER = 1.15  # Ray/local ratio that counts as faster: above the ~±10% spread of two runs on a shared machine


@dataclass
class Point:
    """One run: an executor at one reward cost."""

    executor: str
    reward_ms: float
    samples: int
    seconds: float
    buffer_cpu_s: float
    actors_cpu_s: float
    busy_cores: float

    @property
    def rate(self) -> float:
        return self.samples / self.seconds

    @property
    def buffer_ms_per_sample(self) -> float:
        return 1000 * self.buffer_cpu_s / self.samples

    @property
    def path_ms_per_sample(self) -> float:
        return 1000 * (self.buffer_cpu_s + self.actors_cpu_s) / self.samples


def buffer(workdir: Path, *extra: str) -> Service:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(workdir / f"data-{port}"), "--log-level", "WARNING",
            "--generator-path", str(PLUGIN), "--data-root", str(workdir), *extra]
    return Service("rollout_buffer", args, port, "/healthz", workdir / f"buffer-{port}.log")


def run(url: str, tasks: Path, engine_url: str, args: argparse.Namespace, reward_ms: float) -> tuple[int, float]:
    """One run to its end: (samples done, seconds)."""
    payload = {**start_payload(tasks, engine_url, args.in_flight, "token"), "task_type": "math_heavy_reward",
               "reward_cpu_ms": reward_ms, "ray_num_cpus": 1}
    started = time.monotonic()
    httpx.post(f"{url}/start_rollout", json=payload, timeout=60).raise_for_status()
    while True:
        status = httpx.get(f"{url}/status", timeout=30).json()
        if status["run"]["state"] in ("finished", "failed"):
            break
        time.sleep(0.05)
    seconds = time.monotonic() - started
    assert status["run"]["state"] == "finished", status["run"]
    return status["run"]["progress"]["done"], seconds


def measure(name: str, service: Service, args: argparse.Namespace, workdir: Path, engine_url: str) -> list[Point]:
    warmup = write_tasks(workdir / "warmup.jsonl", max(1, args.in_flight // GROUP_SIZE))
    tasks = write_tasks(workdir / f"tasks-{name}.jsonl", args.samples // GROUP_SIZE)
    run(service.url, warmup, engine_url, args, 0)  # tokenizer loaded, actors started
    points = []
    with Meter(service.pid) as meter:
        machine = MachineCpu()
        for reward_ms in args.reward_ms:
            meter.mark()
            machine.mark()
            actors_at_mark = ray_actors_cpu_s()
            done, seconds = run(service.url, tasks, engine_url, args, reward_ms)
            actors_s = ray_actors_cpu_s() - actors_at_mark
            points.append(Point(name, reward_ms, done, seconds, meter.usage().cpu_s, actors_s, machine.busy_cores()))
            console.print(f"  {name} reward {reward_ms:g} ms: {done / seconds:.0f} samples/s")
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=512, help="trajectories per point")
    parser.add_argument("--reward-ms", type=lambda s: [float(x) for x in s.split(",")], default=[0, 1, 2, 5, 10, 20],
                        help="reward costs to measure, comma-separated ms of CPU per sample")
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--latency-ms", type=float, default=20)
    parser.add_argument("--ray-cpus", type=int, default=os.cpu_count() or 2, help="CPUs of the Ray cluster")
    parser.add_argument("--actors", type=int, default=None, help="actors (default: --ray-cpus)")
    parser.add_argument("--quick", action="store_true", help="128 samples per point")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.samples = min(args.samples, 128)
    actors = args.actors or args.ray_cpus
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-ray-"))
    ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    address = ray.get_runtime_context().gcs_address
    try:
        with sim_engine(workdir, args.latency_ms) as engine:
            with buffer(workdir) as local:
                points = measure("local", local, args, workdir, engine.url)
            with buffer(workdir, "--executor", "ray", "--ray-address", address, "--ray-actors", str(actors)) as on_ray:
                points += measure("ray", on_ray, args, workdir, engine.url)
    finally:
        ray.shutdown()
    report(points, args, actors)


def report(points: list[Point], args: argparse.Namespace, actors: int) -> None:
    table = Table(title=f"local vs ray ({actors} actors on {args.ray_cpus} CPUs), {args.samples} samples per point, "
                        f"{args.in_flight} in flight, engine {args.latency_ms:g} ms")
    for col in ("executor", "reward ms", "samples/s", "buffer CPU ms/sample", "buffer+actors CPU ms/sample",
                "machine busy cores"):
        table.add_column(col, justify="right")
    for p in points:
        table.add_row(p.executor, f"{p.reward_ms:g}", f"{p.rate:.0f}", f"{p.buffer_ms_per_sample:.2f}",
                      f"{p.path_ms_per_sample:.2f}", f"{p.busy_cores:.2f}")
    console.print(table)
    local = {p.reward_ms: p for p in points if p.executor == "local"}
    on_ray = {p.reward_ms: p for p in points if p.executor == "ray"}
    ratios = {ms: on_ray[ms].rate / local[ms].rate for ms in args.reward_ms}
    faster = [ms for ms in args.reward_ms if ratios[ms] > FASTER]
    crossover = f"{min(faster):g}ms" if faster else "none measured"
    base = args.reward_ms[0]
    overhead = on_ray[base].path_ms_per_sample - local[base].path_ms_per_sample
    print("SUMMARY " + " ".join(f"reward {ms:g}ms ray/local {ratios[ms]:.2f}x" for ms in args.reward_ms)
          + f"; ray overhead {overhead:+.2f} ms CPU/sample at {base:g}ms reward; crossover {crossover}")


if __name__ == "__main__":
    main()
