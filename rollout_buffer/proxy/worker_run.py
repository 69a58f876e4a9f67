"""The run as a session worker holds it (`serve --session-workers`): the run's engine client and tokenizer built
in the worker from the run's start payload, its sessions' records handed to the buffer, which stores them.

Records and what became of the sessions go to the buffer in batches (`BufferLink`: one `POST /workers/records`
carries the records of the sessions closed within the link's wait for company (`serve
--session-worker-batch-ms`), the session events meanwhile, and every two seconds the metrics the worker gained):
each request costs the buffer more than the records it carries. A closed session's records are written to the
worker's outbox (`proxy.outbox`) before its journal goes and its finish is answered (`LocalBackend._store`), and
stay there until the buffer stored them: a worker killed in between sends them again when it is back, once the
buffer said which it had stored already.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from rollout_buffer.proxy.outbox import Outbox, Parcel
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
# A request's records: sent without waiting out the batch wait once this many bytes wait (and split at it), so
# that a batch of long sessions' records neither nears the buffer's body cap nor holds its event loop for long.
_BATCH_BYTES = 8 * 1024 * 1024


class BufferLink:
    """The worker's way to the buffer: records (from the worker's `outbox`, gathered for `linger_s`), session
    events and metric gains, sent in batches to `POST {buffer_url}/workers/records`."""

    def __init__(self, buffer_url: str, worker: int, secret: str, auth_token: str | None, linger_s: float,
                 outbox: Outbox, max_body_bytes: int):
        headers = {WORKER_SECRET_HEADER: secret}
        if auth_token:
            headers["authorization"] = f"Bearer {auth_token}"
        self.worker = worker
        self.linger_s = linger_s
        self.outbox = outbox
        self.batch_bytes = min(_BATCH_BYTES, max_body_bytes // 2)
        self._client = httpx.AsyncClient(base_url=buffer_url.rstrip("/"), headers=headers, timeout=_TIMEOUT)
        self._events: list[dict[str, Any]] = []
        self._metrics = metrics.Deltas()
        self._metrics_at = 0.0
        self._wake = asyncio.Event()
        self._now = asyncio.Event()  # send without waiting for company (enough waits, or `flush`)
        self._sent = asyncio.Event()  # set after each batch
        self._events_due: asyncio.TimerHandle | None = None
        self._sender: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sending (from the worker's event loop)."""
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_loop(), name="buffer-link")

    async def pause(self) -> None:
        """Stop sending (a batch under way goes back to the outbox); `start` sends again."""
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
            self._sender = None

    async def deliver(self, run_id: str, records: list[dict[str, Any]]) -> None:
        """Hand records of `run_id` to the buffer: returns once they are in the outbox (StoreError when the disk
        refused them), and they go with the next batch."""
        try:
            self.outbox.add(run_id, records)
        except OSError as e:
            raise StoreError(f"the records could not be written to the outbox: {e}") from None
        self._wake.set()
        if self.outbox.waiting_bytes >= self.batch_bytes:
            self._now.set()

    async def flush(self) -> None:
        """Returns once the buffer stored (or refused) every record handed over before the call."""
        last = self.outbox.last_seq
        while not self.outbox.done_through(last):
            self._now.set()
            self._wake.set()
            self._sent.clear()
            await self._sent.wait()

    def resend(self, stored: set[str]) -> None:
        """The buffer checked the records the last process left in the outbox (`stored`: the episode uids it has):
        the others go again."""
        self.outbox.release(stored)
        self._wake.set()

    def event(self, event: dict[str, Any]) -> None:
        """Tell the buffer what became of a session (`closed`, `failed`), with the next batch (sent at the latest
        `_EVENTS_WAIT_S` from now)."""
        self._events.append(event)
        if self._events_due is None:
            self._events_due = asyncio.get_running_loop().call_later(_EVENTS_WAIT_S, self._wake.set)

    async def _send_loop(self) -> None:
        failures = 0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _METRICS_EVERY_S)
            if self.outbox.waiting and not self._now.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._now.wait(), self.linger_s)
            self._wake.clear()
            self._now.clear()
            if self._events_due is not None:
                self._events_due.cancel()
                self._events_due = None
            parcels = self.outbox.take()
            events, self._events = self._events, []
            deltas = []
            now = time.monotonic()
            if now - self._metrics_at >= _METRICS_EVERY_S:  # not with every batch: they cost the buffer
                self._metrics_at = now
                deltas = self._metrics.take()
            if not (parcels or events or deltas):
                self._sent.set()
                continue
            left: list[Parcel] | None = parcels
            try:
                left = await self._send(parcels, events, deltas)
            finally:  # cancelled (`pause`) or not sent: the records wait in the outbox, the events for the next
                if left is not None:
                    self.outbox.back(left)
                    self._events[:0] = events
                    metrics.apply_deltas(deltas)  # counted again next time (the gains were taken)
            self._sent.set()
            failures = 0 if left is None else failures + 1
            if left is not None:  # the buffer is out of reach or refuses for now: ask again later, with the rest
                await asyncio.sleep(_RETRY_S[min(failures, len(_RETRY_S)) - 1])
                self._wake.set()

    async def _send(self, parcels: list[Parcel], events: list[dict[str, Any]], deltas: list[Any]
                    ) -> list[Parcel] | None:
        """POST the parcels (split into requests of at most `batch_bytes`), then the events and metrics (with the
        last: a session's `closed` follows its records). None when all went; else the parcels not sent (the events
        and metrics did not go either)."""
        batches: list[list[Parcel]] = [[]]
        size = 0
        for parcel in parcels:
            if batches[-1] and size + parcel.size > self.batch_bytes:
                batches.append([])
                size = 0
            batches[-1].append(parcel)
            size += parcel.size
        for k, batch in enumerate(batches):
            last = k == len(batches) - 1
            body = {"worker": self.worker, "events": events if last else [], "metrics": deltas if last else [],
                    "records": [p.wire() for p in batch]}
            answer = await self._post(body)
            if answer is None:
                return [p for b in batches[k:] for p in b]
            refused: dict[str, str] = answer.get("refused") or {}
            if isinstance(answer.get("error"), str):  # the whole request was refused for good
                refused = {str(i): answer["error"] for i in range(len(batch))}
                if last:  # the buffer's accounting needs each event: they go again, on their own
                    self._events[:0] = events
            for i, reason in refused.items():
                self.outbox.refuse([batch[int(i)]], reason)
            self.outbox.stored(batch)
        return None

    async def _post(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """POST a batch: the buffer's answer (`error` set when it refused the request for good), or None when it is
        out of reach or refuses for now (after asking again a few times)."""
        error = "not sent"
        content = orjson.dumps(body)
        for delay in (0.0, *_RETRY_S):
            await asyncio.sleep(delay)
            try:
                resp = await self._client.post("/workers/records", content=content,
                                               headers={"content-type": "application/json"})
            except httpx.HTTPError as e:
                error = f"the buffer is out of reach: {type(e).__name__}: {e}"
                continue
            if resp.status_code == 200:
                answer: dict[str, Any] = resp.json()
                return answer
            error = f"the buffer answered {resp.status_code}: {resp.text[:500]}"
            if resp.status_code not in (502, 503, 504):  # a request it will never take
                log.error("session worker %d: the buffer refused a batch: %s", self.worker, error)
                return {"error": error}
        log.warning("session worker %d: a batch for the buffer is not sent yet: %s", self.worker, error)
        return None

    async def aclose(self) -> None:
        """Stop sending (what waits stays in the outbox: the next process sends it)."""
        await self.pause()
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
        """Hand the records to the buffer: returns once they are in the worker's outbox."""
        await self.link.deliver(self.run_id, [EncodedRecord.of(r).wire() for r in records])
