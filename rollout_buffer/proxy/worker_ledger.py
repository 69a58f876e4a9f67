"""Which session worker holds each session the buffer placed, and what the buffer keeps of it: its summary (what
its failure record says if it is lost), how it was placed (to place it again), and, once closed, which worker held
it (that worker still answers for it for a while)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.generation.runner import Run
from rollout_buffer.proxy.placements import Placement, PlacementStream
from rollout_buffer.proxy.recovery import StoredSummary

_RECENT_KEPT = 4096  # closed sessions whose worker is still asked about them (their view; a finish again: 409)


@dataclass(eq=False)
class WorkerSlot:
    """One session worker: its port and folder stay the same across its restarts."""

    index: int
    url: str = ""  # as the buffer reaches it (known once started)
    public_url: str = ""  # as agents reach it
    where: dict[str, Any] = field(default_factory=dict)  # which process it is (pid, node)
    up: asyncio.Event = field(default_factory=asyncio.Event)
    tried: asyncio.Event = field(default_factory=asyncio.Event)  # its first start succeeded or failed
    failed: str = ""  # why its latest start failed, until it is up again (it is tried again meanwhile)
    sessions: set[str] = field(default_factory=set)
    runs: dict[str, asyncio.Task[Any]] = field(default_factory=dict)  # run id -> its opening on this process
    restarts: int = 0
    supervisor: asyncio.Task[None] | None = None
    released: list[str] = field(default_factory=list)  # sessions whose records were stored, to tell it
    served: int = 0  # sessions placed on it since the buffer started
    opening: int = 0  # sessions being opened on it
    moved: bool = False  # started again at another address (its Ray actor was lost): its sessions' URLs are dead
    taking: asyncio.Lock = field(default_factory=asyncio.Lock)  # storing a batch it sent
    stream: PlacementStream | None = None  # where its sessions are placed (`proxy.placements`)

    @property
    def load(self) -> int:
        """Its sessions, those being opened included (what placing a session compares)."""
        return len(self.sessions) + self.opening


class PlacedSessions:
    """The sessions placed on the workers, each counted in its run while held (`current`: the running run of an
    id, if it is)."""

    def __init__(self, current: Callable[[str], Run | None]):
        self._current = current
        self.placed: dict[str, WorkerSlot] = {}  # session id -> the worker holding it
        self.recent: OrderedDict[str, WorkerSlot] = OrderedDict()  # closed session id -> the worker that held it
        self.summaries: dict[str, StoredSummary] = {}  # harness sessions' summaries
        self.placements: dict[str, Placement] = {}  # how each harness session was placed

    def hold(self, slot: WorkerSlot, summary: StoredSummary, placement: Placement | None = None) -> None:
        """A harness session is on `slot` (placed, or restored there from its journal)."""
        if summary.session_id in self.placed:
            return
        self.placed[summary.session_id] = slot
        self.summaries[summary.session_id] = summary
        if placement is not None:
            self.placements[summary.session_id] = placement
        slot.sessions.add(summary.session_id)
        slot.served += 1
        run = self._current(summary.run_id)
        if run is not None:
            run.session_opened(summary.session_id)

    def let_go(self, session_id: str) -> bool:
        """Forget a closed session (counted out of its run); False when it was not held."""
        slot = self.placed.pop(session_id, None)
        summary = self.summaries.pop(session_id, None)
        self.placements.pop(session_id, None)
        if slot is None:
            return False
        slot.sessions.discard(session_id)
        self.recent[session_id] = slot
        while len(self.recent) > _RECENT_KEPT:
            self.recent.popitem(last=False)
        run = self._current(summary.run_id) if summary is not None else None
        if run is not None:
            run.session_closed(session_id)
        return True

    def forget(self, session_id: str) -> None:
        """A generator's session closed (not counted in a run: its trajectory is)."""
        slot = self.placed.pop(session_id, None)
        if slot is not None:
            slot.sessions.discard(session_id)

    def holds(self, session_id: str) -> bool:
        """Whether a worker holds the session, or held it until it closed recently."""
        return session_id in self.placed or session_id in self.recent
