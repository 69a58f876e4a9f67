"""The store's tables and their numbered migrations.

`PRAGMA user_version` holds the number of the last migration a store went through; opening a store runs the
ones after it, each in a transaction of its own, so a store of any released format opens in today's. A store
from before numbered migrations (0.1.0) reads as version 0 with its tables present: migration 1 is that
format, created where missing.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

from rollout_buffer.delivery.record_images import backfill

log = logging.getLogger(__name__)

# Release 0.1.0's tables. Delivery state lived in two places then: `groups.state` for the default stream and
# `stream_groups` for role streams; migration 2 makes the default stream a row of `stream_groups` like any role.
_RELEASE_0_1 = """
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
    record BLOB NOT NULL,
    summary BLOB,
    agent_id TEXT,
    reward REAL
);
CREATE INDEX IF NOT EXISTS trajectories_group ON trajectories(run_id, instance_id, epoch, part);
CREATE TABLE IF NOT EXISTS groups (
    run_id TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    part INTEGER NOT NULL,
    size INTEGER NOT NULL,
    n INTEGER NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    ready_seq INTEGER,
    batch_id TEXT,
    lease_expires REAL,
    completed_at REAL,
    version_min INTEGER,
    version_max INTEGER,
    PRIMARY KEY (run_id, instance_id, epoch, part)
);
CREATE INDEX IF NOT EXISTS groups_ready ON groups(state, ready_seq);
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    lease_expires REAL,
    acked_at REAL,
    num_groups INTEGER NOT NULL,
    stream TEXT
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS stream_groups (
    stream TEXT NOT NULL,
    run_id TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    part INTEGER NOT NULL,
    records INTEGER NOT NULL,
    version_min INTEGER,
    version_max INTEGER,
    ready_seq INTEGER NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    batch_id TEXT,
    lease_expires REAL,
    PRIMARY KEY (stream, run_id, instance_id, epoch, part)
);
CREATE INDEX IF NOT EXISTS stream_groups_ready ON stream_groups(stream, state, ready_seq);
CREATE INDEX IF NOT EXISTS stream_groups_group ON stream_groups(run_id, instance_id, epoch, part);
CREATE INDEX IF NOT EXISTS stream_groups_batch ON stream_groups(batch_id);
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
    base_version INTEGER,
    trainer_version INTEGER,
    admission TEXT,
    updated_at REAL
);
CREATE TABLE IF NOT EXISTS evals (
    dataset TEXT NOT NULL,
    version INTEGER NOT NULL,
    state TEXT NOT NULL,
    n_samples INTEGER NOT NULL,
    num_items INTEGER NOT NULL,
    config BLOB NOT NULL,
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
    position INTEGER NOT NULL,
    status TEXT NOT NULL,
    reward REAL NOT NULL,
    response_length INTEGER,
    created_at REAL NOT NULL,
    records BLOB NOT NULL,
    PRIMARY KEY (dataset, version, instance_id, sample)
);
CREATE INDEX IF NOT EXISTS trajectories_run ON trajectories(run_id);
CREATE INDEX IF NOT EXISTS trajectories_run_status ON trajectories(run_id, status);
CREATE INDEX IF NOT EXISTS trajectories_run_reward ON trajectories(run_id, reward, status, agent_id);
CREATE INDEX IF NOT EXISTS trajectories_run_role ON trajectories(run_id, agent_id, status) WHERE agent_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS trajectories_instance ON trajectories(instance_id);
CREATE INDEX IF NOT EXISTS groups_batch ON groups(batch_id) WHERE batch_id IS NOT NULL;
"""

# One delivery model: every stream (the default one, named "", and each role) keeps its state of a ready group
# in `stream_groups`, and every stream's trainer version in `stream_versions`. `groups` keeps what is the
# group's own: open → complete (its group policy runs, outside any transaction) → ready | filtered.
_STREAMS = """
INSERT INTO stream_groups(stream, run_id, instance_id, epoch, part, records, version_min, version_max, ready_seq,
                          state, reason, batch_id, lease_expires)
SELECT '', g.run_id, g.instance_id, g.epoch, g.part,
       (SELECT count(*) FROM trajectories t WHERE t.run_id=g.run_id AND t.instance_id=g.instance_id
        AND t.epoch=g.epoch AND t.part=g.part),
       g.version_min, g.version_max, g.ready_seq, g.state, g.reason, g.batch_id, g.lease_expires
FROM groups g WHERE g.ready_seq IS NOT NULL;
-- A group that became ready keeps 'ready' whatever its streams did with it (a stale drop was its stream's).
UPDATE groups SET state='ready', reason=NULL WHERE ready_seq IS NOT NULL;
DROP INDEX IF EXISTS groups_batch;
ALTER TABLE groups DROP COLUMN batch_id;
ALTER TABLE groups DROP COLUMN lease_expires;
UPDATE batches SET stream='' WHERE stream IS NULL;
CREATE TABLE stream_versions (
    run_id TEXT NOT NULL,
    stream TEXT NOT NULL,
    base_version INTEGER,         -- the trainer's version when the run began (the first one it heard of)
    trainer_version INTEGER,      -- the newest version the trainer reported
    updated_at REAL,
    PRIMARY KEY (run_id, stream)
);
INSERT INTO stream_versions SELECT run_id, '', base_version, trainer_version, updated_at FROM run_control
    WHERE base_version IS NOT NULL OR trainer_version IS NOT NULL;
INSERT INTO stream_versions SELECT run_id, agent_id, base_version, trainer_version, updated_at FROM role_versions;
DROP TABLE role_versions;
ALTER TABLE run_control DROP COLUMN base_version;
ALTER TABLE run_control DROP COLUMN trainer_version;
-- The journal of open agent sessions lives in files (`proxy.session_files`); these tables held it for a day.
DROP TABLE IF EXISTS agent_session_turns;
DROP TABLE IF EXISTS agent_sessions;
"""

# A long record's JSON is written once (`record_layout`): beside it, its facts (what the built-in group policy
# reads of it), and, once its group completed from them, what the group decided (`record_rewards`: the JSON's
# new beginning, replacing its first `cut` bytes, and its summary). Rows stored before have no facts, and their
# groups rewrite them whole, as user hooks do.
_FACTS = """
ALTER TABLE trajectories ADD COLUMN facts BLOB;
CREATE TABLE record_rewards (
    uid TEXT PRIMARY KEY,
    cut INTEGER NOT NULL,
    head BLOB NOT NULL,
    summary BLOB NOT NULL
);
"""

# Retention (`retention`): a long record of a delivered group, past its time, is cut down to its facts; when.
# (65536: `encoded.FACTS_FROM_BYTES`, what makes a record long.)
_PRUNED = """
ALTER TABLE trajectories ADD COLUMN pruned_at REAL;
CREATE INDEX trajectories_prunable ON trajectories(created_at) WHERE pruned_at IS NULL AND length(record) >= 65536;
"""

# A record's per-token side data (`side_data`: routed experts, top-p kept ids) as bytes beside its JSON; those
# with some are kept to retention too, however short their JSON.
_SIDE = """
ALTER TABLE trajectories ADD COLUMN side BLOB;
CREATE INDEX trajectories_prunable_side ON trajectories(created_at) WHERE pruned_at IS NULL AND side IS NOT NULL;
"""

# The images each record holds whole (`record_images`), for retention to know which image files are still needed;
# a store from before has its records' rows made.
_IMAGES = """
CREATE TABLE record_images (
    uid TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    PRIMARY KEY (sha256, uid)
) WITHOUT ROWID;
CREATE INDEX record_images_of ON record_images(uid);
"""

Migration = Callable[[sqlite3.Connection], None]


def _script(sql: str) -> Migration:
    def run(conn: sqlite3.Connection) -> None:
        for statement in _statements(sql):
            conn.execute(statement)

    return run


def _then(first: Migration, second: Migration) -> Migration:
    def run(conn: sqlite3.Connection) -> None:
        first(conn)
        second(conn)

    return run


def _statements(sql: str) -> list[str]:
    """The statements of a script (executescript would commit the migration's transaction)."""
    out, pending = [], ""
    for line in sql.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            out.append(pending.strip())
            pending = ""
    return [s for s in out if s]


# Migration k (1-based) brings a store at version k-1 to version k. Append only: a released store may be at any.
MIGRATIONS: tuple[Migration, ...] = (_script(_RELEASE_0_1), _script(_STREAMS), _script(_FACTS),
                                   _script(_PRUNED), _script(_SIDE), _then(_script(_IMAGES), backfill))
VERSION = len(MIGRATIONS)


class StoreTooNew(RuntimeError):
    """The store was written by a newer release than this one."""


class NotAStore(RuntimeError):
    """The file at the store's path is not a rollout-buffer store: empty, or another program's database."""


def migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Bring the store to `VERSION`, one migration per transaction."""
    current = conn.execute("PRAGMA user_version").fetchone()[0]
    if current > VERSION:
        raise StoreTooNew(f"{path} is at store version {current}; this release reads up to {VERSION}: upgrade "
                          "rollout-buffer to open it")
    for number in range(current + 1, VERSION + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            MIGRATIONS[number - 1](conn)
            conn.execute(f"PRAGMA user_version={number}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if current:
            log.info("store %s upgraded to version %d", path, number)


def connect(path: Path, max_bytes: int | None = None) -> sqlite3.Connection:
    """The store's connection (autocommit; WAL), migrated to today's format. A new store is made under another name
    and renamed into place once it holds its tables, so an empty file at `path` is never the buffer's own: it is
    refused (`NotAStore`), as is another program's database. The store's files are its owner's alone (0600)."""
    if not path.exists():
        _create(path)
    if path.stat().st_size == 0:
        raise NotAStore(f"{path} is an empty file (0 bytes), not a rollout-buffer store: the buffer never leaves "
                        "one; move it away to start a new store there, or restore the store from a copy")
    conn = _open(path)
    try:
        migrate(conn, path)
    except BaseException:
        conn.close()
        raise
    if max_bytes is not None:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count={max(1, max_bytes // page_size)}")
    for suffix in ("", "-wal", "-shm"):  # SQLite gives its side files the main file's mode
        file = path.with_name(path.name + suffix)
        if file.exists():
            file.chmod(0o600)
    return conn


def _create(path: Path) -> None:
    fresh = path.with_name(path.name + ".new")
    for stale in (fresh, fresh.with_name(fresh.name + "-wal"), fresh.with_name(fresh.name + "-shm")):
        stale.unlink(missing_ok=True)  # a creation cut short
    os.close(os.open(fresh, os.O_CREAT | os.O_WRONLY, 0o600))
    conn = _open(fresh)
    try:
        migrate(conn, fresh)
    finally:
        conn.close()  # the last connection checkpoints the WAL into the file and removes it
    os.replace(fresh, path)


def _open(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:  # before anything is written to it: another program's database is left as it was
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if conn.execute("PRAGMA user_version").fetchone()[0] == 0 and tables and "runs" not in tables:
            raise NotAStore(f"{path} is another program's SQLite database (tables "
                            f"{', '.join(sorted(tables)[:5])}), not a rollout-buffer store: give the server another "
                            "--data-dir")
    except BaseException:
        conn.close()
        raise
    conn.execute("PRAGMA journal_mode=WAL")
    # NORMAL in WAL mode survives a killed process; only power loss can drop the last commits.
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=5000")
    return conn
