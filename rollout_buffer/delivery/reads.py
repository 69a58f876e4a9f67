"""Counts and inspection on the store thread: groups by state, trajectories by status, dropped groups by reason,
and groups listed with their streams. (The dashboard's paged queries run on a connection of their own:
`queries`.)

A group's state as the API shows it is its own until it becomes ready (`open`, `complete`, `filtered` by its
group policy), then the default stream's (`ready`, `leased`, `delivered`, or `filtered` as stale).
"""

from __future__ import annotations

import sqlite3
from typing import Any

from rollout_buffer.delivery.store import Store
from rollout_buffer.delivery.streams import group_streams

# A group joined to its row on the default stream ("": present once the group is ready).
_WITH_DEFAULT_STREAM = (
    "groups g LEFT JOIN stream_groups s ON s.stream='' AND s.run_id=g.run_id AND s.instance_id=g.instance_id "
    "AND s.epoch=g.epoch AND s.part=g.part"
)
_STATE = "CASE WHEN s.state IS NULL THEN g.state ELSE s.state END"
_REASON = "CASE WHEN s.state IS NULL THEN g.reason ELSE s.reason END"


class Reads:
    """Counts and group listings of a store."""

    def __init__(self, store: Store):
        self.store = store

    async def group_counts(self, run_id: str | None = None) -> dict[str, int]:
        """Groups by state (one run, or all)."""
        where, args = ("WHERE g.run_id=?", (run_id,)) if run_id is not None else ("", ())
        return await self.store.call(lambda c: dict(c.execute(
            f"SELECT {_STATE}, count(*) FROM {_WITH_DEFAULT_STREAM} {where} GROUP BY 1", args).fetchall()))

    async def filter_counts(self, run_id: str | None = None) -> dict[str, int]:
        """Dropped groups by reason: by their group policy, or as stale on the default stream."""
        where, args = ("AND g.run_id=?", (run_id,)) if run_id is not None else ("", ())
        return await self.store.call(lambda c: dict(c.execute(
            f"SELECT {_REASON}, count(*) FROM {_WITH_DEFAULT_STREAM} WHERE {_STATE}='filtered' {where} GROUP BY 1",
            args).fetchall()))

    async def record_counts(self, run_id: str | None = None) -> dict[str, int]:
        """Trajectories by status."""
        where, args = ("WHERE run_id=?", (run_id,)) if run_id is not None else ("", ())
        return await self.store.call(lambda c: dict(c.execute(
            f"SELECT status, count(*) FROM trajectories {where} GROUP BY status", args).fetchall()))

    async def undelivered_by_run(self, but: str) -> dict[str, int]:
        """Groups ready or leased on the default stream of every run but `but`: what earlier runs left
        (fetchable by naming the run)."""
        return dict(await self.store.call(lambda c: c.execute(
            "SELECT run_id, count(*) FROM stream_groups WHERE stream='' AND state IN ('ready','leased') "
            "AND run_id<>? GROUP BY run_id", (but,)).fetchall()))

    async def list_groups(self, state: str | None, run_id: str | None, limit: int) -> list[dict[str, Any]]:
        """Groups for inspection, newest first, with the uids of their trajectories and their role streams."""

        def op(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            where, args = [], []
            for column, value in ((_STATE, state), ("g.run_id", run_id)):
                if value is not None:
                    where.append(f"{column}=?")
                    args.append(value)
            rows = conn.execute(
                f"SELECT g.run_id, g.instance_id, g.epoch, g.part, {_STATE}, {_REASON}, g.n, g.size, s.batch_id, "
                "s.lease_expires, g.completed_at, (SELECT group_concat(t.uid, ' ') FROM trajectories t WHERE "
                "t.run_id=g.run_id AND t.instance_id=g.instance_id AND t.epoch=g.epoch AND t.part=g.part) "
                f"FROM {_WITH_DEFAULT_STREAM} {'WHERE ' + ' AND '.join(where) if where else ''} "
                "ORDER BY g.rowid DESC LIMIT ?",
                (*args, limit),
            ).fetchall()
            keys = ("run_id", "instance_id", "epoch", "part", "state", "reason", "episodes", "size", "batch_id",
                    "lease_expires", "completed_at")
            out = [{**dict(zip(keys, r[:-1], strict=True)), "uids": (r[-1] or "").split()} for r in rows]
            for group in out:
                streams = group_streams(conn, (group["run_id"], group["instance_id"], group["epoch"], group["part"]))
                streams.pop("", None)
                group["roles"] = streams
            return out

        return await self.store.call(op)
