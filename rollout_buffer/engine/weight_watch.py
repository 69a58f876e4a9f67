"""Weight swaps an engine does not report.

An engine's `weight_version` is only what its updater was told. A load without one (`/update_weights_from_disk`
without `weight_version`, a distributed or tensor update without it), or one whose cache flush failed (SGLang then
keeps the old version: docs/staleness.md), swaps the weights under the same label, and every token generated after
it is credited to weights that no longer serve. Nothing in a `/generate` answer tells.

So a run watches (`WeightWatch`): every `weight_probe_s` it asks each engine (behind a router: each of its workers)
for the log-probs of one fixed text, a prefill of a few tokens and one greedy token. The same weights give the same
log-probs; log-probs that moved by more than `weight_probe_tolerance` while the engine reports the same version
are such a swap. It is logged, counted in `/status` (`control.weights`) and in `/get_rollout_data`'s meta_info
(`unversioned_weight_swaps`). An engine whose answer has no prompt log-probs cannot be watched, and `/status` says
so. The tolerance must sit above the engines' own run-to-run spread (batching on a GPU moves log-probs a little);
`/status` shows the largest move seen under one version that was not taken for a swap.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from rollout_buffer.policy import host_allowed

log = logging.getLogger(__name__)

PROBE_TEXT = "The weights of this model are probed by rollout-buffer."
_PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Fingerprint:
    """What one probe of an engine answered: the version it reports and the log-probs of the probe."""

    version: str | None
    logprobs: tuple[float, ...]

    def moved(self, other: Fingerprint) -> float:
        """The largest log-prob difference between the two probes (infinite when they are not comparable)."""
        if len(self.logprobs) != len(other.logprobs):
            return math.inf
        return max((abs(a - b) for a, b in zip(self.logprobs, other.logprobs, strict=True)), default=0.0)


def fingerprint_of(answer: Any) -> Fingerprint:
    """The fingerprint in a `/generate` answer to `probe_body()`; ValueError saying what the answer lacks."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("its /generate answer has no meta_info")
    rows = [*(meta.get("input_token_logprobs") or []), *(meta.get("output_token_logprobs") or [])]
    values = [row[0] for row in rows if isinstance(row, list) and row and isinstance(row[0], int | float)]
    if len(values) < 2:
        raise ValueError("its /generate answer has no prompt log-probs (input_token_logprobs)")
    version = meta.get("weight_version")
    return Fingerprint(None if version is None else str(version), tuple(float(v) for v in values))


def probe_body() -> dict[str, Any]:
    """The probe: the fixed text's prompt log-probs and one greedy token's."""
    return {"text": PROBE_TEXT, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0}


@dataclass(frozen=True)
class UnversionedSwap:
    """Weights of `engine` that changed while it kept reporting `version`: between `after` and `seen` (wall
    clock), the log-probs of the probe moved by `moved`."""

    engine: str
    version: str | None
    moved: float
    after: float
    seen: float

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "version": self.version, "moved": round(self.moved, 6),
                "after": self.after, "seen": self.seen}


@dataclass
class _Engine:
    last: Fingerprint | None = None
    probed_at: float = 0.0
    probes: int = 0
    spread: float = 0.0  # the largest move under one version not taken for a swap
    cannot: str | None = None  # why it cannot be watched


@dataclass
class WeightWatch:
    """Probes a run's engines for weight swaps they do not report (module docstring)."""

    urls: Sequence[str]
    interval_s: float
    tolerance: float
    hosts: Sequence[str] = ()  # a router's workers are probed when their host is among these (empty: any)
    swaps: list[UnversionedSwap] = field(default_factory=list)
    _engines: dict[str, _Engine] = field(default_factory=dict)
    _rounds: int = 0

    async def run(self) -> None:
        """Probe every `interval_s`, the first time one interval from now (a short run is never probed), until
        cancelled."""
        async with httpx.AsyncClient(timeout=_PROBE_TIMEOUT_S, trust_env=False) as http:
            while True:
                await asyncio.sleep(self.interval_s)
                await self.probe(http)

    async def probe(self, http: httpx.AsyncClient) -> list[UnversionedSwap]:
        """One round: every engine probed once; the swaps it found."""
        engines = [e for url in self.urls for e in await self._engines_behind(http, url.rstrip("/"))]
        found = [s for s in await asyncio.gather(*(self._probe(http, e) for e in engines)) if s is not None]
        self.swaps += found
        self._rounds += 1
        return found

    async def _engines_behind(self, http: httpx.AsyncClient, url: str) -> list[str]:
        """`url` itself, or the workers of the sglang-router at `url` (those on an allowed host)."""
        try:
            info = orjson.loads((await http.get(f"{url}/get_server_info")).content)
            if not (isinstance(info, dict) and "router_manager" in info):
                return [url]
            listed = orjson.loads((await http.get(f"{url}/workers")).content)["workers"]
            workers = [str(w["url"]).rstrip("/") for w in listed]
        except (httpx.HTTPError, orjson.JSONDecodeError, KeyError, TypeError):
            return [url]  # its probe says what is wrong
        return [w for w in workers if host_allowed(urlsplit(w).hostname or "", self.hosts)]

    async def _probe(self, http: httpx.AsyncClient, url: str) -> UnversionedSwap | None:
        engine = self._engines.setdefault(url, _Engine())
        before, after = engine.last, engine.probed_at
        try:
            answer = await http.post(f"{url}/generate", json=probe_body())
            if answer.status_code != 200:
                raise ValueError(f"its /generate answered {answer.status_code}: {answer.text[:200]}")
            now = fingerprint_of(orjson.loads(answer.content))
        except httpx.HTTPError:
            return None  # down or busy: an outage is the engine client's to handle; asked again next round
        except (ValueError, orjson.JSONDecodeError) as e:
            if engine.cannot is None:
                log.warning("engine %s: weight swaps without a version cannot be watched: %s", url, e)
            engine.cannot = str(e)
            return None
        engine.last, engine.probed_at, engine.cannot = now, time.time(), None
        engine.probes += 1
        if before is None or before.version != now.version:
            return None
        moved = now.moved(before)
        if moved <= self.tolerance:
            engine.spread = max(engine.spread, moved)
            return None
        log.warning("engine %s: its weights changed while it kept reporting version %s (the probe's log-probs moved "
                    "by %.4g): tokens it generated since %s are credited to the wrong weights; update weights with a "
                    "weight_version, and only while generation is paused (docs/staleness.md)", url, now.version,
                    moved, time.strftime("%H:%M:%S", time.localtime(after)))
        return UnversionedSwap(url, now.version, moved, after, engine.probed_at)

    def snapshot(self) -> dict[str, Any]:
        """What `/status` shows (`control.weights`)."""
        return {
            "probe_s": self.interval_s, "tolerance": self.tolerance, "rounds": self._rounds,
            "unversioned_swaps": len(self.swaps), "swaps": [s.as_dict() for s in self.swaps[-20:]],
            "engines": {url: {"version": e.last.version if e.last else None, "probes": e.probes,
                              "spread": round(e.spread, 6), **({"cannot": e.cannot} if e.cannot else {})}
                        for url, e in self._engines.items()},
        }
