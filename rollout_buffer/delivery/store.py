"""Durable state in SQLite (WAL): runs, trajectories, groups, delivered batches and open agent sessions.

One thread owns the connection. Async callers queue operations; the thread runs every operation that is
waiting in one transaction (group commit) so thousands of writes per second cost one fsync-free commit
each batch, and the event loop never blocks on SQLite. Writes nobody waits for (forgetting a closed session)
are queued without a future (`submit`); an agent session's turn waits for its commit (`queue`) before the
client gets the answer, sharing that commit with whatever else was waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import orjson

from rollout_buffer.delivery.groups import GroupOutcome, Record
from rollout_buffer.delivery.versions import StalenessRule, TrainerVersion, group_version_range

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    state TEXT NOT NULL,
    group_size INTEGER NOT NULL,
    config BLOB NOT NULL,
    progress BLOB,
    error TEXT
);
CREATE TABLE IF NOT EXISTS trajectories (
    uid TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    part INTEGER NOT NULL,
    status TEXT NOT NULL,
    episode TEXT NOT NULL,
    created_at REAL NOT NULL,
    record BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS trajectories_group ON trajectories(run_id, instance_id, epoch, part);
CREATE TABLE IF NOT EXISTS groups (
    run_id TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    part INTEGER NOT NULL,
    size INTEGER NOT NULL,
    n INTEGER NOT NULL,
    state TEXT NOT NULL,          -- open | ready | leased | delivered | filtered
    reason TEXT,
    ready_seq INTEGER,
    batch_id TEXT,
    lease_expires REAL,
    completed_at REAL,
    PRIMARY KEY (run_id, instance_id, epoch, part)
);
CREATE INDEX IF NOT EXISTS groups_ready ON groups(state, ready_seq);
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    lease_expires REAL,
    acked_at REAL,
    num_groups INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
-- Role streams: every ready group once per role (extra_info.agent_id) it has records of, with that role's
-- record count and versions, and the role stream's own delivery state (groups.state is the default stream's).
CREATE TABLE IF NOT EXISTS stream_groups (
    stream TEXT NOT NULL,
    run_id TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    part INTEGER NOT NULL,
    records INTEGER NOT NULL,
    version_min INTEGER,
    version_max INTEGER,
    ready_seq INTEGER NOT NULL,   -- the group's, so every stream delivers in completion order
    state TEXT NOT NULL,          -- ready | leased | delivered | filtered
    reason TEXT,
    batch_id TEXT,
    lease_expires REAL,
    PRIMARY KEY (stream, run_id, instance_id, epoch, part)
);
CREATE INDEX IF NOT EXISTS stream_groups_ready ON stream_groups(stream, state, ready_seq);
CREATE INDEX IF NOT EXISTS stream_groups_group ON stream_groups(run_id, instance_id, epoch, part);
CREATE INDEX IF NOT EXISTS stream_groups_batch ON stream_groups(batch_id);
-- The trainer's version per role (each role's trainer and engines have their own).
CREATE TABLE IF NOT EXISTS role_versions (
    run_id TEXT NOT NULL,
    agent_id TEXT NOT NULL,
    base_version INTEGER,
    trainer_version INTEGER,
    updated_at REAL,
    PRIMARY KEY (run_id, agent_id)
);
CREATE TABLE IF NOT EXISTS run_control (
    run_id TEXT PRIMARY KEY,
    base_version INTEGER,         -- the trainer's version when the run began (the first one it heard of)
    trainer_version INTEGER,      -- the newest version the trainer reported
    admission TEXT,               -- running | paused_staleness | paused_cap, as the runner last decided
    updated_at REAL
);
CREATE TABLE IF NOT EXISTS evals (  -- one eval dataset at one trainer version (delivery.evals)
    dataset TEXT NOT NULL,
    version INTEGER NOT NULL,
    state TEXT NOT NULL,          -- running | finished | failed
    n_samples INTEGER NOT NULL,
    num_items INTEGER NOT NULL,
    config BLOB NOT NULL,         -- what the runner needs to generate it (again, after a restart)
    created_at REAL NOT NULL,
    finished_at REAL,
    error TEXT,
    PRIMARY KEY (dataset, version)
);
CREATE TABLE IF NOT EXISTS eval_samples (
    dataset TEXT NOT NULL,
    version INTEGER NOT NULL,
    instance_id TEXT NOT NULL,
    sample INTEGER NOT NULL,
    position INTEGER NOT NULL,    -- the item's line in the dataset file: results keep the file's order
    status TEXT NOT NULL,
    reward REAL NOT NULL,
    response_length INTEGER,
    created_at REAL NOT NULL,
    records BLOB NOT NULL,        -- the generator's records of this sample, a JSON list
    PRIMARY KEY (dataset, version, instance_id, sample)
);
-- Open harness sessions of the agent proxy as versions before the session files (`proxy.session_files`) kept
-- them: one row per session, and each committed turn's additions to its branch tree. Read once at start-up and
-- moved to files.
CREATE TABLE IF NOT EXISTS agent_sessions (
    session_id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    uid TEXT NOT NULL,            -- the episode id its records get: a session whose records exist is closed
    state BLOB NOT NULL,          -- the proxy's JSON (key, repeat, URLs, metadata, opening time)
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS agent_session_turns (
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    meta BLOB NOT NULL,           -- JSON: branch, route, messages and state after the turn
    tokens BLOB NOT NULL,         -- the token ids the turn added (int32), loss mask (bytes), log-probs (float64)
    loss_mask BLOB NOT NULL,
    log_probs BLOB NOT NULL,
    PRIMARY KEY (session_id, seq)
);
"""

# The dashboard's paged, read-only queries (`queries.py`) find a page's rowids in one of these without reading
# the table: `reward` and `role` sit after the record's blob, so a filter that had to read them from the table
# would walk every record's overflow pages. Created after the columns they cover exist.
INSPECTION_INDEXES = """
CREATE INDEX IF NOT EXISTS trajectories_run ON trajectories(run_id);
CREATE INDEX IF NOT EXISTS trajectories_run_status ON trajectories(run_id, status);
CREATE INDEX IF NOT EXISTS trajectories_run_reward ON trajectories(run_id, reward, status, agent_id);
CREATE INDEX IF NOT EXISTS trajectories_run_role ON trajectories(run_id, agent_id, status) WHERE agent_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS trajectories_instance ON trajectories(instance_id);
CREATE INDEX IF NOT EXISTS groups_batch ON groups(batch_id) WHERE batch_id IS NOT NULL;
"""

GroupKey = tuple[str, str, int, int]  # run_id, instance_id, epoch, part
Order = Literal["oldest", "newest"]
# Delivery order: by completion, oldest or most recent first.
_ORDER_SQL = {"oldest": "ready_seq", "newest": "ready_seq DESC"}


class StoreError(RuntimeError):
    """SQLite failed (disk full, I/O error, corrupt file): the caller answers 503, nothing is half-written."""


class StreamMismatch(ValueError):
    """An ack names a batch that was delivered to another stream (role) than the one the ack names."""

    def __init__(self, batch_id: str, owner: str | None, stream: str | None):
        def name(s: str | None) -> str:
            return f"agent_id {s!r}" if s is not None else "the default stream (no agent_id)"

        super().__init__(f"agent_id: batch {batch_id!r} was delivered to {name(owner)}, not to {name(stream)}")


@dataclass
class NewRecord:
    """A validated trajectory ready to persist."""

    uid: str
    instance_id: str
    epoch: int
    status: str
    blob: bytes  # the record as JSON
    # Records of one multi-agent episode share it; a group counts episodes, not records.
    episode: str | None = None
    agent_id: str | None = None  # the record's role (`extra_info.agent_id`): its delivery stream
    reward: float | None = None  # as the generator scored it (before group normalization)


@dataclass
class WriteResult:
    """What one write call changed."""

    inserted: int = 0
    duplicates: int = 0
    completed: list[tuple[GroupKey, str | None]] = field(default_factory=list)  # (group, drop reason)
    roles: dict[GroupKey, list[str]] = field(default_factory=dict)  # the roles of each completed ready group
    inserted_by_status: dict[str, int] = field(default_factory=dict)


@dataclass
class StoredRecord:
    """A delivered record as stored (its JSON, sent on without parsing) and the fields delivery summarises."""

    blob: bytes
    reward: float
    raw_reward: float
    task_type: str | None
    tokenization_mismatch: bool

    def load(self) -> Record:
        """The record as a dict."""
        return orjson.loads(self.blob)


@dataclass(frozen=True)
class StaleGroup:
    """A ready group dropped at delivery because its oldest turn lagged the trainer by more than η."""

    key: GroupKey
    version_min: int
    lag: int
    regenerate_part: int | None  # the new (empty, open) part it is generated again into, when asked


@dataclass
class Batch:
    """Groups handed to one consumer call, and what the call changed besides."""

    batch_id: str | None
    groups: list[list[StoredRecord]]
    next_lease_expiry: float | None
    redelivered: int = 0
    run_ids: list[str] = field(default_factory=list)  # per group
    versions: list[int | None] = field(default_factory=list)  # per group: its oldest known weight version
    stale: list[StaleGroup] = field(default_factory=list)
    expired_by_run: dict[str, int] = field(default_factory=dict)  # leases that ran out: ready again


@dataclass(frozen=True)
class Statement:
    """One parameterised SQL statement as a store operation: atomic by itself, so the store thread runs it
    without a savepoint (and alone, as its own transaction)."""

    sql: str
    params: tuple[Any, ...]

    def __call__(self, conn: sqlite3.Connection) -> int:
        return conn.execute(self.sql, self.params).rowcount


@dataclass
class StoredSession:
    """An open agent session as written down (`proxy.journal`): what identifies it, its state (JSON), and its
    turns `(seq, meta, tokens, loss_mask, log_probs)` in order."""

    session_id: str
    run_id: str
    instance_id: str
    uid: str
    state: bytes
    turns: list[tuple[int, bytes, bytes, bytes, bytes]]


@dataclass
class StoredWork:
    """What a (resumed) run already has in the store."""

    done: set[tuple[str, int]]  # (instance_id, epoch) with no open part left
    open: dict[tuple[str, int], tuple[int, set[str]]]  # (instance_id, epoch) → (open part, episode uids in it)


class Store:
    """The SQLite store; every public coroutine runs on the store thread."""

    def __init__(self, path: Path, max_bytes: int | None = None):
        self.path = path
        self.max_bytes = max_bytes
        self._queue: queue.SimpleQueue[tuple[Callable[[sqlite3.Connection], Any], asyncio.Future | None] | None]
        self._queue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._conn: sqlite3.Connection | None = None

    # ---- lifecycle -------------------------------------------------------------------------------
    async def open(self) -> None:
        """Create or open the database and start the store thread."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._main, args=(loop, ready), name="store", daemon=True)
        self._thread.start()
        await ready

    async def close(self) -> None:
        """Finish queued operations and close the connection."""
        if self._thread is None:
            return
        self._queue.put(None)
        await asyncio.to_thread(self._thread.join, 30)
        self._thread = None

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode survives a killed process; only power loss can drop the last commits.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=5000")
        conn.executescript(SCHEMA)
        if "summary" not in {row[1] for row in conn.execute("PRAGMA table_info(trajectories)")}:
            # What delivery reads of a completed record, so it can send the stored JSON without parsing it;
            # stores written before this column summarise their records at delivery instead.
            conn.execute("ALTER TABLE trajectories ADD COLUMN summary BLOB")
        trajectory_columns = {row[1] for row in conn.execute("PRAGMA table_info(trajectories)")}
        if "agent_id" not in trajectory_columns:
            conn.execute("ALTER TABLE trajectories ADD COLUMN agent_id TEXT")  # stores before role streams
        if "reward" not in trajectory_columns:
            # What the dashboard searches by; rows of stores written before it have none and are found by uid,
            # instance, role and status only.
            conn.execute("ALTER TABLE trajectories ADD COLUMN reward REAL")
        if "stream" not in {row[1] for row in conn.execute("PRAGMA table_info(batches)")}:
            conn.execute("ALTER TABLE batches ADD COLUMN stream TEXT")
        conn.executescript(INSPECTION_INDEXES)
        group_columns = {row[1] for row in conn.execute("PRAGMA table_info(groups)")}
        for column in ("version_min", "version_max"):
            if column not in group_columns:  # stores written before version-aware delivery
                conn.execute(f"ALTER TABLE groups ADD COLUMN {column} INTEGER")
        if self.max_bytes is not None:
            page_size = conn.execute("PRAGMA page_size").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count={max(1, self.max_bytes // page_size)}")
        return conn

    def _main(self, loop: asyncio.AbstractEventLoop, ready: asyncio.Future) -> None:
        try:
            self._conn = self._connect()
        except sqlite3.Error as e:
            loop.call_soon_threadsafe(ready.set_exception, StoreError(f"cannot open {self.path}: {e}"))
            return
        loop.call_soon_threadsafe(ready.set_result, None)
        conn = self._conn
        stop = False
        while not stop:
            item = self._queue.get()
            batch = []
            while item is not None:
                batch.append(item)
                if len(batch) >= 512:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            else:
                stop = True
            if batch:
                self._run_batch(conn, batch)
        conn.close()

    def _run_batch(self, conn: sqlite3.Connection, batch: list) -> None:
        results: list[tuple[asyncio.Future | None, Any, BaseException | None]] = []
        if len(batch) == 1 and isinstance(batch[0][0], Statement):
            # Alone, one statement is its own transaction: one call into SQLite instead of five (each lets go
            # of the GIL and takes it back, which costs the event loop's thread more than the write).
            fn, fut = batch[0]
            try:
                results.append((fut, fn(conn), None))
            except sqlite3.Error as e:
                log.error("store statement failed: %s", e)
                results.append((fut, None, StoreError(f"store write failed: {e}")))
            except Exception as e:  # parameters SQLite cannot bind: nothing was written
                results.append((fut, None, e))
            self._resolve_all(results)
            return
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
                    results.append((fut, None, e))
                    continue
                if savepoint:
                    conn.execute("RELEASE op")
                results.append((fut, value, None))
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            log.error("store transaction failed, %d operations refused: %s", len(batch), e)
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            err = StoreError(f"store write failed: {e}")
            results = [(fut, None, err) for _, fut in batch]  # nothing of the transaction was kept
        self._resolve_all(results)

    @staticmethod
    def _resolve_all(results: list[tuple[asyncio.Future | None, Any, BaseException | None]]) -> None:
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

    # ---- runs ------------------------------------------------------------------------------------
    async def create_run(self, config: dict[str, Any], group_size: int, run_id: str | None = None) -> str:
        """Start a new run; the running one (if any) becomes `replaced`. Its finished groups stay."""
        rid = run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"

        def op(conn: sqlite3.Connection) -> str:
            conn.execute("UPDATE runs SET state='replaced' WHERE state='running'")
            conn.execute(
                "INSERT INTO runs(run_id, created_at, state, group_size, config) VALUES (?,?,?,?,?)",
                (rid, time.time(), "running", group_size, orjson.dumps(config)),
            )
            return rid

        return await self.call(op)

    async def latest_run(self) -> dict[str, Any] | None:
        """The newest run (the active one while it runs), or None."""

        def op(conn: sqlite3.Connection) -> dict[str, Any] | None:
            row = conn.execute(
                "SELECT run_id, created_at, state, group_size, config, progress, error FROM runs "
                "ORDER BY created_at DESC, rowid DESC LIMIT 1"
            ).fetchone()
            return _run_row(row) if row else None

        return await self.call(op)

    async def get_run(self, run_id: str) -> dict[str, Any] | None:
        """One run by id."""

        def op(conn: sqlite3.Connection) -> dict[str, Any] | None:
            row = conn.execute(
                "SELECT run_id, created_at, state, group_size, config, progress, error FROM runs "
                "WHERE run_id=?",
                (run_id,),
            ).fetchone()
            return _run_row(row) if row else None

        return await self.call(op)

    async def set_run_state(self, run_id: str, state: str, error: str | None = None) -> None:
        """Mark a run finished / failed (a replaced run keeps its state)."""
        await self.call(
            lambda c: c.execute(
                "UPDATE runs SET state=?, error=? WHERE run_id=? AND state='running'", (state, error, run_id)
            )
        )

    async def set_run_progress(self, run_id: str, progress: dict[str, Any]) -> None:
        """Persist a progress snapshot so /status survives restarts."""
        blob = orjson.dumps(progress)
        await self.call(lambda c: c.execute("UPDATE runs SET progress=? WHERE run_id=?", (blob, run_id)))

    # ---- writes ----------------------------------------------------------------------------------
    async def write_records(
        self,
        run_id: str,
        group_size: int,
        records: Iterable[NewRecord],
        finalize: Callable[[list[Record]], GroupOutcome],
    ) -> WriteResult:
        """Persist records (duplicate uids ignored) and finalize every group they complete."""
        items = list(records)
        return await self.call(lambda conn: _write(conn, run_id, group_size, items, finalize))

    # ---- reads -----------------------------------------------------------------------------------
    async def take(self, max_groups: int | None, lease_s: float | None, now: float | None = None,
                   order: Order = "oldest", current_version: int | None = None, stream: str | None = None,
                   run_id: str | None = None) -> Batch:
        """Hand out ready groups (oldest or newest first), at most one per instance id: leased for `lease_s`,
        or consumed when lease_s is None. With the trainer's `current_version`, ready groups of runs with
        `max_staleness` whose oldest turn lags it by more than η are dropped first (reason `stale`), and queued
        again as a new open part when their run asked for `regenerate_stale` and can still generate.

        With a `stream` (a role, `agent_id`), the same over that role's own delivery state: each group with
        records of the role, only those records, and the role's versions against `current_version` (the
        role's trainer); a role's stale group is dropped for that role only and not generated again.
        With a `run_id`, only that run's groups are handed out (other runs' stay ready)."""

        def op(conn: sqlite3.Connection) -> Batch:
            when = now or time.time()
            if stream is not None:
                expired = _expire_stream_leases(conn, stream, when)
                stale = (_drop_stale_stream(conn, stream, current_version, self._staleness_rule)
                         if current_version is not None else [])
                batch = _take(conn, max_groups, lease_s, when, order, stream, run_id)
            else:
                expired = _expire_leases(conn, when)
                stale = (_drop_stale(conn, current_version, self._staleness_rule)
                         if current_version is not None else [])
                batch = _take(conn, max_groups, lease_s, when, order, run_id=run_id)
            batch.expired_by_run, batch.stale = expired, stale
            return batch

        return await self.call(op)

    def _staleness_rule(self, conn: sqlite3.Connection, run_id: str) -> tuple[StalenessRule | None, bool]:
        """(the run's staleness rule, whether the run can still generate); store thread only."""
        row = conn.execute("SELECT config, state FROM runs WHERE run_id=?", (run_id,)).fetchone()
        if row is None:
            return None, False
        cfg = orjson.loads(row[0])
        return StalenessRule.of_run(cfg), row[1] in ("running", "finished") and bool(cfg.get("task_type"))

    async def ack(self, batch_id: str, stream: str | None = None) -> int:
        """Mark a leased batch consumed; returns how many groups it covered (0 for an unknown batch). Raises
        `StreamMismatch` when the batch was delivered to another stream than `stream`."""

        def op(conn: sqlite3.Connection) -> int:
            row = conn.execute("SELECT stream FROM batches WHERE batch_id=?", (batch_id,)).fetchone()
            owner = row[0] if row else None
            if row is not None and owner != stream:
                raise StreamMismatch(batch_id, owner, stream)
            table = "stream_groups" if owner is not None else "groups"
            cur = conn.execute(
                f"UPDATE {table} SET state='delivered', lease_expires=NULL "
                "WHERE batch_id=? AND state IN ('leased','ready')",
                (batch_id,),
            )
            conn.execute("UPDATE batches SET acked_at=? WHERE batch_id=? AND acked_at IS NULL",
                         (time.time(), batch_id))
            return cur.rowcount

        return await self.call(op)

    async def undelivered_by_run(self, but: str) -> dict[str, int]:
        """Ready or leased groups of every run but `but`: what earlier runs left (fetchable by naming the run)."""
        return dict(await self.call(lambda c: c.execute(
            "SELECT run_id, count(*) FROM groups WHERE state IN ('ready','leased') AND run_id<>? GROUP BY run_id",
            (but,)).fetchall()))

    async def group_counts(self, run_id: str | None = None) -> dict[str, int]:
        """Groups by state (one run, or all)."""
        return await self._count("groups", "state", "1", run_id)

    async def filter_counts(self, run_id: str | None = None) -> dict[str, int]:
        """Dropped groups by reason."""
        return await self._count("groups", "reason", "state='filtered'", run_id)

    async def record_counts(self, run_id: str | None = None) -> dict[str, int]:
        """Trajectories by status."""
        return await self._count("trajectories", "status", "1", run_id)

    async def _count(self, table: str, column: str, where: str, run_id: str | None) -> dict[str, int]:
        # Only called with the literal names above: nothing user-supplied reaches the SQL text.
        sql = f"SELECT {column}, count(*) FROM {table} WHERE {where}"
        sql, args = (sql + " AND run_id=?", (run_id,)) if run_id is not None else (sql, ())
        return await self.call(lambda conn: dict(conn.execute(f"{sql} GROUP BY {column}", args).fetchall()))

    async def stored_work(self, run_id: str) -> StoredWork:
        """What a resumed run already has: groups with nothing left open, and the open part (with the uids
        already stored in it) of every other group."""

        def op(conn: sqlite3.Connection) -> StoredWork:
            done = set(conn.execute(
                "SELECT instance_id, epoch FROM groups WHERE run_id=? GROUP BY instance_id, epoch "
                "HAVING sum(state='open')=0",
                (run_id,),
            ).fetchall())
            open_parts: dict[tuple[str, int], tuple[int, set[str]]] = {
                (i, e): (part, set()) for i, e, part in conn.execute(
                    "SELECT instance_id, epoch, min(part) FROM groups WHERE run_id=? AND state='open' "
                    "GROUP BY instance_id, epoch",
                    (run_id,),
                )
            }
            # A trajectory's uid is its episode id (multi-agent records are `uid-k` with episode_id `uid`).
            for i, e, part, uid in conn.execute(
                "SELECT t.instance_id, t.epoch, t.part, t.episode FROM trajectories t JOIN groups g ON "
                "g.run_id=t.run_id AND g.instance_id=t.instance_id AND g.epoch=t.epoch AND g.part=t.part "
                "WHERE t.run_id=? AND g.state='open'",
                (run_id,),
            ):
                if open_parts[(i, e)][0] == part:
                    open_parts[(i, e)][1].add(uid)
            return StoredWork(done, open_parts)

        return await self.call(op)

    # ---- run control: the trainer's version and the admission state --------------------------------
    async def run_state(self, run_id: str) -> tuple[dict[str, int], TrainerVersion]:
        """The run's groups by state and its trainer version bookkeeping, read together."""

        def op(conn: sqlite3.Connection) -> tuple[dict[str, int], TrainerVersion]:
            counts = dict(conn.execute("SELECT state, count(*) FROM groups WHERE run_id=? GROUP BY state",
                                       (run_id,)).fetchall())
            row = conn.execute("SELECT base_version, trainer_version FROM run_control WHERE run_id=?",
                               (run_id,)).fetchone()
            return counts, TrainerVersion(*row) if row else TrainerVersion()

        return await self.call(op)

    async def report_trainer_version(self, run_id: str, version: int, rewind: bool = False) -> TrainerVersion:
        """Record a version the trainer reported; raises `VersionConflict` (nothing written) when it goes back
        without `rewind`."""

        def op(conn: sqlite3.Connection) -> TrainerVersion:
            row = conn.execute("SELECT base_version, trainer_version FROM run_control WHERE run_id=?",
                               (run_id,)).fetchone()
            now = (TrainerVersion(*row) if row else TrainerVersion()).advanced(version, rewind)
            conn.execute(
                "INSERT INTO run_control(run_id, base_version, trainer_version, updated_at) VALUES (?,?,?,?) "
                "ON CONFLICT(run_id) DO UPDATE SET base_version=excluded.base_version, "
                "trainer_version=excluded.trainer_version, updated_at=excluded.updated_at",
                (run_id, now.base, now.current, time.time()),
            )
            return now

        return await self.call(op)

    async def report_role_version(self, run_id: str, role: str, version: int, rewind: bool = False
                                  ) -> TrainerVersion:
        """Record the version a role's trainer reported (as `report_trainer_version`, for one role)."""

        def op(conn: sqlite3.Connection) -> TrainerVersion:
            row = conn.execute("SELECT base_version, trainer_version FROM role_versions WHERE run_id=? AND agent_id=?",
                               (run_id, role)).fetchone()
            now = (TrainerVersion(*row) if row else TrainerVersion()).advanced(version, rewind)
            conn.execute("INSERT OR REPLACE INTO role_versions VALUES (?,?,?,?,?)",
                         (run_id, role, now.base, now.current, time.time()))
            return now

        return await self.call(op)

    async def role_state(self, run_id: str) -> tuple[int, dict[str, RoleState]]:
        """(groups of the run that became ready, each role of the run: its stream's counts and trainer version)."""
        return await self.call(lambda conn: _role_state(conn, run_id))

    async def set_admission(self, run_id: str, state: str) -> None:
        """Persist the runner's admission state, so a restarted buffer shows (and resumes) it."""
        await self.call(lambda c: c.execute(
            "INSERT INTO run_control(run_id, admission, updated_at) VALUES (?,?,?) "
            "ON CONFLICT(run_id) DO UPDATE SET admission=excluded.admission, updated_at=excluded.updated_at",
            (run_id, state, time.time()),
        ))

    async def admission(self, run_id: str) -> str | None:
        """The admission state last persisted for the run."""
        row = await self.call(
            lambda c: c.execute("SELECT admission FROM run_control WHERE run_id=?", (run_id,)).fetchone()
        )
        return row[0] if row else None

    async def reopen_run(self, run_id: str) -> bool:
        """Mark a finished run running again (it has groups to generate anew); False when it is not the
        latest run or not finished."""

        def op(conn: sqlite3.Connection) -> bool:
            latest = conn.execute("SELECT run_id FROM runs ORDER BY created_at DESC, rowid DESC LIMIT 1").fetchone()
            if latest is None or latest[0] != run_id:
                return False
            return conn.execute("UPDATE runs SET state='running', error=NULL WHERE run_id=? AND state='finished'",
                                (run_id,)).rowcount == 1

        return await self.call(op)

    async def list_groups(self, state: str | None, run_id: str | None, limit: int) -> list[dict[str, Any]]:
        """Groups for inspection, newest first, with the uids of their trajectories."""

        def op(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            where, args = [], []
            for column, value in (("g.state", state), ("g.run_id", run_id)):
                if value is not None:
                    where.append(f"{column}=?")
                    args.append(value)
            rows = conn.execute(
                "SELECT g.run_id, g.instance_id, g.epoch, g.part, g.state, g.reason, g.n, g.size, g.batch_id, "
                "g.lease_expires, g.completed_at, (SELECT group_concat(t.uid, ' ') FROM trajectories t WHERE "
                "t.run_id=g.run_id AND t.instance_id=g.instance_id AND t.epoch=g.epoch AND t.part=g.part) "
                f"FROM groups g {'WHERE ' + ' AND '.join(where) if where else ''} "
                "ORDER BY g.rowid DESC LIMIT ?",
                (*args, limit),
            ).fetchall()
            keys = ("run_id", "instance_id", "epoch", "part", "state", "reason", "episodes", "size", "batch_id",
                    "lease_expires", "completed_at")
            out = [{**dict(zip(keys, r[:-1], strict=True)), "uids": (r[-1] or "").split()} for r in rows]
            for group in out:
                group["roles"] = _group_roles(conn, (group["run_id"], group["instance_id"], group["epoch"],
                                                     group["part"]))
            return out

        return await self.call(op)

    async def get_record(self, uid: str) -> Record | None:
        """One stored trajectory by uid."""

        def op(conn: sqlite3.Connection) -> Record | None:
            row = conn.execute("SELECT record FROM trajectories WHERE uid=?", (uid,)).fetchone()
            return orjson.loads(row[0]) if row else None

        return await self.call(op)

    # ---- agent sessions --------------------------------------------------------------------------------
    # Open harness sessions are journaled in files (`proxy.session_files`); versions before that kept them in
    # the tables `agent_sessions` and `agent_session_turns`, read here once at start-up to be moved to files.
    def drop_session(self, session_id: str) -> None:
        """Forget a session of the tables (queued, not awaited)."""
        self.submit(lambda c: _drop_session(c, session_id))

    async def stored_sessions(self) -> list[StoredSession]:
        """Every session the tables still hold, oldest first (whether its records were stored since is for the
        caller to ask, as of the sessions in files: `episodes_stored`)."""

        def op(conn: sqlite3.Connection) -> list[StoredSession]:
            out: list[StoredSession] = []
            for session_id, run_id, instance_id, uid, state in conn.execute(
                    "SELECT session_id, run_id, instance_id, uid, state FROM agent_sessions ORDER BY rowid").fetchall():
                turns = conn.execute("SELECT seq, meta, tokens, loss_mask, log_probs FROM agent_session_turns "
                                     "WHERE session_id=? ORDER BY seq", (session_id,)).fetchall()
                out.append(StoredSession(session_id, run_id, instance_id, uid, state, turns))
            return out

        return await self.call(op)

    async def episodes_stored(self, episodes: list[tuple[str, str, str]]) -> set[str]:
        """Of `(run_id, instance_id, episode uid)`s, the uids some record is stored under."""

        def op(conn: sqlite3.Connection) -> set[str]:
            query = "SELECT 1 FROM trajectories WHERE run_id=? AND instance_id=? AND episode=? LIMIT 1"
            return {uid for run_id, instance_id, uid in episodes
                    if conn.execute(query, (run_id, instance_id, uid)).fetchone() is not None}

        return await self.call(op) if episodes else set()


def _drop_session(conn: sqlite3.Connection, session_id: str) -> None:
    conn.execute("DELETE FROM agent_session_turns WHERE session_id=?", (session_id,))
    conn.execute("DELETE FROM agent_sessions WHERE session_id=?", (session_id,))


def _resolve(fut: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def _run_row(row: tuple) -> dict[str, Any]:
    run_id, created_at, state, group_size, config, progress, error = row
    return {
        "run_id": run_id,
        "created_at": created_at,
        "state": state,
        "group_size": group_size,
        "config": orjson.loads(config),
        "progress": orjson.loads(progress) if progress else {},
        "error": error,
    }


def _next_seq(conn: sqlite3.Connection) -> int:
    conn.execute("INSERT INTO meta(key, value) VALUES ('ready_seq', 1) "
                 "ON CONFLICT(key) DO UPDATE SET value = value + 1")
    return conn.execute("SELECT value FROM meta WHERE key='ready_seq'").fetchone()[0]


def _write(
    conn: sqlite3.Connection,
    run_id: str,
    group_size: int,
    items: list[NewRecord],
    finalize: Callable[[list[Record]], GroupOutcome],
) -> WriteResult:
    result = WriteResult()
    now = time.time()
    touched: dict[GroupKey, None] = {}
    for item in items:
        # The open part of this (instance, epoch): later parts take records arriving after completion.
        row = conn.execute(
            "SELECT part FROM groups WHERE run_id=? AND instance_id=? AND epoch=? AND state='open' "
            "ORDER BY part LIMIT 1",
            (run_id, item.instance_id, item.epoch),
        ).fetchone()
        if row is None:
            last = conn.execute(
                "SELECT max(part) FROM groups WHERE run_id=? AND instance_id=? AND epoch=?",
                (run_id, item.instance_id, item.epoch),
            ).fetchone()[0]
            part = 0 if last is None else last + 1
        else:
            part = row[0]
        key = (run_id, item.instance_id, item.epoch, part)
        episode = item.episode or item.uid
        blob = item.blob
        if part:  # a record past a complete group says which part it belongs to
            record = orjson.loads(blob)
            record.setdefault("extra_info", {})["group_part"] = part
            blob = orjson.dumps(record)
        new_episode = conn.execute(
            "SELECT 1 FROM trajectories WHERE run_id=? AND instance_id=? AND epoch=? AND part=? AND episode=? LIMIT 1",
            (*key, episode),
        ).fetchone() is None
        cur = conn.execute(
            "INSERT OR IGNORE INTO trajectories(uid, run_id, instance_id, epoch, part, status, episode, created_at, "
            "record, agent_id, reward) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (item.uid, *key, item.status, episode, now, blob, item.agent_id, item.reward),
        )
        if cur.rowcount == 0:
            result.duplicates += 1
            continue
        result.inserted += 1
        result.inserted_by_status[item.status] = result.inserted_by_status.get(item.status, 0) + 1
        conn.execute(
            "INSERT INTO groups(run_id, instance_id, epoch, part, size, n, state) VALUES (?,?,?,?,?,?,'open') "
            "ON CONFLICT DO UPDATE SET n = n + excluded.n",
            (*key, group_size, int(new_episode)),
        )
        touched[key] = None
    # Completion is checked after the whole call so every record of a multi-agent episode is in its group.
    for key in touched:
        n, size, state = conn.execute(
            "SELECT n, size, state FROM groups WHERE run_id=? AND instance_id=? AND epoch=? AND part=?", key
        ).fetchone()
        if state == "open" and n >= size:
            reason, roles = _complete(conn, key, finalize, now)
            result.completed.append((key, reason))
            if roles:
                result.roles[key] = roles
    return result


def _complete(
    conn: sqlite3.Connection, key: GroupKey, finalize: Callable[[list[Record]], GroupOutcome], now: float
) -> tuple[str | None, list[str]]:
    """Finalize a complete group; returns its drop reason (None: ready) and the roles of a ready group."""
    rows = conn.execute(
        "SELECT uid, record FROM trajectories WHERE run_id=? AND instance_id=? AND epoch=? AND part=? "
        "ORDER BY rowid",
        key,
    ).fetchall()
    outcome = finalize([orjson.loads(blob) for _, blob in rows])
    if outcome.reason is not None:
        conn.execute(
            "UPDATE groups SET state='filtered', reason=?, completed_at=? "
            "WHERE run_id=? AND instance_id=? AND epoch=? AND part=?",
            (outcome.reason, now, *key),
        )
        return outcome.reason, []
    by_uid = {r["uid"]: r for r in outcome.records}
    for uid, _ in rows:
        rec = by_uid.get(uid)
        if rec is not None:
            # The role too: a `transform_group` hook may have changed it, and role streams select by it.
            conn.execute("UPDATE trajectories SET record=?, summary=?, agent_id=? WHERE uid=?",
                         (orjson.dumps(rec), _summary(rec), role_of(rec), uid))
    seq = _next_seq(conn)
    conn.execute(
        "UPDATE groups SET state='ready', ready_seq=?, completed_at=?, version_min=?, version_max=? "
        "WHERE run_id=? AND instance_id=? AND epoch=? AND part=?",
        (seq, now, *group_version_range(outcome.records), *key),
    )
    return None, _add_to_role_streams(conn, key, outcome.records, seq)


def _add_to_role_streams(conn: sqlite3.Connection, key: GroupKey, records: list[Record], seq: int) -> list[str]:
    """Make a ready group ready on the stream of each role (`extra_info.agent_id`) it has records of, with the
    role's record count and versions; returns those roles."""
    by_role: dict[str, list[Record]] = {}
    for r in records:
        role = role_of(r)
        if role is not None:
            by_role.setdefault(role, []).append(r)
    for role, members in by_role.items():
        conn.execute(
            "INSERT OR REPLACE INTO stream_groups(stream, run_id, instance_id, epoch, part, records, version_min, "
            "version_max, ready_seq, state) VALUES (?,?,?,?,?,?,?,?,?,'ready')",
            (role, *key, len(members), *group_version_range(members), seq),
        )
    return sorted(by_role)


def role_of(record: Record) -> str | None:
    """A record's role stream: its `extra_info.agent_id` as a string, None without one."""
    role = (record.get("extra_info") or {}).get("agent_id")
    return None if role is None or role == "" else str(role)


def _summary(record: Record) -> bytes:
    info = record.get("extra_info") or {}
    raw = record.get("raw_reward")
    return orjson.dumps([record["reward"], record["reward"] if raw is None else raw, info.get("task_type"),
                         bool(info.get("tokenization_mismatch"))])


def _stored(blob: bytes, summary: bytes | None) -> StoredRecord:
    reward, raw, task_type, mismatch = orjson.loads(summary if summary is not None else _summary(orjson.loads(blob)))
    return StoredRecord(blob, float(reward), float(raw), task_type, bool(mismatch))


def _one_per_instance(rows: Iterable[tuple], max_groups: int | None) -> list[tuple]:
    """The first `max_groups` rows (all when None) whose instance id no earlier row has.

    slime's client (`select_rollout_data`) groups an answer's records by `instance_id` alone, so two groups
    of one instance (two epochs, or two runs) in one answer would become one group of twice the size; the
    later group waits for the next read instead. The cursor is read lazily, so this stops at `max_groups`.
    """
    taken: list[tuple] = []
    seen: set[str] = set()
    for row in rows:
        if max_groups is not None and len(taken) >= max_groups:
            break
        if row[1] not in seen:
            seen.add(row[1])
            taken.append(row)
    return taken


def _drop_stale(
    conn: sqlite3.Connection,
    current: int,
    rule_of: Callable[[sqlite3.Connection, str], tuple[StalenessRule | None, bool]],
) -> list[StaleGroup]:
    stale: list[StaleGroup] = []
    runs = conn.execute("SELECT DISTINCT run_id FROM groups WHERE state='ready' AND version_min < ?",
                        (current,)).fetchall()
    for (run_id,) in runs:
        rule, can_generate = rule_of(conn, run_id)
        if rule is None:
            continue
        rows = conn.execute(
            "SELECT instance_id, epoch, part, version_min, size FROM groups "
            "WHERE run_id=? AND state='ready' AND version_min < ?",
            (run_id, current - rule.max_staleness),
        ).fetchall()
        for instance_id, epoch, part, version_min, size in rows:
            key = (run_id, instance_id, epoch, part)
            conn.execute("UPDATE groups SET state='filtered', reason='stale' "
                         "WHERE run_id=? AND instance_id=? AND epoch=? AND part=?", key)
            new_part = None
            if rule.regenerate and can_generate:
                last = conn.execute("SELECT max(part) FROM groups WHERE run_id=? AND instance_id=? AND epoch=?",
                                    key[:3]).fetchone()[0]
                new_part = last + 1
                # An empty open part: the runner generates it (a restarted one finds it in `stored_work`).
                conn.execute("INSERT INTO groups(run_id, instance_id, epoch, part, size, n, state) "
                             "VALUES (?,?,?,?,?,0,'open')", (*key[:3], new_part, size))
            stale.append(StaleGroup(key, version_min, current - version_min, new_part))
    return stale


def _expire_leases(conn: sqlite3.Connection, now: float) -> dict[str, int]:
    """Leased groups whose lease ran out become ready again; how many, per run."""
    expired: dict[str, int] = {}
    for (run_id,) in conn.execute(
        "UPDATE groups SET state='ready', lease_expires=NULL WHERE state='leased' AND lease_expires <= ? "
        "RETURNING run_id", (now,)
    ).fetchall():
        expired[run_id] = expired.get(run_id, 0) + 1
    if expired:
        log.info("%d leased groups were not acked in time and are deliverable again", sum(expired.values()))
    return expired


def _take(conn: sqlite3.Connection, max_groups: int | None, lease_s: float | None, now: float,
          order: Order = "oldest", stream: str | None = None, run_id: str | None = None) -> Batch:
    """Lease (or deliver) up to `max_groups` ready groups, one per instance: the default stream's (`groups`), or
    with `stream` that role stream's (its `stream_groups` rows, and only that role's records); with `run_id`,
    of that run only."""
    table, where, args = ("groups", "", ()) if stream is None else ("stream_groups", "stream=? AND ", (stream,))
    of_run, run_args = ("run_id=? AND ", (run_id,)) if run_id is not None else ("", ())
    ready = conn.execute(
        f"SELECT run_id, instance_id, epoch, part, batch_id, version_min FROM {table} WHERE {where}{of_run}"
        f"state='ready' ORDER BY {_ORDER_SQL[order]}", (*args, *run_args)
    )
    try:
        rows = _one_per_instance(ready, max_groups)
    finally:
        ready.close()
    batch = Batch(None, [], None)
    if rows:
        batch.batch_id = uuid.uuid4().hex
        expires = now + lease_s if lease_s is not None else None
        state = "leased" if lease_s is not None else "delivered"
        conn.execute(
            "INSERT INTO batches(batch_id, created_at, lease_expires, acked_at, num_groups, stream) "
            "VALUES (?,?,?,?,?,?)",
            (batch.batch_id, now, expires, None if lease_s is not None else now, len(rows), stream),
        )
        for run_id, instance_id, epoch, part, old_batch, version_min in rows:
            batch.redelivered += old_batch is not None
            key = (run_id, instance_id, epoch, part)
            conn.execute(
                f"UPDATE {table} SET state=?, batch_id=?, lease_expires=? "
                f"WHERE {where}run_id=? AND instance_id=? AND epoch=? AND part=?",
                (state, batch.batch_id, expires, *args, *key),
            )
            stored = conn.execute(
                "SELECT record, summary FROM trajectories WHERE run_id=? AND instance_id=? AND epoch=? AND part=? "
                f"{'' if stream is None else 'AND agent_id=? '}ORDER BY rowid",
                (*key, *args),
            ).fetchall()
            batch.groups.append([_stored(blob, summary) for blob, summary in stored])
            batch.run_ids.append(run_id)
            batch.versions.append(version_min)
    batch.next_lease_expiry = conn.execute(
        f"SELECT min(lease_expires) FROM {table} WHERE {where}state='leased'", args
    ).fetchone()[0]
    return batch


# ---- role streams ---------------------------------------------------------------------------------------
# Each role stream delivers, drops and leases its rows of `stream_groups` on its own: neither another role's
# stream nor the default stream (the `groups` table) changes them, and they change neither.


def _expire_stream_leases(conn: sqlite3.Connection, stream: str, now: float) -> dict[str, int]:
    """The stream's leases that ran out make their groups ready for that role again; how many, per run."""
    expired: dict[str, int] = {}
    for (run_id,) in conn.execute(
        "UPDATE stream_groups SET state='ready', lease_expires=NULL WHERE stream=? AND state='leased' AND "
        "lease_expires <= ? RETURNING run_id", (stream, now)
    ).fetchall():
        expired[run_id] = expired.get(run_id, 0) + 1
    if expired:
        log.info("%d leased %s groups were not acked in time and are deliverable again", sum(expired.values()),
                 stream)
    return expired


def _drop_stale_stream(
    conn: sqlite3.Connection,
    stream: str,
    current: int,
    rule_of: Callable[[sqlite3.Connection, str], tuple[StalenessRule | None, bool]],
) -> list[StaleGroup]:
    """Groups whose records of `stream` lag the role's trainer by more than the run's η: dropped for the role."""
    stale: list[StaleGroup] = []
    rows = conn.execute("SELECT run_id, instance_id, epoch, part, version_min FROM stream_groups "
                        "WHERE stream=? AND state='ready' AND version_min < ?", (stream, current)).fetchall()
    rules: dict[str, StalenessRule | None] = {}
    for run_id, instance_id, epoch, part, version_min in rows:
        if run_id not in rules:
            rules[run_id] = rule_of(conn, run_id)[0]
        rule = rules[run_id]
        if rule is None or version_min >= current - rule.max_staleness:
            continue
        key = (run_id, instance_id, epoch, part)
        conn.execute("UPDATE stream_groups SET state='filtered', reason='stale' "
                     "WHERE stream=? AND run_id=? AND instance_id=? AND epoch=? AND part=?", (stream, *key))
        stale.append(StaleGroup(key, version_min, current - version_min, None))
    return stale


@dataclass
class RoleState:
    """One role of a run as stored: its groups by stream state (`ready`, `leased`, `delivered`, `filtered`),
    `groups` (all its ready groups) and `records`, its trainer version, and whether its stream was used."""

    counts: dict[str, int] = field(default_factory=dict)
    version: TrainerVersion = field(default_factory=TrainerVersion)
    active: bool = False


def _role_state(conn: sqlite3.Connection, run_id: str) -> tuple[int, dict[str, RoleState]]:
    """(groups of the run that became ready, every role of the run with its `RoleState`)."""
    roles: dict[str, RoleState] = {}
    for role, base, current in conn.execute(
            "SELECT agent_id, base_version, trainer_version FROM role_versions WHERE run_id=?", (run_id,)):
        roles[role] = RoleState(version=TrainerVersion(base, current), active=True)
    for role, state, n, used in conn.execute(
            "SELECT stream, state, count(*), count(batch_id) FROM stream_groups WHERE run_id=? GROUP BY 1, 2",
            (run_id,)):
        r = roles.setdefault(role, RoleState())
        r.counts[state] = n
        r.counts["groups"] = r.counts.get("groups", 0) + n
        r.active = r.active or state != "ready" or used > 0  # its stream took (or dropped) a group
    for role, n in conn.execute("SELECT agent_id, count(*) FROM trajectories WHERE run_id=? AND agent_id IS NOT NULL "
                                "GROUP BY agent_id", (run_id,)):
        roles.setdefault(role, RoleState()).counts["records"] = n
    ready_total = conn.execute("SELECT count(*) FROM groups WHERE run_id=? AND ready_seq IS NOT NULL",
                               (run_id,)).fetchone()[0]
    return ready_total, roles


def _group_roles(conn: sqlite3.Connection, key: GroupKey) -> dict[str, dict[str, Any]]:
    """One group's roles: each role's records, versions and its stream's state, reason and batch."""
    return {
        role: {"records": n, "state": state, "reason": reason, "batch_id": batch_id, "version_min": vmin,
               "version_max": vmax}
        for role, n, vmin, vmax, state, reason, batch_id in conn.execute(
            "SELECT stream, records, version_min, version_max, state, reason, batch_id FROM stream_groups "
            "WHERE run_id=? AND instance_id=? AND epoch=? AND part=? ORDER BY stream", key)
    }
