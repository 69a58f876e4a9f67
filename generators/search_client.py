"""Client of a Search-R1 retrieval server: one bounded-concurrency HTTP client per run and a cache of results.

The protocol is Search-R1's: `POST /retrieve {"queries": [...], "topk": k, "return_scores": true}` answers
`{"result": [[hit, ...], ...]}`, one list per query, where a hit is `{"document": {...}, "score": s}` (or the
bare document when scores were not asked for). A document has `contents` (`"title"\\ntext`) or `title` and
`text`. The bundled `rollout-buffer retriever` and Search-R1's own retrieval servers both answer it.

Identical queries share one request: a GRPO group sends the same question several times at once, so results
are cached (LRU with a time to live) from the moment the request starts, and failures are not cached.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

log = logging.getLogger(__name__)

Document = dict[str, Any]

_ERROR_TEXT_CHARS = 300
_BACKOFF_S = 0.1


class SearchError(Exception):
    """A search failed: the server was unreachable, timed out, answered an error or an unexpected shape."""


def retrieve_url(url: str) -> str:
    """The `/retrieve` endpoint of a retrieval server given by its base URL or by the endpoint itself."""
    url = url.rstrip("/")
    return url if urlsplit(url).path not in ("", "/") else f"{url}/retrieve"


def hit_documents(hits: Any) -> list[Document]:
    """The documents of one query's hits, whether they come wrapped with a score or bare."""
    if not isinstance(hits, list):
        raise SearchError(f"expected a list of hits, got {type(hits).__name__}")
    docs = [h.get("document", h) if isinstance(h, dict) else None for h in hits]
    if not all(isinstance(d, dict) for d in docs):
        raise SearchError("a hit is not a JSON object")
    return docs  # type: ignore[return-value]


def _documents(resp: httpx.Response) -> list[Document]:
    """The documents of the one query sent; SearchError for a refusal or an unexpected answer."""
    if resp.status_code != 200:
        raise SearchError(f"retrieval server answered {resp.status_code}: {resp.text[:_ERROR_TEXT_CHARS]}")
    try:
        return hit_documents(resp.json()["result"][0])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise SearchError(f"unexpected answer from {resp.url}: {type(e).__name__}: {e}") from None


@dataclass
class CacheStats:
    """What the cache saved: `hits` were answered without a request (in flight or finished)."""

    hits: int = 0
    misses: int = 0
    errors: int = 0


class SearchClient:
    """Searches one retrieval server with at most `concurrency` requests in flight and caches the results.

    Create it inside the run's event loop (its HTTP client belongs to that loop) and `aclose()` it at the end.
    """

    def __init__(self, url: str, *, topk: int = 3, concurrency: int = 256, timeout_s: float = 60.0,
                 retries: int = 1, cache_size: int = 10_000, cache_ttl_s: float = 3600.0) -> None:
        if topk < 1 or concurrency < 1 or retries < 0 or cache_size < 0 or timeout_s <= 0:
            raise ValueError("topk, concurrency and timeout_s must be positive; retries and cache_size >= 0")
        self.url = retrieve_url(url)
        self.topk = topk
        self.retries = retries
        self.cache_size = cache_size
        self.cache_ttl_s = cache_ttl_s
        self.stats = CacheStats()
        self._limit = asyncio.Semaphore(concurrency)
        self._http = httpx.AsyncClient(
            timeout=timeout_s,
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=min(concurrency, 64)),
        )
        # query → (expiry on the monotonic clock, the shared request); oldest use first.
        self._cache: OrderedDict[str, tuple[float, asyncio.Future[list[Document]]]] = OrderedDict()

    async def search(self, query: str) -> tuple[list[Document], bool]:
        """(documents, served from cache) for `query`; raises SearchError when the search fails."""
        key = " ".join(query.split())
        entry = self._cache.get(key)
        if entry is not None and entry[0] > time.monotonic():
            self._cache.move_to_end(key)
            self.stats.hits += 1
            return list(await asyncio.shield(entry[1])), True
        self.stats.misses += 1
        future: asyncio.Future[list[Document]] = asyncio.get_running_loop().create_future()
        if self.cache_size:
            self._cache[key] = (time.monotonic() + self.cache_ttl_s, future)
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        try:
            docs = await self._fetch(key)
        except BaseException as e:
            self.stats.errors += 1
            if self._cache.get(key, (0.0, None))[1] is future:
                del self._cache[key]
            error = e if isinstance(e, SearchError) else SearchError(f"search cancelled: {e!r}")
            future.set_exception(error)
            future.exception()  # waiters get it; a lone failure must not warn "never retrieved"
            raise
        future.set_result(docs)
        return list(docs), False

    async def _fetch(self, query: str) -> list[Document]:
        payload = {"queries": [query], "topk": self.topk, "return_scores": True}
        failure = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(_BACKOFF_S * 2 ** (attempt - 1))
            try:
                async with self._limit:
                    resp = await self._http.post(self.url, json=payload)
            except httpx.TransportError as e:  # refused, reset, timed out: worth another try
                failure = f"retrieval server {self.url} unreachable: {type(e).__name__}: {e}"
                continue
            if resp.status_code < 500:
                return _documents(resp)
            failure = f"retrieval server answered {resp.status_code}: {resp.text[:_ERROR_TEXT_CHARS]}"
        raise SearchError(failure)

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        await self._http.aclose()
