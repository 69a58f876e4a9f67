"""The store's thread: one SQLite connection, group commit, and the queue async callers put operations on.

One thread owns the connection. Async callers queue operations; the thread runs every operation that is
waiting in one transaction (group commit) so thousands of writes per second cost one fsync-free commit
each batch, and the event loop never blocks on SQLite. Writes nobody waits for are queued without a future
(`submit`); a caller that needs the commit before answering waits for it (`queue`), sharing that commit with
whatever else was waiting. What the operations do lives beside this module, by concern: `schema` (tables and
migrations), `runs`, `records` (writes and group completion), `streams` (take, ack, leases, staleness,
versions), `reads` (counts and inspection), `evals`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import setproctitle

from rollout_buffer.delivery import schema

log = logging.getLogger(__name__)
T = TypeVar("T")
STORE_THREAD = "store"  # the store thread's name, in Python and for the OS
REFUSALS_SHOWN_S = 60.0  # how long `/status` shows the store's last refused operation
# A queued operation: the function the store thread runs, and the future of its waiter (None: submitted).
_Op = tuple[Callable[[sqlite3.Connection], Any], "asyncio.Future[Any] | None"]


_OPEN_ERRORS = (sqlite3.Error, OSError, schema.StoreTooNew, schema.NotAStore)


def _private_folder(folder: Path) -> None:
    """The store's folder, made if missing, its owner's alone: it holds records and runs' settings."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        folder.chmod(0o700)
    except PermissionError:
        log.warning("data dir %s belongs to another user: its mode stays as it is", folder)


def check_store(path: Path) -> None:
    """Open (or make) the store at `path` and close it again: StoreError saying what is wrong with it, before a
    server starts serving."""
    try:
        _private_folder(path.parent)
        schema.connect(path).close()
    except _OPEN_ERRORS as e:
        raise StoreError(f"cannot open {path}: {e}") from None


class StoreError(RuntimeError):
    """SQLite failed (disk full, I/O error, corrupt file): the caller answers 503, nothing is half-written."""


@dataclass(frozen=True)
class Statement:
    """One parameterised SQL statement as a store operation: atomic by itself, so the store thread runs it
    without a savepoint (and alone, as its own transaction)."""

    sql: str
    params: tuple[Any, ...]

    def __call__(self, conn: sqlite3.Connection) -> int:
        return conn.execute(self.sql, self.params).rowcount


@dataclass(frozen=True)
class WithSequel:
    """An operation with a sequel: `first(conn)` runs in the batch's transaction; once that is committed,
    `sequel(value)` runs outside any transaction (on the store thread) and may return a second operation, which
    opens the next batch (it starts at once, with whatever else is waiting). The waiter gets the second
    operation's value (the first's when there is none, or when it failed: the first stays committed)."""

    first: Callable[[sqlite3.Connection], Any]
    sequel: Callable[[Any], Callable[[sqlite3.Connection], Any] | None]

    def __call__(self, conn: sqlite3.Connection) -> Any:
        return self.first(conn)


@dataclass(frozen=True)
class _Sequel:
    """A `WithSequel` operation's second part, run in the batch after its first, with the first's value (what
    its waiter gets should the second fail)."""

    op: Callable[[sqlite3.Connection], Any]
    first_value: Any

    def __call__(self, conn: sqlite3.Connection) -> Any:
        return self.op(conn)


class Store:
    """The SQLite store; every public coroutine runs on the store thread."""

    def __init__(self, path: Path, max_bytes: int | None = None):
        self.path = path
        self.max_bytes = max_bytes
        self._queue: queue.SimpleQueue[_Op | None]
        self._queue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._conn: sqlite3.Connection | None = None
        self._last_refusal: tuple[float, str] | None = None  # when and why the store last refused an operation

    def refusal(self, within_s: float = REFUSALS_SHOWN_S) -> dict[str, Any] | None:
        """The last operation the store refused (`at`, epoch seconds, and `error`: a full disk, `--max-db-mb`), if
        it was within the last `within_s` seconds."""
        last = self._last_refusal
        return None if last is None or time.time() - last[0] > within_s else {"at": last[0], "error": last[1]}

    # ---- lifecycle -------------------------------------------------------------------------------
    async def open(self) -> None:
        """Create or open the database and start the store thread."""
        _private_folder(self.path.parent)
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._main, args=(loop, ready), name=STORE_THREAD, daemon=True)
        self._thread.start()
        await ready

    async def close(self) -> None:
        """Finish queued operations and close the connection."""
        if self._thread is None:
            return
        self._queue.put(None)
        await asyncio.to_thread(self._thread.join, 30)
        self._thread = None

    def _main(self, loop: asyncio.AbstractEventLoop, ready: asyncio.Future[None]) -> None:
        # Named for the OS too: `top -H` and the benchmarks tell the store's CPU from the event loop's.
        setproctitle.setthreadtitle(STORE_THREAD)
        try:
            self._conn = schema.connect(self.path, self.max_bytes)
        except _OPEN_ERRORS as e:
            loop.call_soon_threadsafe(ready.set_exception, StoreError(f"cannot open {self.path}: {e}"))
            return
        loop.call_soon_threadsafe(ready.set_result, None)
        conn = self._conn
        stop = False
        carried: list[_Op] = []  # the last batch's sequels: they open the next batch, which starts at once
        while True:
            batch, carried = carried, []
            if not stop:
                stop = self._take_waiting(batch, block=not batch)
            if batch:
                carried = self._run_batch(conn, batch)
            elif stop:
                break
        conn.close()

    def _take_waiting(self, batch: list[_Op], block: bool) -> bool:
        """Add what is queued to `batch` (up to 512 operations; waiting for a first one when `block`); True once
        the stop sentinel was taken."""
        while len(batch) < 512:
            try:
                item = self._queue.get() if block else self._queue.get_nowait()
            except queue.Empty:
                return False
            block = False
            if item is None:
                return True
            batch.append(item)
        return False

    def _run_batch(self, conn: sqlite3.Connection, batch: list[_Op]) -> list[_Op]:
        """Run `batch` in one transaction (each operation in one of its own when that fails) and answer its
        waiters; returns the sequels of its `WithSequel` operations, whose waiters are answered once those commit
        (in the next batch)."""
        results: list[tuple[asyncio.Future[Any] | None, Any, BaseException | None]] = []
        if len(batch) == 1 and isinstance(batch[0][0], Statement):
            # Alone, one statement is its own transaction: one call into SQLite instead of five (each lets go
            # of the GIL and takes it back, which costs the event loop's thread more than the write).
            fn, fut = batch[0]
            try:
                results.append((fut, fn(conn), None))
            except sqlite3.Error as e:
                results.append((fut, None, self._refused(e)))
            except Exception as e:  # parameters SQLite cannot bind: nothing was written
                results.append((fut, None, e))
            self._resolve_all(results)
            return []
        try:
            conn.execute("BEGIN IMMEDIATE")
            for fn, fut in batch:
                savepoint = not isinstance(fn, Statement)  # a statement is atomic by itself
                if savepoint:
                    conn.execute("SAVEPOINT op")
                try:
                    value = fn(conn)
                except sqlite3.Error:
                    raise  # disk full, I/O error: SQLite may have dropped the whole transaction
                except Exception as e:  # one bad operation must not undo the others
                    if savepoint:
                        conn.execute("ROLLBACK TO op")
                        conn.execute("RELEASE op")
                    if isinstance(fn, _Sequel):  # its first part stands: the waiter gets that part's value
                        log.error("a store operation's sequel failed; its first part stays committed: %s", e)
                        results.append((fut, fn.first_value, None))
                    else:
                        results.append((fut, None, e))
                    continue
                if savepoint:
                    conn.execute("RELEASE op")
                results.append((fut, value, None))
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            if len(batch) > 1:
                # One operation's failure (a write on a full disk) must not refuse the others (a read, a write
                # that needs no new page): each runs again in a transaction of its own.
                log.warning("store transaction failed (%s); its %d operations run again one at a time", e,
                            len(batch))
                return [sequel for op in batch for sequel in self._run_batch(conn, [op])]
            err = self._refused(e)
            # Nothing of the transaction was kept; a sequel's first part, committed before, stands.
            results = [(fut, fn.first_value, None) if isinstance(fn, _Sequel) else (fut, None, err)
                       for fn, fut in batch]
            self._resolve_all(results)
            return []
        carried = self._sequels(batch, results)
        self._resolve_all(results)
        return carried

    def _refused(self, error: sqlite3.Error) -> StoreError:
        """An operation SQLite refused alone (a full disk, an I/O error): logged, kept for `refusal`, and the
        error its waiter gets."""
        log.error("store operation refused: %s", error)
        self._last_refusal = (time.time(), str(error))
        return StoreError(f"store write failed: {error}")

    @staticmethod
    def _sequels(batch: list[_Op], results: list[tuple[asyncio.Future[Any] | None, Any, BaseException | None]]
                 ) -> list[_Op]:
        """The sequels of the committed batch's `WithSequel` operations, each carrying its waiter (answered when
        the sequel commits instead of now)."""
        carried: list[_Op] = []
        for i, ((fn, fut), (_, value, exc)) in enumerate(zip(batch, results, strict=True)):
            if not isinstance(fn, WithSequel) or exc is not None:
                continue
            try:
                op = fn.sequel(value)
            except Exception:
                log.exception("a store operation's sequel failed; its first part stays committed")
                continue
            if op is not None:
                carried.append((_Sequel(op, value), fut))
                results[i] = (None, value, None)
        return carried

    @staticmethod
    def _resolve_all(results: list[tuple[asyncio.Future[Any] | None, Any, BaseException | None]]) -> None:
        for fut, value, exc in results:
            if fut is None:  # submitted: nobody waits, so a failure is logged
                if exc is not None:
                    log.error("store write without a waiter failed: %s", exc)
                continue
            loop = fut.get_loop()
            loop.call_soon_threadsafe(_resolve, fut, value, exc)

    async def call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn(conn)` on the store thread inside the current group-commit transaction."""
        return await self.queue(fn)

    def queue(self, fn: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        """Queue `fn(conn)` for the next group commit; the future resolves once it is committed. Cancelling the
        future (its waiter gave up) does not take the write back."""
        if self._thread is None:
            raise StoreError("store is closed")
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.put((fn, fut))
        return fut

    def submit(self, fn: Callable[[sqlite3.Connection], Any]) -> None:
        """Queue `fn(conn)` for the next group commit without waiting for it: no future, no wake-up of the event
        loop. Operations run in the order they were queued (`call`s included); a failure is logged."""
        if self._thread is None:
            log.warning("store is closed: a write was dropped")
            return
        self._queue.put((fn, None))


def _resolve(fut: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
