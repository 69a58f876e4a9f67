"""The off switch of every shortcut: `ROLLOUT_BUFFER_SHORTCUTS=off` in the environment (or `serve
--no-shortcuts`, which sets it for the buffer and its session workers) makes the buffer use only its
dependencies' public APIs: same answers, slower."""

from __future__ import annotations

import logging
import os

ENV = "ROLLOUT_BUFFER_SHORTCUTS"
_OFF = {"off", "0", "false", "no"}


def enabled() -> bool:
    """True unless the shortcuts are switched off."""
    return os.environ.get(ENV, "on").strip().lower() not in _OFF


def switch_off() -> None:
    """Switch the shortcuts off for this process and the processes it starts."""
    os.environ[ENV] = "off"


def inherited() -> dict[str, str]:
    """The switch's setting for a process started elsewhere (a session worker on a Ray node), which does not
    inherit this process's environment: empty while the shortcuts are on."""
    return {} if enabled() else {ENV: "off"}


def announce(log: logging.Logger) -> None:
    """Say in `log` (a process's start) that the shortcuts are off, when they are."""
    if not enabled():
        log.info("shortcuts are off (%s=off): only the public APIs of uvicorn, FastAPI, transformers and jinja2 "
                 "are used", ENV)
