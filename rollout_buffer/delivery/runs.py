"""Runs as stored: one row each (its config, state, progress snapshot, admission state), and what a resumed
run already has."""

from __future__ import annotations

import sqlite3
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from rollout_buffer.delivery.store import Store
from rollout_buffer.policy import redacted


@dataclass(frozen=True)
class StoredRun:
    """A run as stored: its id, config (the start payload), group size, state and last progress snapshot."""

    run_id: str
    created_at: float
    state: str  # running | finished | failed | replaced
    group_size: int
    config: dict[str, Any]
    progress: dict[str, Any]
    error: str | None

    def public(self) -> dict[str, Any]:
        """The run as `/status` shows it."""
        cfg = self.config
        return {"run_id": self.run_id, "state": self.state, "created_at": self.created_at,
                "task_type": cfg.get("task_type"), "input_file": cfg.get("input_file"),
                "num_repeat_per_sample": self.group_size, "num_epoch": cfg.get("num_epoch"), "config": redacted(cfg),
                "progress": self.progress, "error": self.error}


@dataclass
class StoredWork:
    """What a (resumed) run already has in the store."""

    done: set[tuple[str, int]]  # (instance_id, epoch) with no open part left
    open: dict[tuple[str, int], tuple[int, set[str]]]  # (instance_id, epoch) → (open part, episode uids in it)


_COLUMNS = "run_id, created_at, state, group_size, config, progress, error"
# A `runs` row, as `_COLUMNS` selects it (config and progress: JSON blobs).
_RunRow = tuple[str, float, str, int, bytes, bytes | None, str | None]


def _run(row: _RunRow) -> StoredRun:
    run_id, created_at, state, group_size, config, progress, error = row
    return StoredRun(run_id, created_at, state, group_size, orjson.loads(config),
               orjson.loads(progress) if progress else {}, error)


def latest_run(conn: sqlite3.Connection) -> StoredRun | None:
    """The newest run (store thread)."""
    row = conn.execute(f"SELECT {_COLUMNS} FROM runs ORDER BY created_at DESC, rowid DESC LIMIT 1").fetchone()
    return _run(row) if row else None


class Runs:
    """The runs of a store."""

    def __init__(self, store: Store):
        self.store = store

    async def create(self, config: dict[str, Any], group_size: int, run_id: str | None = None) -> str:
        """Start a new run; the running one (if any) becomes `replaced`. Its finished groups stay."""
        rid = run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"

        def op(conn: sqlite3.Connection) -> str:
            conn.execute("UPDATE runs SET state='replaced' WHERE state='running'")
            conn.execute(
                "INSERT INTO runs(run_id, created_at, state, group_size, config) VALUES (?,?,?,?,?)",
                (rid, time.time(), "running", group_size, orjson.dumps(config)),
            )
            return rid

        return await self.store.call(op)

    async def latest(self) -> StoredRun | None:
        """The newest run (the active one while it runs), or None."""
        return await self.store.call(latest_run)

    async def get(self, run_id: str) -> StoredRun | None:
        """One run by id."""

        def op(conn: sqlite3.Connection) -> StoredRun | None:
            row = conn.execute(f"SELECT {_COLUMNS} FROM runs WHERE run_id=?", (run_id,)).fetchone()
            return _run(row) if row else None

        return await self.store.call(op)

    async def set_state(self, run_id: str, state: str, error: str | None = None) -> None:
        """Mark a run finished / failed (a replaced run keeps its state)."""
        await self.store.call(lambda c: c.execute(
            "UPDATE runs SET state=?, error=? WHERE run_id=? AND state='running'", (state, error, run_id)))

    async def set_progress(self, run_id: str, progress: dict[str, Any]) -> None:
        """Persist a progress snapshot so /status survives restarts."""
        blob = orjson.dumps(progress)
        await self.store.call(lambda c: c.execute("UPDATE runs SET progress=? WHERE run_id=?", (blob, run_id)))

    async def reopen(self, run_id: str) -> bool:
        """Mark a finished run running again (it has groups to generate anew); False when it is not the
        latest run or not finished."""

        def op(conn: sqlite3.Connection) -> bool:
            latest = latest_run(conn)
            if latest is None or latest.run_id != run_id:
                return False
            return conn.execute("UPDATE runs SET state='running', error=NULL WHERE run_id=? AND state='finished'",
                                (run_id,)).rowcount == 1

        return await self.store.call(op)

    async def set_admission(self, run_id: str, state: str) -> None:
        """Persist the runner's admission state, so a restarted buffer shows (and resumes) it."""
        await self.store.call(lambda c: c.execute(
            "INSERT INTO run_control(run_id, admission, updated_at) VALUES (?,?,?) "
            "ON CONFLICT(run_id) DO UPDATE SET admission=excluded.admission, updated_at=excluded.updated_at",
            (run_id, state, time.time()),
        ))

    async def admission(self, run_id: str) -> str | None:
        """The admission state last persisted for the run."""
        row = await self.store.call(
            lambda c: c.execute("SELECT admission FROM run_control WHERE run_id=?", (run_id,)).fetchone())
        return row[0] if row else None

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

        return await self.store.call(op)
