"""A session worker's finished records on their way to the buffer (`proxy.worker_run.BufferLink`): each closed
session's records (a parcel) are written here before its finish is answered, and go once the buffer stored them.

A harness finishing at its worker is answered once its records are on the worker's disk, not once the buffer
stored them: the link can then gather many sessions' records into one request to the buffer (each request costs
the buffer more than the records it carries) without making every finish wait that long.

Parcels are frames (`proxy.session_files`) in segment files, `<worker data dir>/outbox/<n>.parcels`: a new
segment is begun each time the link takes the waiting parcels, and a segment goes once all its parcels are stored
(or refused). A worker that starts finds the parcels of its last process here: they are held until the buffer,
which has the store, said which of them it stored already (`release`); the rest are sent again. Parcels the buffer
refused for good (their run is gone, a malformed record) are moved to `<worker data dir>/outbox/refused/`, kept
for inspection, and logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from rollout_buffer.proxy.session_files import SessionFiles

log = logging.getLogger(__name__)

_SUFFIX = ".parcels"


@dataclass(eq=False)
class Parcel:
    """The records (wire form) one closed session of run `run_id` handed over; `seq` orders parcels."""

    seq: int
    run_id: str
    records: list[dict[str, Any]]
    segment: str
    size: int  # bytes of its frame: what it adds to a request
    held: bool = False  # found at start: sent once the buffer said it had not stored it (`Outbox.release`)

    def episodes(self) -> list[tuple[str, str, str]]:
        """`(run_id, instance_id, episode uid)` of its records, as `RolloutBuffer.episodes_stored` takes them."""
        keys = {(self.run_id, str(r.get("instance_id")), str(r.get("episode") or r.get("uid"))) for r in self.records}
        return sorted(keys)

    def wire(self) -> dict[str, Any]:
        """As a `POST /workers/records` body carries it."""
        return {"run_id": self.run_id, "records": self.records}


class Outbox:
    """The parcels not yet stored by the buffer, on disk and in memory. Writes raise OSError when the disk refuses
    them (nothing of the parcel is kept)."""

    def __init__(self, folder: Path):
        self.files = SessionFiles(folder, _SUFFIX)
        self.refused = SessionFiles(folder / "refused", _SUFFIX)
        self.waiting: list[Parcel] = []  # to send, oldest first
        self.unstored: dict[int, Parcel] = {}  # every parcel not yet stored or refused, by seq
        self._segments: dict[str, int] = {}  # segment -> its parcels not yet stored
        self._segment: str | None = None  # the one new parcels are written to
        self._next_segment = 0
        self._next_seq = 0

    @property
    def waiting_bytes(self) -> int:
        """What the waiting parcels would add to a request."""
        return sum(p.size for p in self.waiting)

    @property
    def last_seq(self) -> int:
        """The seq of the newest parcel (-1: none yet)."""
        return self._next_seq - 1

    def load(self) -> list[Parcel]:
        """The parcels the worker's last process left (held: see `release`). Call once, before `add`."""
        found: list[Parcel] = []
        for segment, frames in self.files.load():
            self._next_segment = max(self._next_segment, int(segment) + 1)
            for body in frames:
                run_id, records = orjson.loads(body)
                found.append(self._track(Parcel(self._next_seq, run_id, records, segment, len(body), held=True)))
                self._next_seq += 1
            if not frames:
                self.files.remove(segment)
        if found:
            log.info("outbox: %d parcels of records from the last process, sent once the buffer has checked them",
                     len(found))
        return found

    def add(self, run_id: str, records: list[dict[str, Any]]) -> Parcel:
        """Write the records of a closed session; the parcel waits to be sent."""
        body = orjson.dumps([run_id, records])
        if self._segment is None:
            self._segment = f"{self._next_segment:012d}"
            self._next_segment += 1
            self.files.create(self._segment, body)
        else:
            self.files.append(self._segment, body)
        parcel = self._track(Parcel(self._next_seq, run_id, records, self._segment, len(body)))
        self._next_seq += 1
        self.waiting.append(parcel)
        return parcel

    def _track(self, parcel: Parcel) -> Parcel:
        self.unstored[parcel.seq] = parcel
        self._segments[parcel.segment] = self._segments.get(parcel.segment, 0) + 1
        return parcel

    def take(self) -> list[Parcel]:
        """The waiting parcels, to send (new parcels go to a new segment)."""
        taken, self.waiting = self.waiting, []
        self._segment = None
        return taken

    def back(self, parcels: list[Parcel]) -> None:
        """Parcels that were not sent after all (those stored meanwhile aside): first in line again."""
        self.waiting[:0] = [p for p in parcels if p.seq in self.unstored]

    def stored(self, parcels: list[Parcel]) -> None:
        """The buffer stored these parcels: forgotten, and their segments gone once empty."""
        for parcel in parcels:
            if self.unstored.pop(parcel.seq, None) is None:
                continue
            left = self._segments[parcel.segment] = self._segments[parcel.segment] - 1
            if left == 0 and parcel.segment != self._segment:
                del self._segments[parcel.segment]
                self.files.remove(parcel.segment)

    def refuse(self, parcels: list[Parcel], reason: str) -> None:
        """The buffer refused these parcels for good: kept in `refused/` with the reason, out of the way."""
        for parcel in parcels:
            try:
                self.refused.create(f"{parcel.segment}-{parcel.seq}", orjson.dumps([parcel.run_id, parcel.records,
                                                                                      reason]))
            except OSError as e:
                log.error("outbox: refused parcel %d could not be kept: %s", parcel.seq, e)
        if parcels:
            log.error("outbox: the buffer refused %d parcels of records (%s); they are kept in %s", len(parcels),
                      reason, self.refused.folder)
        self.stored(parcels)

    def release(self, stored: set[str]) -> None:
        """The buffer checked the held parcels: those whose every episode uid is in `stored` go, the rest wait to be
        sent again."""
        held = [p for p in self.unstored.values() if p.held]
        done = [p for p in held if all(uid in stored for _, _, uid in p.episodes())]
        self.stored(done)
        for parcel in held:
            parcel.held = False
        self.waiting[:0] = [p for p in held if p.seq in self.unstored]

    def done_through(self, seq: int) -> bool:
        """Whether every parcel up to `seq` that is not held was stored (or refused)."""
        return all(p.seq > seq or p.held for p in self.unstored.values())
