"""What an engine URL takes: its context length and input limit (`EngineLimits`), asked of the engine (or of an
sglang-router's first worker) by `probe_engine`, or learnt from SGLang's refusal of a request that does not fit
(`overflow`); `KnownLimits` keeps them per URL for one client.

Apart from the client (`engine.EngineClient`), which fits every request to these limits: `/start_rollout`
probes engines with it too, before a run starts.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from rollout_buffer.policy import host_allowed

# Engine info: how long `probe_engine` waits for an engine's answer.
PROBE_TIMEOUT_S = 10.0
# SGLang's refusals of a request that does not fit (TokenizerManager._validate_one_request; the scheduler's
# validate_input_length), with the numbers they carry. Input counts include speculative-decoding reserved tokens.
_TOTAL_OVER = re.compile(
    r"maximum context length of (\d+) tokens\. You requested a total of (\d+) tokens: (\d+) tokens"
)
_INPUT_OVER = re.compile(r"The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)")
_INPUT_LIMIT = re.compile(r"Input length \((\d+) tokens\) exceeds the maximum allowed length \((\d+) tokens\)")


@dataclass(frozen=True)
class EngineLimits:
    """What one engine URL takes. SGLang refuses (HTTP 400) a prompt plus `max_new_tokens` over `context_length`
    and a prompt of `max_input_tokens` or more (its scheduler's `max_req_input_len`); `router`: the URL is an
    sglang-router, and the limits (when known) are those of its first worker."""

    context_length: int | None = None
    max_input_tokens: int | None = None
    router: bool = False
    version: str | None = None  # the SGLang release it reports

    def room(self, prompt_tokens: int) -> int | None:
        """Output tokens that fit after a prompt of `prompt_tokens`; None when the context length is unknown."""
        if self.max_input_tokens is not None and prompt_tokens >= self.max_input_tokens:
            return 0
        return None if self.context_length is None else max(0, self.context_length - prompt_tokens)


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


async def _get_json(http: httpx.AsyncClient, url: str) -> Any:
    """The decoded JSON of a GET, None when it is not a 200 with JSON; transport failures raise httpx.HTTPError."""
    response = await http.get(url)
    if response.status_code != 200:
        return None
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return None


async def _engine_limits(http: httpx.AsyncClient, url: str, info: Any) -> EngineLimits:
    """An SGLang engine's limits: `/v1/models` `max_model_len` (its model_config.context_len, what its length
    check uses), else `/get_server_info` `context_length` (the --context-length flag, null when not given);
    `max_req_input_len` from `/get_server_info` (the scheduler's, merged in there)."""
    if not isinstance(info, dict):
        info = {}
    models = await _get_json(http, f"{url}/v1/models")
    cards = models.get("data") if isinstance(models, dict) else None
    card = cards[0] if isinstance(cards, list) and cards and isinstance(cards[0], dict) else {}
    context = _positive(card.get("max_model_len")) or _positive(info.get("context_length"))
    version = info.get("version")
    return EngineLimits(context, _positive(info.get("max_req_input_len")),
                        version=version if isinstance(version, str) else None)


async def probe_engine(url: str, timeout_s: float = PROBE_TIMEOUT_S, hosts: Sequence[str] = ()
                       ) -> EngineLimits | None:
    """Ask an engine URL what it takes; None when it does not answer.

    `/get_server_info` tells a router from an engine: sglang-router answers it itself with
    `{"router_manager": true, ...}` (and serves its own `/v1/models`, without `max_model_len`), so behind a router
    the limits are read from its first worker listed by `/workers`, when that worker answers this process and its
    host is among `hosts` (the server's `--engine-host` list; empty: any host).
    """
    url = url.rstrip("/")
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as http:  # no proxies, as HttpPool
        try:
            info = await _get_json(http, f"{url}/get_server_info")
            if not (isinstance(info, dict) and "router_manager" in info):
                return await _engine_limits(http, url, info)
        except httpx.HTTPError:
            return None
        try:
            listed = await _get_json(http, f"{url}/workers")
            workers = listed.get("workers") if isinstance(listed, dict) else None
            worker = workers[0].get("url") if isinstance(workers, list) and workers else None
            if isinstance(worker, str) and host_allowed(urlsplit(worker).hostname or "", hosts):
                worker = worker.rstrip("/")
                return replace(await _engine_limits(http, worker, await _get_json(http, f"{worker}/get_server_info")),
                               router=True)
        except (httpx.HTTPError, AttributeError):
            pass
        return EngineLimits(router=True)


async def router_workers(url: str, timeout_s: float = PROBE_TIMEOUT_S, hosts: Sequence[str] = ()) -> list[str] | None:
    """The workers of the sglang-router at `url` on an allowed host (`hosts` empty: any); None when `url` does not
    answer as a router."""
    url = url.rstrip("/")
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as http:
        try:
            info = await _get_json(http, f"{url}/get_server_info")
            if not (isinstance(info, dict) and "router_manager" in info):
                return None
            listed = await _get_json(http, f"{url}/workers")
            workers = [str(w["url"]).rstrip("/") for w in listed["workers"]]
        except (httpx.HTTPError, KeyError, TypeError):
            return None
    return [w for w in workers if host_allowed(urlsplit(w).hostname or "", hosts)]


def overflow(reason: str, prompt_tokens: int) -> EngineLimits | None:
    """The limits SGLang's context refusal `reason` tells of, for a prompt of `prompt_tokens`; None for another
    refusal, or one whose numbers do not say the request overflows. The context length learnt is net of the tokens
    the engine reserves (speculative decoding)."""
    if (m := _TOTAL_OVER.search(reason)) and int(m[2]) > int(m[1]):
        return EngineLimits(int(m[1]) - int(m[3]) + prompt_tokens)
    if (m := _INPUT_OVER.search(reason)) and int(m[1]) >= int(m[2]):
        return EngineLimits(int(m[2]) - int(m[1]) + prompt_tokens)
    if (m := _INPUT_LIMIT.search(reason)) and int(m[1]) >= int(m[2]):
        return EngineLimits(max_input_tokens=int(m[2]))
    return None


# How long an engine that did not answer its probe stays unknown before it is asked again.
_PROBE_RETRY_S = 30.0
_UNKNOWN = EngineLimits()


class KnownLimits:
    """What each engine of a client takes: probed on first use (or the run's `context_length`), refined by its
    refusals."""

    def __init__(self, urls: Sequence[str], timeout_s: float, hosts: Sequence[str] = (),
                 context_length: int | None = None):
        self.urls, self.timeout_s, self.hosts = list(urls), timeout_s, tuple(hosts)
        self._limits: dict[str, EngineLimits] = {}
        if context_length is not None:
            self._limits = dict.fromkeys(self.urls, EngineLimits(int(context_length)))
        self._probes: dict[str, asyncio.Future[EngineLimits | None]] = {}
        self._probe_after: dict[str, float] = {}

    def known(self, url: str) -> EngineLimits:
        """What is known of `url` now (all fields None when nothing is)."""
        return self._limits.get(url, _UNKNOWN)

    async def of(self, url: str) -> EngineLimits:
        """What the engine at `url` takes: probed on first use (one probe shared by concurrent callers), then
        kept; an engine that did not answer is asked again after a while, unknown meanwhile."""
        limits = self._limits.get(url)
        if limits is not None:
            return limits
        probe = self._probes.get(url)
        if probe is None or probe.get_loop() is not asyncio.get_running_loop():
            if time.monotonic() < self._probe_after.get(url, 0.0):
                return _UNKNOWN
            probe = self._probes[url] = asyncio.ensure_future(probe_engine(url, self.timeout_s, self.hosts))
        found = await asyncio.shield(probe)  # a cancelled turn leaves the shared probe running
        if self._probes.get(url) is probe:
            del self._probes[url]
        if found is None:
            self._probe_after[url] = time.monotonic() + _PROBE_RETRY_S
            return _UNKNOWN
        return self._limits.setdefault(url, found)

    async def probe_all(self) -> None:
        """Probe every engine whose limits are not known yet (none are asked again before their retry time)."""
        if len(self._limits) >= len(self.urls):
            return
        now = time.monotonic()
        unknown = [u for u in self.urls if u not in self._limits and now >= self._probe_after.get(u, 0.0)]
        if unknown:
            await asyncio.gather(*map(self.of, unknown))

    def fit(self, url: str, reason: str, prompt_tokens: int, sent: int | None) -> bool:
        """Whether `reason` is SGLang's refusal of a request that does not fit (asking `sent` new tokens), one that
        fitting changes; the limits it tells of are kept."""
        seen = overflow(reason, prompt_tokens)
        if seen is None:
            return False
        known = self.known(url)
        self._limits[url] = replace(known, context_length=seen.context_length or known.context_length,
                                    max_input_tokens=seen.max_input_tokens or known.max_input_tokens)
        room = seen.room(prompt_tokens)
        return room is not None and (room == 0 or sent is None or room < sent)

    def cancel_probes(self) -> None:
        """Stop the probes still running (the client is closing)."""
        for probe in self._probes.values():
            probe.cancel()
