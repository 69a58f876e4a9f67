"""Synchronous client of the rollout buffer's HTTP protocol (slime calls `generate_rollout` synchronously).

Transport failures, 5xx and 429 answers are retried with exponential backoff up to the retry limit;
other 4xx answers are configuration errors and raise at once with the server's message.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

log = logging.getLogger(__name__)

REQUIRED_RECORD_KEYS = frozenset({"uid", "instance_id", "messages", "reward", "extra_info"})
# A long-poll holds the request open for wait_s; the read timeout must outlast it by this much.
_LONG_POLL_GRACE_S = 30.0


class RolloutBufferError(RuntimeError):
    """The rollout buffer refused a request or answered something that is not the protocol."""


class RolloutBufferUnavailable(RolloutBufferError):
    """The rollout buffer stayed unreachable (or failing) through every allowed retry."""


def decode_json(content: bytes) -> Any:
    """Parse an answer with orjson (a batch of long trajectories is millions of numbers: ~3x faster than
    httpx's json), with the cyclic GC paused: it would otherwise walk the growing lists again and again,
    and in a trainer process that holds many objects that costs more than the parse itself."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return orjson.loads(content)
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class RetryPolicy:
    """How often to retry a failing request: `retries` after the first attempt, -1 for ever."""

    retries: int = -1
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def delay(self, failures: int) -> float:
        """Sleep before the next attempt after `failures` consecutive failures."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1))

    def gives_up(self, failures: int) -> bool:
        """True when `failures` consecutive failures exhaust the allowed retries."""
        return self.retries >= 0 and failures > self.retries


@dataclass
class Delivery:
    """One answer of `/get_rollout_data`: whole groups' records and the batch's meta_info."""

    records: list[dict[str, Any]]
    meta_info: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_id(self) -> str | None:
        """The lease to ack, when the batch was leased."""
        return self.meta_info.get("batch_id")


class _Retryable(Exception):
    pass


class BufferClient:
    """The calls slime's adapter makes to the rollout buffer."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        retry: RetryPolicy | None = None,
        timeout_s: float = 30.0,
    ):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def start_rollout(self, payload: dict[str, Any]) -> dict[str, Any]:
        """`POST /start_rollout`: start (or replace) a run; answers `{success, message, run_id}`."""
        return self._call("POST", "/start_rollout", payload)

    def status(self) -> dict[str, Any]:
        """`GET /status`: the latest run (or None) and group counts."""
        return self._call("GET", "/status")

    def get_rollout_data(
        self,
        max_groups: int | None = None,
        wait_s: float = 0.0,
        lease_s: float | None = None,
        ack: str | None = None,
        current_version: int | None = None,
        agent_id: str | None = None,
    ) -> Delivery:
        """`POST /get_rollout_data`: ready groups (oldest first), waiting up to `wait_s` for the first;
        `current_version` tells the buffer the trainer's weight version; `agent_id` reads one role's stream."""
        body = {"wait_s": wait_s, **_given(max_groups=max_groups, lease_s=lease_s, ack=ack,
                                           current_version=current_version, agent_id=agent_id)}
        answer = self._call("POST", "/get_rollout_data", body, read_timeout=wait_s + _LONG_POLL_GRACE_S)
        data = answer.get("data")
        # slime's original buffer sent a bare list of records; this one wraps them with meta_info.
        if isinstance(data, dict):
            records, meta_info = data.get("data") or [], data.get("meta_info") or {}
        else:
            records, meta_info = data or [], {}
        if not answer.get("success"):
            records = []
        for record in records:
            missing = REQUIRED_RECORD_KEYS - record.keys()
            if missing:
                raise RolloutBufferError(f"record {record.get('uid')!r} lacks {sorted(missing)}")
        return Delivery(records, meta_info)

    def trainer_version(self, version: int, rewind: bool = False, agent_id: str | None = None) -> dict[str, Any]:
        """`POST /trainer_version`: the trainer's weight version (`rewind` when it restarted from an older one),
        of one role's trainer with `agent_id`."""
        body = {"current_version": version, "rewind": rewind, **_given(agent_id=agent_id)}
        return self._call("POST", "/trainer_version", body)

    def start_eval(self, payload: dict[str, Any]) -> dict[str, Any]:
        """`POST /start_eval`: evaluate named datasets at a version; answers `{success, version, evals}`."""
        return self._call("POST", "/start_eval", payload)

    def eval_results(self, version: int, datasets: list[str], wait_s: float = 0.0,
                     records: bool = True) -> dict[str, Any]:
        """`POST /eval_results`: the evals' summaries (and records), waiting up to `wait_s` for them to finish."""
        body = {"version": version, "datasets": datasets, "wait_s": wait_s, "records": records}
        return self._call("POST", "/eval_results", body, read_timeout=wait_s + _LONG_POLL_GRACE_S)

    def ack(self, batch_id: str, agent_id: str | None = None) -> int:
        """`POST /ack`: mark a leased batch (of the `agent_id` stream, when given) consumed; returns how many
        groups it acked."""
        body = {"batch_id": batch_id, **_given(agent_id=agent_id)}
        return int(self._call("POST", "/ack", body).get("acked_groups", 0))

    def image(self, sha256: str) -> bytes:
        """`GET /images/{sha256}`: the bytes of an image a record names (retried like every call)."""
        failures = 0
        while True:
            try:
                response = self._http.get(f"/images/{sha256}")
                if response.status_code < 500:
                    if response.status_code >= 400:
                        raise RolloutBufferError(f"GET /images/{sha256} refused with HTTP {response.status_code}: "
                                                 f"{response.text[:200]}")
                    return response.content
                error = f"HTTP {response.status_code}"
            except httpx.TransportError as e:
                error = f"{type(e).__name__}: {e}"
            failures += 1
            if self.retry.gives_up(failures):
                raise RolloutBufferUnavailable(f"GET /images/{sha256} failed {failures} times: {error}")
            time.sleep(self.retry.delay(failures))

    def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, read_timeout: float | None = None
    ) -> dict[str, Any]:
        timeout = httpx.Timeout(self.timeout_s, read=max(self.timeout_s, read_timeout or 0.0))
        failures = 0
        while True:
            try:
                return self._once(method, path, body, timeout)
            except _Retryable as e:
                failures += 1
                if self.retry.gives_up(failures):
                    raise RolloutBufferUnavailable(
                        f"{method} {self.base_url}{path} failed {failures} times in a row, giving up "
                        f"(--fetch-trajectory-retry-times {self.retry.retries}); last error: {e}"
                    ) from None
                delay = self.retry.delay(failures)
                limit = "unlimited" if self.retry.retries < 0 else str(self.retry.retries)
                log.warning("%s %s failed (%s); retry %d/%s in %.1fs",
                            method, path, e, failures, limit, delay)
                time.sleep(delay)

    def _once(self, method: str, path: str, body: dict[str, Any] | None, timeout: httpx.Timeout) -> dict:
        try:
            response = self._http.request(method, path, json=body, timeout=timeout)
        except httpx.TransportError as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        if response.status_code >= 500 or response.status_code == 429:
            raise _Retryable(f"HTTP {response.status_code}: {response.text[:200]}")
        try:
            answer = decode_json(response.content)
        except ValueError:
            raise _Retryable(f"HTTP {response.status_code} with a body that is not JSON") from None
        if response.status_code >= 400:
            message = (answer.get("message") or answer.get("detail")) if isinstance(answer, dict) else answer
            raise RolloutBufferError(f"{method} {path} refused with HTTP {response.status_code}: {message}")
        if not isinstance(answer, dict):
            raise RolloutBufferError(f"{method} {path} answered {type(answer).__name__}, expected an object")
        return answer


def _given(**fields: Any) -> dict[str, Any]:
    """The optional body fields that were given (None: left out, so the buffer applies its default)."""
    return {k: v for k, v in fields.items() if v is not None}
