"""Placing harness sessions on session workers one way: the buffer makes a session's id, key and uid itself,
answers `POST /sessions` at once, and sends the placement over a WebSocket it keeps open to each worker
(`PlacementStream`, to the worker's `/worker/placements`); the worker opens the session when the placement
arrives (`Arrivals`).

Why not a call per session: its answer is a wake-up, a read and a parse in the buffer for every session, which
is what a session costs the buffer besides accepting `POST /sessions` and storing the records
(docs/benchmarks). The placement leaves before the harness has its answer, so it reaches the worker before the
agent's first request; a request that comes first anyway (another route through the network) waits up to
`ARRIVAL_WAIT_S` for it. A placed session's id names its worker and ends with a checksum, so a request for one
placed elsewhere, for an id no worker was given, or for one mistyped or made up, is refused at once.

Faults: a placement the worker never read is lost with its process; the buffer's recovery places again every
session it placed there that the worker's journal does not hold and whose records are not in (a session's opening
is journaled before its first turn is answered). A stream that breaks while its worker lives is opened again and
every session the buffer placed there is sent again (the worker ignores those it holds or held). A placement the
worker cannot open is told to the buffer (`unplaced`, with the reason), which records the session failed; its
agent's requests are refused with that reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, Field, ValidationError
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from rollout_buffer.proxy.session_names import placed_on, well_formed

log = logging.getLogger(__name__)

ARRIVAL_WAIT_S = 5.0  # how long a request for a session the worker does not hold waits for its placement
_REFUSED_KEPT = 4096


class Placement(BaseModel):
    """A harness session the buffer placed on a worker: everything the worker opens it with."""

    run_id: str
    session_id: str
    instance_id: str
    repeat: int = Field(ge=0)
    api_key: str
    public_url: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class PlacementStream:
    """The buffer's end of a worker's placements: one WebSocket, written to and never read (but for its close)."""

    def __init__(self, connection: ClientConnection):
        self._connection = connection
        self.closed: asyncio.Task[None] = asyncio.create_task(connection.wait_closed())

    @classmethod
    async def open(cls, worker_url: str, headers: dict[str, str]) -> PlacementStream:
        """Connect to the worker at `worker_url` (`http://host:port`); OSError or websockets' errors when it
        refuses."""
        url = "ws" + worker_url.removeprefix("http") + "/worker/placements"
        connection = await connect(url, additional_headers=headers, compression=None, open_timeout=30,
                                   max_size=2**20)
        return cls(connection)

    async def send(self, placement: Placement) -> bool:
        """Send `placement`; False when the stream is closed (its worker is lost or started again: recovery
        places the session again)."""
        try:
            await self._connection.send(placement.model_dump_json())
        except ConnectionClosed:
            return False
        return True

    async def close(self) -> None:
        """Close the stream (the worker's end returns)."""
        await self._connection.close()
        await asyncio.gather(self.closed, return_exceptions=True)


# What opening a placed session on a worker does: None when opened, else why not.
Open = Callable[[Placement], Awaitable[str | None]]


class Arrivals:
    """A worker's end: opens the sessions placed on it, in order, and lets requests for a session not here yet
    wait for its placement."""

    def __init__(self, open_session: Open, holds: Callable[[str], bool], index: int):
        self._open = open_session
        self._holds = holds  # whether the worker holds (or held) the session
        self._index = index  # this worker's: the sessions placed here name it (`session_names.placed_on`)
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self.refused: OrderedDict[str, str] = OrderedDict()  # session id -> why it could not be opened

    def waiting(self) -> int:
        """How many sessions have requests waiting for their placement."""
        return len(self._waiting)

    async def arrive(self, raw: bytes | str) -> None:
        """Open the session one placement names (a malformed one is logged and dropped: only the buffer sends
        them)."""
        try:
            placement = Placement.model_validate_json(raw)
        except ValidationError as e:  # not JSON, too
            log.error("a placement that is not valid was dropped: %s", e)
            return
        if self._holds(placement.session_id) or placement.session_id in self.refused:
            return  # sent again on a new stream
        why = await self._open(placement)
        if why is not None:
            log.warning("session %s could not be opened here: %s", placement.session_id, why)
            self.refused[placement.session_id] = why
            while len(self.refused) > _REFUSED_KEPT:
                self.refused.popitem(last=False)
        waiting = self._waiting.pop(placement.session_id, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    async def wait(self, session_id: str) -> str | None:
        """None once the session is here, or when it is not to come: an id no worker was given, or mistyped (at
        once), or a placement that did not arrive within `ARRIVAL_WAIT_S` (the caller then answers for an unknown
        session). Else why it will not be here: the worker could not open it, or it names another worker (at once)."""
        if self._holds(session_id):
            return None
        placed = placed_on(session_id)
        if placed is not None and placed != self._index:
            return (f"was placed on session worker {placed}, not on this one ({self._index}): send its requests "
                    "to the base_url that POST /sessions answered")
        if placed is None or session_id in self.refused or not well_formed(session_id):
            return self._refusal(session_id)
        waiting = self._waiting.get(session_id)
        if waiting is None:
            waiting = self._waiting[session_id] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(waiting), ARRIVAL_WAIT_S)
        except TimeoutError:
            if self._waiting.get(session_id) is waiting:
                del self._waiting[session_id]
        return self._refusal(session_id)

    def _refusal(self, session_id: str) -> str | None:
        why = self.refused.get(session_id)
        return None if why is None else f"could not be opened: {why}"
