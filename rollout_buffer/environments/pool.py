"""A pool of environment processes (verifiers workers, OpenEnv servers): started lazily, leased least busy first,
one that died replaced by the next lease."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Generic, Protocol, TypeVar

log = logging.getLogger(__name__)


class EnvError(Exception):
    """An environment could not serve an episode; `error_kind` names why (the runner records it on the trajectory)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.error_kind = kind


class PooledProcess(Protocol):
    """What the pool needs of a process: start it, stop it, know whether it is gone, count its leases."""

    dead: bool
    leases: int

    @property
    def label(self) -> str: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


P = TypeVar("P", bound=PooledProcess)


class ProcessPool(Generic[P]):
    """`size` processes made by `make(index)`, each leased to at most `max_leases` holders at once."""

    def __init__(self, make: Callable[[int], P], size: int, max_leases: int, name: str):
        self.make, self.name = make, name
        self.processes: list[P | None] = [None] * size
        self._starting: dict[int, asyncio.Task[P]] = {}
        self._slots = asyncio.Semaphore(size * max_leases)
        self.replaced = 0
        self._closed = False

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[P]:
        """The least busy live process (started or replaced first), held until the block ends."""
        async with self._slots:
            process = await self._pick()
            process.leases += 1
            try:
                yield process
            finally:
                process.leases -= 1

    async def aclose(self) -> None:
        """Stop every process (the run ended or was replaced)."""
        self._closed = True
        for task in self._starting.values():
            task.cancel()
        await asyncio.gather(*(p.stop() for p in self.processes if p is not None), return_exceptions=True)

    async def _pick(self) -> P:
        if self._closed:
            raise EnvError("env_stopped", f"the {self.name} processes were stopped (the run ended)")
        live = [(p.leases, i) for i, p in enumerate(self.processes) if p is not None and not p.dead]
        if live and (min(live)[0] == 0 or len(live) == len(self.processes)):
            found = self.processes[min(live)[1]]
            assert found is not None
            return found
        index = next(i for i, p in enumerate(self.processes) if p is None or p.dead)
        task = self._starting.get(index)
        if task is None:
            task = asyncio.create_task(self._start(index), name=f"{self.name} {index} start")
            self._starting[index] = task
        return await asyncio.shield(task)

    async def _start(self, index: int) -> P:
        try:
            old = self.processes[index]
            if old is not None:
                self.replaced += 1
                log.warning("replacing %s", old.label)
                await old.stop()
            process = self.make(index)
            await process.start()
            self.processes[index] = process
            return process
        finally:
            self._starting.pop(index, None)
