"""Read-only, paged queries over the store for the dashboard: runs, trajectories by filter, one trajectory with
its group, the reward distribution of delivered batches, and failures by kind.

They run on a read-only connection of their own, in a thread of their own: in WAL mode a reader never waits
for the writer, and the store thread's group commits never wait for a dashboard. Every list is bounded and
walks an index (`schema`); pages are keyed by rowid (`before`), so the thousandth page costs
what the first does.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson

from rollout_buffer.delivery.record_layout import REWARDED_SQL, REWARDS_JOIN_SQL, with_rewards

T = TypeVar("T")

MAX_PAGE = 200
_LIST_COLUMNS = ("rowid", "uid", "run_id", "instance_id", "epoch", "part", "status", "reward", "agent_id", "created_at")
# The agent's role is the record's role stream (`extra_info.agent_id`); the page calls it `role`.
_LIST_KEYS = tuple("role" if c == "agent_id" else c for c in _LIST_COLUMNS)


@dataclass(frozen=True)
class TrajectoryFilter:
    """What the inspector searches by; None / empty means any."""

    run_id: str | None = None
    uid: str | None = None  # a prefix of the uid
    instance_id: str | None = None
    status: str | None = None
    role: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None

    def where(self) -> tuple[list[str], list[Any]]:
        """SQL conditions (parameterised) and their arguments; ValueError naming the field when status, role or
        a reward bound comes without run_id (they are indexed within a run: across runs they would scan)."""
        if not self.run_id and (self.status or self.role or self.reward_min is not None
                                or self.reward_max is not None):
            raise ValueError("run_id: required to filter by status, role or reward")
        where: list[str] = []
        args: list[Any] = []
        if self.uid:
            # A range over the primary key rather than LIKE, which SQLite cannot serve from the index; the run
            # is then checked per row (`+`: not through its index, which would scan the whole run).
            where.append("uid >= ? AND uid < ?")
            args += [self.uid, self.uid + "\U0010ffff"]
        for column, value in (("+run_id" if self.uid else "run_id", self.run_id), ("instance_id", self.instance_id),
                              ("status", self.status), ("agent_id", self.role)):
            if value:
                where.append(f"{column}=?")
                args.append(value)
        if self.reward_min is not None:
            where.append("reward >= ?")
            args.append(self.reward_min)
        if self.reward_max is not None:
            where.append("reward <= ?")
            args.append(self.reward_max)
        return where, args


class Reader:
    """A read-only connection to the store's database, used from one worker thread."""

    def __init__(self, path: Path):
        self.path = path
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-reader")
        self._conn: sqlite3.Connection | None = None

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
            self._conn.execute("PRAGMA busy_timeout=5000")
        return self._conn

    async def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(self._connection()))

    async def close(self) -> None:
        """Close the connection and stop the worker thread."""

        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        await asyncio.get_running_loop().run_in_executor(self._pool, shut)
        self._pool.shutdown(wait=False)

    async def runs(self, limit: int = 20) -> list[dict[str, Any]]:
        """The newest runs with their persisted progress."""

        def op(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            rows = conn.execute(
                "SELECT run_id, created_at, state, group_size, config, progress, error FROM runs "
                "ORDER BY created_at DESC, rowid DESC LIMIT ?", (min(limit, MAX_PAGE),)).fetchall()
            out = []
            for run_id, created_at, state, group_size, config, progress, error in rows:
                cfg = orjson.loads(config)
                out.append({"run_id": run_id, "created_at": created_at, "state": state, "group_size": group_size,
                            "task_type": cfg.get("task_type"), "tokenizer_path": cfg.get("tokenizer_path"),
                            "progress": orjson.loads(progress) if progress else {}, "error": error})
            return out

        return await self._call(op)

    async def trajectories(self, flt: TrajectoryFilter, before: int | None, limit: int) -> dict[str, Any]:
        """One page of trajectories matching `flt`, newest first, older than rowid `before`; `next` is the
        cursor of the following page (None on the last). ValueError: see `TrajectoryFilter.where`."""
        limit = max(1, min(limit, MAX_PAGE))
        flt.where()  # refuse a filter that cannot use an index before queueing it

        def op(conn: sqlite3.Connection) -> dict[str, Any]:
            where, args = flt.where()
            if before is not None:
                where.append("rowid < ?")
                args.append(before)
            # The page's rowids come from a covering index (only integers are sorted when the index does not
            # give rowid order, as for a reward range); then the page's rows are read by rowid.
            sql = (f"SELECT {', '.join(_LIST_COLUMNS)} FROM trajectories WHERE rowid IN (SELECT rowid FROM "
                   f"trajectories {'WHERE ' + ' AND '.join(where) if where else ''} ORDER BY rowid DESC LIMIT ?) "
                   "ORDER BY rowid DESC")
            rows = [dict(zip(_LIST_KEYS, r, strict=True)) for r in conn.execute(sql, (*args, limit + 1))]
            more = len(rows) > limit
            rows = rows[:limit]
            return {"items": rows, "next": rows[-1]["rowid"] if more else None}

        return await self._call(op)

    async def trajectory(self, uid: str) -> dict[str, Any] | None:
        """One trajectory: its record, its group's key and state, and the run's tokenizer path."""

        def op(conn: sqlite3.Connection) -> dict[str, Any] | None:
            row = conn.execute(
                f"SELECT {REWARDED_SQL}, t.run_id, t.instance_id, t.epoch, t.part, coalesce(s.state, g.state), "
                f"CASE WHEN s.state IS NULL THEN g.reason ELSE s.reason END, r.config, t.pruned_at FROM trajectories t "
                f"{REWARDS_JOIN_SQL} "
                "LEFT JOIN groups g ON g.run_id=t.run_id AND g.instance_id=t.instance_id AND g.epoch=t.epoch "
                "AND g.part=t.part LEFT JOIN stream_groups s ON s.stream='' AND s.run_id=t.run_id AND "
                "s.instance_id=t.instance_id AND s.epoch=t.epoch AND s.part=t.part "
                "LEFT JOIN runs r ON r.run_id=t.run_id WHERE t.uid=?", (uid,)).fetchone()
            if row is None:
                return None
            blob, cut, head, side, run_id, instance_id, epoch, part, state, reason, config, pruned_at = row
            return {"record": orjson.loads(with_rewards(blob, cut, head, side)), "pruned_at": pruned_at,
                    "group": {"run_id": run_id, "instance_id": instance_id, "epoch": epoch, "part": part,
                              "state": state, "reason": reason},
                    "tokenizer_path": orjson.loads(config).get("tokenizer_path") if config else None}

        return await self._call(op)

    async def group(self, run_id: str, instance_id: str, epoch: int, part: int) -> list[dict[str, Any]]:
        """The members of one group: raw and normalized rewards, status and, for agent sessions, the branch
        tree (branch, parent, the turn it forked at)."""

        def op(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            # A long record's facts hold what is shown here, and begin as its JSON does (`record_layout`).
            rows = conn.execute(
                "SELECT t.uid, t.status, coalesce(t.facts, t.record), w.cut, w.head FROM trajectories t "
                f"{REWARDS_JOIN_SQL} WHERE t.run_id=? AND t.instance_id=? AND t.epoch=? AND t.part=? ORDER BY t.rowid",
                (run_id, instance_id, epoch, part)).fetchall()
            out = []
            for uid, status, blob, cut, head in rows:
                rec = orjson.loads(with_rewards(blob, cut, head))
                info = rec.get("extra_info") or {}
                raw = rec.get("raw_reward")
                out.append({
                    "uid": uid, "status": status, "reward": rec.get("reward"),
                    "raw_reward": rec.get("reward") if raw is None else raw, "normalized": raw is not None,
                    **{k: info.get(k) for k in ("session_id", "branch", "parent_branch", "fork_turn",
                                                "branch_turns", "role", "agent_id")},
                })
            return out

        return await self._call(op)

    async def batches(self, run_id: str | None, limit: int = 12) -> list[dict[str, Any]]:
        """The newest delivered batches with the raw and normalized rewards of their records."""
        limit = max(1, min(limit, 50))

        def op(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            out = []
            for batch_id, created_at, num_groups, acked_at in conn.execute(
                "SELECT batch_id, created_at, num_groups, acked_at FROM batches ORDER BY rowid DESC LIMIT ?",
                (limit * 4 if run_id else limit,),
            ).fetchall():
                rows = conn.execute(
                    "SELECT t.run_id, t.reward, coalesce(w.summary, t.summary) FROM stream_groups s JOIN "
                    "trajectories t ON t.run_id=s.run_id AND t.instance_id=s.instance_id AND t.epoch=s.epoch AND "
                    f"t.part=s.part {REWARDS_JOIN_SQL} WHERE s.batch_id=? AND (s.stream='' OR t.agent_id=s.stream)",
                    (batch_id,)).fetchall()
                if run_id and not any(r[0] == run_id for r in rows):
                    continue
                raw, normalized = [], []
                for _, reward, summary in rows:
                    if summary is not None:
                        s = orjson.loads(summary)
                        normalized.append(s[0])
                        raw.append(s[1])
                    elif reward is not None:
                        raw.append(reward)
                out.append({"batch_id": batch_id, "created_at": created_at, "num_groups": num_groups,
                            "acked": acked_at is not None, "raw": raw, "normalized": normalized})
                if len(out) >= limit:
                    break
            return out

        return await self._call(op)

    async def failures(self, run_id: str) -> dict[str, int]:
        """Failed trajectories of a run by `extra_info.error_kind` (few: the status index finds them)."""

        def op(conn: sqlite3.Connection) -> dict[str, int]:
            rows = conn.execute(
                "SELECT json_extract(CAST(record AS TEXT), '$.extra_info.error_kind'), count(*) FROM trajectories "
                "WHERE run_id=? AND status='failed' GROUP BY 1", (run_id,)).fetchall()
            return {kind or "unknown": n for kind, n in rows}

        return await self._call(op)

    async def latest_rowid(self) -> int:
        """The rowid of the newest stored trajectory (0 when none): the inspector shows when newer ones exist."""
        return await self._call(lambda c: c.execute("SELECT coalesce(max(rowid), 0) FROM trajectories").fetchone()[0])
