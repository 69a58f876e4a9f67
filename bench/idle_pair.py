"""An idle buffer's CPU, paired: a baseline buffer and a candidate buffer side by side, nothing sent to either,
each one's CPU per second over the same windows (what an idle buffer, or an idle session worker, costs the node).

The candidate differs by its `serve` flags (`--candidate-flag`); each round prints both buffers' CPU in ms per
second; the last line is the mean of each.

    python -m bench.idle_pair --candidate-flag=--no-shortcuts=quiet_server
    python -m bench.idle_pair --rounds 4 --window-s 30          # the same build twice: the A/A spread
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

from rich.console import Console

from bench.harness import REPO, proc_cpu_s, rollout_buffer

console = Console(width=160)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidate-flag", action="append", default=[], metavar="FLAG",
                        help="a `serve` flag of the candidate, e.g. --candidate-flag=--no-shortcuts=quiet_server")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--settle-s", type=float, default=5.0, help="after start-up, before the first window")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-idle-pair-"))
    workdir.mkdir(parents=True, exist_ok=True)
    means: list[list[float]] = [[], []]
    with contextlib.ExitStack() as stack:
        buffers = [stack.enter_context(rollout_buffer(workdir, REPO)),
                   stack.enter_context(rollout_buffer(workdir, REPO, *args.candidate_flag))]
        time.sleep(args.settle_s)
        for r in range(args.rounds):
            before = [proc_cpu_s(b.pid) for b in buffers]
            time.sleep(args.window_s)
            used = [1000 * (proc_cpu_s(b.pid) - start) / args.window_s
                    for b, start in zip(buffers, before, strict=True)]
            for k in range(2):
                means[k].append(used[k])
            console.print(f"round {r + 1}: baseline {used[0]:.2f} ms/s | candidate {used[1]:.2f} ms/s")
    console.print(f"SUMMARY idle pair: baseline {sum(means[0]) / len(means[0]):.2f} ms/s, candidate "
                  f"{sum(means[1]) / len(means[1]):.2f} ms/s over {args.rounds} x {args.window_s:g} s")


if __name__ == "__main__":
    main()
