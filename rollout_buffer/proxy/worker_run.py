"""The run as a session worker holds it (`serve --session-workers`): the run's engine client and tokenizer built
in the worker from the run's start payload, its sessions' records handed to the buffer, which stores them.

Records and what became of the sessions go to the buffer in batches (`BufferLink`: one `POST /workers/records`
carries the records that arrived while the previous one was under way or within the link's wait for company
(`serve --session-worker-batch-ms`), the session events of up to a quarter of a second, and every two seconds the
metrics the worker gained): each request costs the buffer more than the records it carries. A session's
records are handed over before its journal goes (`SessionManager._store`): a batch the buffer does not store
fails the finish that sent it, and the session stays stored, as in the buffer's own process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import orjson

from rollout_buffer.delivery.encoded import EncodedRecord
from rollout_buffer.delivery.store import StoreError
from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.generation.trajectory import failed_record
from rollout_buffer.observability import metrics
from rollout_buffer.schemas import TrajectoryRecord

log = logging.getLogger(__name__)

WORKER_SECRET_ENV = "ROLLOUT_BUFFER_WORKER_SECRET"
WORKER_SECRET_HEADER = "x-rollout-buffer-worker"
# How often the link reports the metrics the worker gained.
_METRICS_EVERY_S = 2.0
# How long a session event waits for records to go with: a finished session's `closed` follows its records, and
# rides with the next session's rather than costing the buffer a request of its own.
_EVENTS_WAIT_S = 0.25
_RETRY_S = (0.2, 0.5, 1.0, 2.0, 5.0)
_TIMEOUT = httpx.Timeout(60.0, connect=10.0)


class BufferLink:
    """The worker's way to the buffer: records (awaited until stored), session events and metric gains, sent in
    batches to `POST {buffer_url}/workers/records`; records wait `linger_s` for others before they go."""

    def __init__(self, buffer_url: str, worker: int, secret: str, auth_token: str | None, linger_s: float):
        headers = {WORKER_SECRET_HEADER: secret}
        if auth_token:
            headers["authorization"] = f"Bearer {auth_token}"
        self.worker = worker
        self.linger_s = linger_s
        self._client = httpx.AsyncClient(base_url=buffer_url.rstrip("/"), headers=headers, timeout=_TIMEOUT)
        self._records: list[tuple[str, list[dict[str, Any]], asyncio.Future[None]]] = []
        self._events: list[dict[str, Any]] = []
        self._metrics = metrics.Deltas()
        self._metrics_at = 0.0
        self._wake = asyncio.Event()
        self._events_due: asyncio.TimerHandle | None = None
        self._sender: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sending (from the worker's event loop)."""
        self._sender = asyncio.create_task(self._send_loop(), name="buffer-link")

    async def deliver(self, run_id: str, records: list[dict[str, Any]]) -> None:
        """Hand records of `run_id` to the buffer; returns once stored there (StoreError when they were not)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._records.append((run_id, records, future))
        self._wake.set()
        await future

    def event(self, event: dict[str, Any]) -> None:
        """Tell the buffer what became of a session (`closed`, `failed`), with the next batch (sent at the latest
        `_EVENTS_WAIT_S` from now)."""
        self._events.append(event)
        if self._events_due is None:
            self._events_due = asyncio.get_running_loop().call_later(_EVENTS_WAIT_S, self._wake.set)

    async def _send_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), _METRICS_EVERY_S)
            except TimeoutError:
                pass
            if self._records:
                await asyncio.sleep(self.linger_s)
            self._wake.clear()
            if self._events_due is not None:
                self._events_due.cancel()
                self._events_due = None
            records, self._records = self._records, []
            events, self._events = self._events, []
            deltas = []
            now = time.monotonic()
            if now - self._metrics_at >= _METRICS_EVERY_S:  # not with every batch: they cost the buffer
                self._metrics_at = now
                deltas = self._metrics.take()
            if not (records or events or deltas):
                continue
            body = {"worker": self.worker, "events": events, "metrics": deltas,
                    "records": [{"run_id": run_id, "records": recs} for run_id, recs, _ in records]}
            error = await self._post(body)
            for _, _, future in records:
                if not future.done():
                    if error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(StoreError(error))
            if error is not None:  # events are kept for the next batch: the buffer's accounting needs each
                self._events[:0] = events
                metrics.apply_deltas(deltas)  # counted again next time (the gains were taken)

    async def _post(self, body: dict[str, Any]) -> str | None:
        """POST a batch; None when the buffer took it, else why not (after retrying a buffer out of reach)."""
        error = "not sent"
        for delay in (0.0, *_RETRY_S):
            await asyncio.sleep(delay)
            try:
                resp = await self._client.post("/workers/records", content=orjson.dumps(body),
                                               headers={"content-type": "application/json"})
            except httpx.HTTPError as e:
                error = f"the buffer is out of reach: {type(e).__name__}: {e}"
                continue
            if resp.status_code == 200:
                return None
            error = f"the buffer answered {resp.status_code}: {resp.text[:500]}"
            if resp.status_code != 503:  # only a store that refused for now is worth asking again
                break
        log.error("session worker %d: a batch for the buffer failed: %s", self.worker, error)
        return error

    async def aclose(self) -> None:
        """Stop sending (what is queued is not sent: its sessions stay stored)."""
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
        await self._client.aclose()


class WorkerRun:
    """One run in a session worker (`proxy.session.HarnessRun`): the buffer counts its sessions as it places and
    restores them; closes and failures reach it as events, records through `BufferLink.deliver`."""

    def __init__(self, resources: RunResources, link: BufferLink):
        self.run_id = resources.run_id
        self.resources = resources
        self.link = link

    async def wait_loaded(self, timeout_s: float) -> RunResources:
        """The run's resources: built before the worker took the run."""
        return self.resources

    def session_opened(self, session_id: str) -> None:
        """Counted by the buffer, which placed (or restored) the session here."""

    def session_closed(self, session_id: str) -> None:
        """Tell the buffer: it counts the run's sessions in flight and where they live."""
        self.link.event({"kind": "closed", "run_id": self.run_id, "session_id": session_id})

    def session_failed(self, kind: str) -> None:
        """Tell the buffer, which counts the run's failures by kind."""
        self.link.event({"kind": "failed", "run_id": self.run_id, "error_kind": kind})

    def failed(self, item: dict[str, Any], ctx: RolloutContext, kind: str, text: str) -> TrajectoryRecord:
        """The record of a failed session, its failure told to the buffer."""
        self.session_failed(kind)
        return failed_record(item, ctx, kind, text)

    async def accept(self, records: list[TrajectoryRecord]) -> None:
        """Hand the records to the buffer; returns once stored there."""
        await self.link.deliver(self.run_id, [EncodedRecord.of(r).wire() for r in records])
