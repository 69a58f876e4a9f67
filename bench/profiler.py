"""Sampling profiles of a running server with py-spy (`pip install py-spy`), summarised as a table.

`--gil` mode samples only the thread holding the GIL, which is what bounds an asyncio server: the share of
samples under a function is the share of the interpreter's time it costs.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table


def available() -> bool:
    """True when the py-spy binary is on PATH."""
    return shutil.which("py-spy") is not None


def record(pid: int, seconds: float, out: Path, rate: int = 200) -> subprocess.Popen[bytes]:
    """Start py-spy on `pid` for `seconds` (GIL holder only, all threads), collapsed stacks to `out`."""
    args = ["py-spy", "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
            "--format", "raw", "--gil", "--threads", "--nonblocking", "--output", str(out)]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _parse(collapsed: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for line in collapsed.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if n.isdigit():
            stacks.append(([f for f in stack.split(";") if not f.startswith(("thread (", "process "))], int(n)))
    return stacks


def _where(frame: str) -> str:
    return frame.partition(" (")[2].rsplit(":", 1)[0]


def by_function(collapsed: Path, prefixes: tuple[str, ...], top: int = 20,
                skip: tuple[str, ...] = ("rollout_buffer/__main__.py",)) -> list[tuple[str, float]]:
    """[(function, share of GIL samples with it on the stack)] for functions in files under `prefixes`
    (entry points in `skip` left out: they are on every stack)."""
    stacks = _parse(collapsed)
    total = sum(n for _, n in stacks) or 1
    counts: Counter[str] = Counter()
    for frames, n in stacks:
        names = {f"{f.partition(' (')[0]} ({_where(f).rsplit('/', 1)[-1]})"
                 for f in frames if _where(f).startswith(prefixes) and _where(f) not in skip}
        for name in names:
            counts[name] += n
    return [(name, c / total) for name, c in counts.most_common(top)]


def by_package(collapsed: Path, top: int = 12) -> list[tuple[str, float]]:
    """[(top-level package of the innermost frame, share of GIL samples)]: where the interpreter's time goes."""
    stacks = _parse(collapsed)
    total = sum(n for _, n in stacks) or 1
    counts: Counter[str] = Counter()
    for frames, n in stacks:
        where = _where(frames[-1]) if frames else ""
        counts[where.split("/", 1)[0].removesuffix(".py").strip("<>").split(" ")[-1] or "?"] += n
    return [(name, c / total) for name, c in counts.most_common(top)]


def samples(collapsed: Path) -> int:
    """Number of samples in a py-spy raw output."""
    return sum(n for _, n in _parse(collapsed))


def print_profile(raw: Path, title: str, console: Console) -> None:
    """Print where a recorded profile's GIL time went: by package, then by project function."""
    if not raw.exists():
        console.print(f"[yellow]no profile written for {title} (py-spy needs ptrace permission)[/]")
        return
    table = Table(title=f"Profile: {title} ({samples(raw)} GIL samples; {raw})")
    table.add_column("package (innermost frame)")
    table.add_column("GIL share", justify="right")
    for name, share in by_package(raw):
        table.add_row(name, f"{share:.0%}")
    console.print(table)
    table = Table(title="project functions, inclusive")
    table.add_column("function")
    table.add_column("GIL share", justify="right")
    for name, share in by_function(raw, ("rollout_buffer/", "generators/", "slime_adapter/")):
        table.add_row(name, f"{share:.0%}")
    console.print(table)
