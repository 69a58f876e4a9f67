"""Throughput vs in-flight trajectories and engine latency, against two ceilings and the baseline.

For each engine latency (simulated engine, `--latency-ms`) and each in-flight count (`num_process`), on the
math task with groups of 8, in token mode and chat mode, it measures in one run:

- **bare**: a bare asyncio client sending the same engine requests with no buffer (`bench.bare_client`);
- **buffer**: `rollout-buffer serve` running the math generator, samples/s delivered to a consumer that
  fetches like the slime adapter (long-poll, lease, ack); CPU time and peak PSS of the buffer process;
- **buffer+ray** (`--executors local,ray`): the same with `serve --executor ray` on a Ray cluster started here
  (one CPU per core, one actor per CPU): the trajectories run in the actors, whose CPU is reported apart;
- **baseline**: the process-per-trajectory buffer (`bench.baseline_buffer`, chat only: its design has no
  token mode), CPU time and peak PSS summed over its process tree.

The ceiling is the lower of in-flight ÷ latency and the bare client's rate (on 2 cores the engine stand-in
costs CPU too). Every row also reports the engine's CPU per request and the cores the whole machine kept
busy, so a shortfall can be told apart: CPU-bound (the machine is full) or not. Rates are taken over a
window after the first deliveries, so start-up is not counted.

    python -m bench.throughput            # the full matrix (about 25 minutes on 2 cores)
    python -m bench.throughput --quick    # the two target points and one middle point (about 5 minutes)
    python -m bench.throughput --latency-ms 20 --in-flight 128 --modes token --no-baseline --executors local,ray
    python -m bench.throughput --engine-url http://127.0.0.1:30000 --engine-pid PID --in-flight 256 --modes token

With `--engine-url` the engine is a real one started elsewhere (`real_sglang/gpu_check.sh` starts SGLang on a GPU):
no latency is simulated (the table's latency column reads 0), and the ceiling is the bare client's rate.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from bench import bare_client, profiler
from bench.consumer import PollingConsumer
from bench.harness import (
    REPO,
    MachineCpu,
    Meter,
    Running,
    Service,
    free_port,
    ray_actors_cpu_s,
    rollout_buffer,
    sim_engine,
)
from bench.workload import GROUP_SIZE, start_payload, write_tasks

log = logging.getLogger(__name__)
console = Console(width=200)


@dataclass
class Result:
    """One measured point."""

    latency_ms: float
    in_flight: int
    mode: str
    system: str  # bare | buffer | baseline
    rate: float  # samples (or requests) per second
    cpu_cores: float | None = None
    pss_mb: float | None = None
    processes: int | None = None
    note: str = ""
    engine_cores: float | None = None
    machine_cores: float | None = None
    actors_cores: float | None = None  # the Ray executor's actors (buffer+ray)

    @property
    def cpu_ms_per_sample(self) -> float | None:
        return None if self.cpu_cores is None or not self.rate else 1000 * self.cpu_cores / self.rate

    @property
    def actors_ms_per_sample(self) -> float | None:
        return None if self.actors_cores is None or not self.rate else 1000 * self.actors_cores / self.rate

    @property
    def engine_ms_per_sample(self) -> float | None:
        return None if self.engine_cores is None or not self.rate else 1000 * self.engine_cores / self.rate


@dataclass(frozen=True)
class Timing:
    """How long to let a system settle after its first deliveries, and how long to measure."""

    settle_s: float
    window_s: float

    @classmethod
    def for_point(cls, latency_ms: float, in_flight: int, quick: bool) -> Timing:
        # Thousands in flight take seconds to ramp up on 2 cores (every first request at once).
        latency_s, ramp_s = latency_ms / 1000, in_flight / 500
        if quick:
            return cls(settle_s=1.0 + 2 * latency_s + ramp_s, window_s=max(6.0, 4 * latency_s))
        return cls(settle_s=2.0 + 3 * latency_s + ramp_s, window_s=max(12.0, 6 * latency_s))


def _wait_first(consumer: PollingConsumer, service: Service, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not consumer.arrivals.total:
        if consumer.error is not None:
            raise RuntimeError(f"consumer failed: {consumer.error}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no delivery within {timeout_s}s; log:\n{service.log_tail()}")
        time.sleep(0.05)


def _task_count(expected_rate: float, in_flight: int, timing: Timing, startup_s: float) -> int:
    samples = expected_rate * (startup_s + timing.settle_s + timing.window_s) * 1.5 + 2 * in_flight
    return max(64, math.ceil(samples / GROUP_SIZE))


def _measure_window(seconds: float, meter: Meter, engine_meter: Meter, consumer: PollingConsumer,
                    latency_ms: float, in_flight: int, mode: str, system: str) -> Result:
    """Sleep through the measured window; the point's Result: samples/s at the consumer, the system's and the
    engine's CPU, the machine's busy cores (`note` is left to the caller)."""
    machine = MachineCpu()
    for m in (meter, engine_meter, machine):
        m.mark()
    start = time.monotonic()
    time.sleep(seconds)
    end = time.monotonic()
    usage, engine_usage, busy = meter.usage(), engine_meter.usage(), machine.busy_cores()
    window = end - start
    return Result(latency_ms, in_flight, mode, system, consumer.arrivals.samples_between(start, end) / window,
                  cpu_cores=usage.cpu_s / window, pss_mb=usage.peak_pss_mb, processes=usage.processes,
                  engine_cores=engine_usage.cpu_s / window, machine_cores=busy)


def measure_bare(engine: Service | Running, latency_ms: float, in_flight: int, mode: str, timing: Timing) -> Result:
    """The bare client straight at the engine: the engine-side ceiling, with the engine's CPU."""
    machine = MachineCpu()
    with Meter(engine.pid) as engine_meter:

        def window_opens() -> None:
            engine_meter.mark()
            machine.mark()

        bare = bare_client.measure(engine.url, mode, in_flight, timing.settle_s, timing.window_s,
                                   on_window=window_opens)
        engine_s, busy = engine_meter.usage().cpu_s, machine.busy_cores()
    return Result(latency_ms, in_flight, mode, "bare", bare["rate"], engine_cores=engine_s / bare["window_s"],
                  machine_cores=busy)


def measure_buffer(workdir: Path, engine: Service | Running, latency_ms: float, in_flight: int, mode: str,
                   timing: Timing, expected_rate: float, profile: bool, sanity_check: str = "strict",
                   ray_address: str | None = None) -> Result:
    """The rollout buffer on the math task (on the Ray cluster at `ray_address` when given); samples/s at a
    slime-like consumer."""
    tasks = write_tasks(workdir / f"tasks-{mode}-{in_flight}.jsonl",
                        _task_count(expected_rate, in_flight, timing, 5 + 2 * latency_ms / 1000))
    extra = ("--executor", "ray", "--ray-address", ray_address) if ray_address else ()
    with rollout_buffer(workdir, REPO, *extra) as buf, Meter(buf.pid) as meter, \
            Meter(engine.pid) as engine_meter, PollingConsumer(buf.url) as consumer:
        payload = start_payload(tasks, engine.url, in_flight, mode, sanity_check)
        resp = httpx.post(f"{buf.url}/start_rollout", json=payload, timeout=60)
        resp.raise_for_status()
        _wait_first(consumer, buf, 120)
        time.sleep(timing.settle_s)
        spy = None
        if profile:
            out = workdir / f"profile-{latency_ms:g}ms-{in_flight}-{mode}.txt"
            spy = (profiler.record(buf.pid, timing.window_s, out), out)
        actors_before = time.monotonic(), ray_actors_cpu_s() if ray_address else 0.0
        result = _measure_window(timing.window_s, meter, engine_meter, consumer, latency_ms, in_flight, mode,
                                 "buffer+ray" if ray_address else "buffer")
        if ray_address:
            result.actors_cores = (ray_actors_cpu_s() - actors_before[1]) / (time.monotonic() - actors_before[0])
        progress = httpx.get(f"{buf.url}/status", timeout=30).json()["run"]["progress"]
    notes = [f"{progress['failed']} failed"] if progress.get("failed") else []
    if progress.get("state") == "finished":
        notes.append("ran out of tasks")
    result.note = "; ".join(notes)
    if spy is not None:
        spy[0].wait(timing.window_s + 30)
        profiler.print_profile(spy[1], f"buffer, {latency_ms:g} ms, {in_flight} in flight, {mode} mode", console)
    return result


def measure_baseline(workdir: Path, engine: Service | Running, latency_ms: float, in_flight: int, timing: Timing,
                     expected_rate: float) -> Result:
    """The process-per-trajectory baseline (chat mode), polled without long-poll."""
    tasks = write_tasks(workdir / f"tasks-baseline-{in_flight}.jsonl",
                        _task_count(expected_rate, in_flight, timing, 30 + in_flight / 2))
    port = free_port()
    service = Service("bench.baseline_buffer", ["--port", str(port)], port, "/healthz",
                      workdir / f"baseline-{port}.log")
    interval = 0.5 if in_flight <= 128 else 2.0  # reading every worker's smaps is itself costly
    with service, Meter(service.pid, interval_s=interval) as meter, Meter(engine.pid) as engine_meter, \
            PollingConsumer(service.url, wait_s=0, lease_s=None, idle_s=0.2) as consumer:
        payload = start_payload(tasks, engine.url, in_flight, "chat")
        started = time.monotonic()
        httpx.post(f"{service.url}/start_rollout", json=payload, timeout=60).raise_for_status()
        # Forking a worker per trajectory takes a while; measure once they are all up and delivering.
        deadline = started + 60 + in_flight
        while meter.usage().processes < in_flight + 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        startup_s = time.monotonic() - started
        _wait_first(consumer, service, 300)
        time.sleep(timing.settle_s)
        result = _measure_window(timing.window_s, meter, engine_meter, consumer, latency_ms, in_flight, "chat",
                                 "baseline")
    result.note = f"{startup_s:.0f} s to fork the workers"
    return result


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def print_results(results: list[Result]) -> None:
    """The results table: every system at every point, with its ceiling ratio and baseline ratio."""
    table = Table(title="Throughput: samples/s delivered to a slime-like consumer (math task, groups of 8)")
    for name, justify in (("latency", "right"), ("in flight", "right"), ("mode", "left"), ("system", "left"),
                          ("samples/s", "right"), ("ceiling", "right"), ("% of ceiling", "right"),
                          ("× baseline", "right"), ("CPU cores", "right"), ("CPU ms/sample", "right"),
                          ("peak PSS MB", "right"), ("procs", "right"), ("actors ms/sample", "right"),
                          ("engine ms/sample", "right"),
                          ("machine busy cores", "right"), ("note", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in results:
        ceiling = ceiling_of(results, r.latency_ms, r.in_flight, r.mode)
        base = _find(results, r.latency_ms, r.in_flight, "chat", "baseline")
        ratio = r.rate / base.rate if r.system.startswith("buffer") and base and base.rate else None
        ran = r.system != "baseline" or r.processes is not None
        table.add_row(f"{r.latency_ms:g} ms", str(r.in_flight), r.mode, r.system, f"{r.rate:.0f}" if ran else "—",
                      _fmt(ceiling, ".0f"), _fmt(100 * r.rate / ceiling if ceiling and ran else None, ".0f"),
                      _fmt(ratio, ".1f"), _fmt(r.cpu_cores, ".2f"), _fmt(r.cpu_ms_per_sample, ".2f"),
                      _fmt(r.pss_mb, ".0f"), _fmt(r.processes, "d"), _fmt(r.actors_ms_per_sample, ".2f"),
                      _fmt(r.engine_ms_per_sample, ".2f"),
                      _fmt(r.machine_cores, ".2f"), r.note)
    console.print(table)


def _find(results: list[Result], latency_ms: float, in_flight: int, mode: str, system: str) -> Result | None:
    return next((r for r in results if (r.latency_ms, r.in_flight, r.mode, r.system)
                 == (latency_ms, in_flight, mode, system)), None)


def ceiling_of(results: list[Result], latency_ms: float, in_flight: int, mode: str) -> float | None:
    """The lower of in-flight ÷ latency (a simulated latency) and the bare client's rate at that point."""
    bare = _find(results, latency_ms, in_flight, mode, "bare")
    if not latency_ms:
        return bare.rate if bare else None
    bound = in_flight / (latency_ms / 1000)
    return min(bound, bare.rate) if bare else bound


def summary(results: list[Result]) -> str:
    """One line: every buffer point as % of its ceiling, and the ratio to the baseline where it ran."""
    parts = []
    for r in results:
        if not r.system.startswith("buffer"):
            continue
        ceiling = ceiling_of(results, r.latency_ms, r.in_flight, r.mode)
        on = "" if r.system == "buffer" else "/ray"
        text = f"{r.in_flight}@{r.latency_ms:g}ms/{r.mode}{on} {100 * r.rate / ceiling:.0f}%" if ceiling else ""
        base = _find(results, r.latency_ms, r.in_flight, "chat", "baseline")
        if base and base.rate:
            text += f" {r.rate / base.rate:.1f}×base"
        if r.pss_mb is not None:
            text += f" {r.pss_mb:.0f}MB"
        parts.append(text)
    return "SUMMARY throughput (buffer as % of ceiling): " + ", ".join(parts)


def _points(args: argparse.Namespace) -> list[tuple[float, int]]:
    if args.engine_url:
        return [(0.0, n) for n in args.in_flight or [64, 256]]
    if args.quick and not (args.latency_ms or args.in_flight):
        return [(20.0, 128), (200.0, 256), (2000.0, 4096)]
    latencies = args.latency_ms or [20.0, 200.0, 2000.0]
    in_flight = args.in_flight or [64, 128, 256, 1024, 4096]
    return [(lat, n) for lat in latencies for n in in_flight]


def _engines(args: argparse.Namespace, workdir: Path, points: list[tuple[float, int]]
             ) -> Iterator[tuple[float, Service | Running]]:
    """The engine of each latency measured: one simulated engine per latency, or the real one given."""
    if args.engine_url:
        yield 0.0, Running(args.engine_url.rstrip("/"), args.engine_pid)
        return
    for latency in sorted({lat for lat, _ in points}):
        with sim_engine(workdir, latency) as engine:
            yield latency, engine


def _start_ray() -> str:
    """A local Ray cluster of one CPU per core (the `ray` extra); its address."""
    import ray  # only for --executors ray

    ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    address: str = ray.get_runtime_context().gcs_address
    return address


def main(argv: list[str] | None = None) -> None:
    """Run the matrix and print the table and the summary line."""
    p = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="three points, short windows")
    p.add_argument("--latency-ms", type=float, action="append", help="engine latency (repeatable)")
    p.add_argument("--in-flight", type=int, action="append", help="num_process (repeatable)")
    p.add_argument("--modes", default="token,chat", help="comma-separated: token, chat")
    p.add_argument("--baseline-max-procs", type=int, default=512,
                   help="largest in-flight count the baseline runs at (one process each)")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--profile", action="store_true", help="py-spy the buffer during each measured window")
    p.add_argument("--sanity-check", choices=("strict", "ignore_strippable", "disable"), default="strict",
                   help="tokenization_sanity_check_mode of the buffer's runs (token mode)")
    p.add_argument("--executors", default="local", help="comma-separated: local, ray (a Ray cluster started here)")
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and profiles here")
    p.add_argument("--window-s", type=float, default=None, help="measured window of every point (default: by point)")
    p.add_argument("--engine-url", help="a real engine started elsewhere instead of the simulated one")
    p.add_argument("--engine-pid", type=int, help="with --engine-url: its process, for the CPU meter")
    args = p.parse_args(argv)
    if bool(args.engine_url) != bool(args.engine_pid):
        p.error("--engine-url and --engine-pid go together")
    logging.basicConfig(level=logging.WARNING)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.profile and not profiler.available():
        p.error("--profile needs py-spy on PATH (pip install py-spy)")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    points = _points(args)
    executors = [e.strip() for e in args.executors.split(",") if e.strip()]
    ray_address = _start_ray() if "ray" in executors else None
    for latency, engine in _engines(args, workdir, points):
        for lat, n in points:
            if lat != latency:
                continue
            timing = Timing.for_point(latency, n, args.quick)
            if args.window_s is not None:
                timing = replace(timing, window_s=args.window_s)
            for mode in modes:
                console.print(f"[dim]{latency:g} ms, {n} in flight, {mode}: bare client…[/]")
                results.append(measure_bare(engine, latency, n, mode, timing))
                time.sleep(latency / 1000 + 0.5)  # let the engine finish what was cut off
                expected = min(n / (latency / 1000), results[-1].rate) if latency else results[-1].rate
                for executor in executors:
                    console.print(f"[dim]{latency:g} ms, {n} in flight, {mode}: buffer ({executor})…[/]")
                    results.append(measure_buffer(workdir, engine, latency, n, mode, timing, expected,
                                                  args.profile, args.sanity_check,
                                                  ray_address if executor == "ray" else None))
                    time.sleep(latency / 1000 + 0.5)
            if not args.no_baseline and "chat" in modes:
                if n > args.baseline_max_procs:
                    results.append(Result(latency, n, "chat", "baseline", 0.0,
                                          note=f"not run: {n} processes (> --baseline-max-procs)"))
                    continue
                console.print(f"[dim]{latency:g} ms, {n} in flight: baseline ({n} processes)…[/]")
                expected = ceiling_of(results, latency, n, "chat") or n / (latency / 1000 or 1)
                results.append(measure_baseline(workdir, engine, latency, n, timing, expected))
                time.sleep(latency / 1000 + 0.5)
    if ray_address is not None:
        import ray

        ray.shutdown()
    print_results(results)
    console.print(f"logs: {workdir}  (repo {REPO})")
    console.print(summary(results))


if __name__ == "__main__":
    main()
