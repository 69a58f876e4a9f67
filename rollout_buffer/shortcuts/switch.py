"""The off switch of the shortcuts: `ROLLOUT_BUFFER_SHORTCUTS=off` in the environment (or `serve
--no-shortcuts`, which sets it for the buffer and its session workers) makes the buffer use only its
dependencies' public APIs: same answers, more CPU. A comma list of names (`templates,fast_routes`) switches off
only those, which is how the benchmarks measure what each one buys."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

ENV = "ROLLOUT_BUFFER_SHORTCUTS"
# Every shortcut, by the module it lives in. quiet_server needs http_protocol (which renews the Date header that
# uvicorn's tick would): switching http_protocol off switches both off.
NAMES = ("templates", "fast_routes", "http_protocol", "quiet_server")
_ALL_OFF = {"off", "0", "false", "no"}


def switched_off() -> tuple[str, ...]:
    """The shortcuts switched off, in `NAMES` order."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "on"):
        return ()
    if value in _ALL_OFF:
        return NAMES
    named = {name.strip() for name in value.split(",")}
    return tuple(name for name in NAMES if name in named)


def enabled(name: str) -> bool:
    """True unless shortcut `name` (one of `NAMES`) is switched off."""
    if name not in NAMES:
        raise KeyError(f"{name!r} is not a shortcut: {', '.join(NAMES)}")
    return name not in switched_off()


def switch_off(names: Iterable[str] = NAMES) -> None:
    """Switch shortcuts off for this process and the processes it starts. ValueError for an unknown name."""
    wanted = set(names)
    if unknown := sorted(wanted - set(NAMES)):
        raise ValueError(f"no shortcut named {', '.join(unknown)}; the shortcuts: {', '.join(NAMES)}")
    off = [name for name in NAMES if name in wanted or name in switched_off()]
    os.environ[ENV] = "off" if len(off) == len(NAMES) else ",".join(off)


def inherited() -> dict[str, str]:
    """The switch's setting for a process started elsewhere (a session worker on a Ray node), which does not
    inherit this process's environment: empty while every shortcut is on."""
    off = switched_off()
    return {ENV: "off" if len(off) == len(NAMES) else ",".join(off)} if off else {}


def announce(log: logging.Logger) -> None:
    """Say in `log` (a process's start) which shortcuts are off, when any is."""
    if off := switched_off():
        log.info("shortcuts are off (%s=%s): only the public APIs of %s are used", ENV, os.environ[ENV],
                 "uvicorn, FastAPI, transformers and jinja2" if len(off) == len(NAMES) else ", ".join(off))
