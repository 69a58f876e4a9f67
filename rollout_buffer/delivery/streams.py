"""Streams: what one trainer consumes. The default stream (named "") holds every ready group whole; a role's
stream (`extra_info.agent_id`, as slime's multi-agent and the role protocol name it) holds each ready group
with records of that role, and only those records.

Every stream keeps its own state of a group in `stream_groups` (ready | leased | delivered | filtered), its own
leases, batches, stale drops and trainer version (`stream_versions`): one code path serves them all, and no
stream changes another's rows.
"""

from __future__ import annotations

import logging
import sqlite3
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from rollout_buffer.delivery.groups import GROUP_KEY_SQL as _KEY
from rollout_buffer.delivery.groups import GroupKey, Record
from rollout_buffer.delivery.record_layout import REWARDED_SQL, REWARDS_JOIN_SQL, with_rewards
from rollout_buffer.delivery.store import Store
from rollout_buffer.delivery.versions import StalenessRule, TrainerVersion, group_version_range

log = logging.getLogger(__name__)

DEFAULT_STREAM = ""  # every ready group, whole; a role is never "" (`role_of`)
Order = Literal["oldest", "newest"]
# Delivery order: by completion, oldest or most recent first.
_ORDER_SQL = {"oldest": "ready_seq", "newest": "ready_seq DESC"}


def role_of(record: Record) -> str | None:
    """A record's role stream: its `extra_info.agent_id` as a string, None without one."""
    role = (record.get("extra_info") or {}).get("agent_id")
    return None if role is None or role == "" else str(role)


def stream_name(stream: str) -> str:
    """How logs and errors name a stream."""
    return "the default stream (no agent_id)" if stream == DEFAULT_STREAM else f"agent_id {stream!r}"


class StreamMismatch(ValueError):
    """An ack names a batch that was delivered to another stream than the one the ack names."""

    def __init__(self, batch_id: str, owner: str, stream: str):
        super().__init__(f"agent_id: batch {batch_id!r} was delivered to {stream_name(owner)}, "
                         f"not to {stream_name(stream)}")


def summarize(record: Record) -> bytes:
    """What delivery reads of a ready record (kept beside its JSON, which is sent on without parsing)."""
    info = record.get("extra_info") or {}
    raw = record.get("raw_reward")
    return orjson.dumps([record["reward"], record["reward"] if raw is None else raw, info.get("task_type"),
                         bool(info.get("tokenization_mismatch"))])


@dataclass
class StoredRecord:
    """A delivered record as stored (its JSON, sent on without parsing) and the fields delivery summarises."""

    blob: bytes
    reward: float
    raw_reward: float
    task_type: str | None
    tokenization_mismatch: bool

    @classmethod
    def of(cls, blob: bytes, summary: bytes) -> StoredRecord:
        """A stored record from its JSON and its `summarize`d fields."""
        reward, raw, task_type, mismatch = orjson.loads(summary)
        return cls(blob, float(reward), float(raw), task_type, bool(mismatch))

    def load(self) -> Record:
        """The record as a dict."""
        record: Record = orjson.loads(self.blob)
        return record


@dataclass(frozen=True)
class StaleGroup:
    """A ready group dropped from a stream because its oldest turn lagged the stream's trainer by more than η."""

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


@dataclass
class StreamState:
    """One stream of a run as stored: its groups by state (`ready`, `leased`, `delivered`, `filtered`), how
    many ready groups it holds at all, its trainer version, and whether a consumer used it."""

    counts: dict[str, int] = field(default_factory=dict)
    groups: int = 0
    version: TrainerVersion = field(default_factory=TrainerVersion)
    active: bool = False


@dataclass
class RunStreams:
    """A run's streams as stored, with the run's groups the group policy dropped and those that became ready."""

    streams: dict[str, StreamState]
    dropped_at_completion: int
    ready_total: int
    records_by_role: dict[str, int]


def admit(conn: sqlite3.Connection, key: GroupKey, records: list[Record], seq: int) -> list[str]:
    """Make a ready group ready on the default stream (whole) and on the stream of each role it has records
    of (those records); returns the roles."""
    by_stream: dict[str, list[Record]] = {DEFAULT_STREAM: records}
    for r in records:
        role = role_of(r)
        if role is not None:
            by_stream.setdefault(role, []).append(r)
    for stream, members in by_stream.items():
        conn.execute(
            "INSERT OR REPLACE INTO stream_groups(stream, run_id, instance_id, epoch, part, records, version_min, "
            "version_max, ready_seq, state) VALUES (?,?,?,?,?,?,?,?,?,'ready')",
            (stream, *key, len(members), *group_version_range(members), seq),
        )
    return sorted(s for s in by_stream if s != DEFAULT_STREAM)


def _expire_leases(conn: sqlite3.Connection, stream: str, now: float) -> dict[str, int]:
    """The stream's leases that ran out make their groups ready on it again; how many, per run."""
    expired: dict[str, int] = {}
    for (run_id,) in conn.execute(
        "UPDATE stream_groups SET state='ready', lease_expires=NULL WHERE stream=? AND state='leased' AND "
        "lease_expires <= ? RETURNING run_id", (stream, now)
    ).fetchall():
        expired[run_id] = expired.get(run_id, 0) + 1
    if expired:
        log.info("%d leased groups of %s were not acked in time and are deliverable again", sum(expired.values()),
                 stream_name(stream))
    return expired


def _staleness_rule(conn: sqlite3.Connection, run_id: str) -> tuple[StalenessRule | None, bool]:
    """(the run's staleness rule, whether the run can still generate)."""
    row = conn.execute("SELECT config, state FROM runs WHERE run_id=?", (run_id,)).fetchone()
    if row is None:
        return None, False
    cfg = orjson.loads(row[0])
    return StalenessRule.of_run(cfg), row[1] in ("running", "finished") and bool(cfg.get("task_type"))


def _drop_stale(conn: sqlite3.Connection, stream: str, current: int) -> list[StaleGroup]:
    """Ready groups whose records on `stream` lag its trainer (`current`) by more than their run's η: dropped
    from the stream. On the default stream, a run that asked for `regenerate_stale` (and can still generate)
    gets each again as a new open part of the group."""
    stale: list[StaleGroup] = []
    rules: dict[str, tuple[StalenessRule | None, bool]] = {}
    rows = conn.execute("SELECT run_id, instance_id, epoch, part, version_min FROM stream_groups "
                        "WHERE stream=? AND state='ready' AND version_min < ?", (stream, current)).fetchall()
    for run_id, instance_id, epoch, part, version_min in rows:
        if run_id not in rules:
            rules[run_id] = _staleness_rule(conn, run_id)
        rule, can_generate = rules[run_id]
        if rule is None or version_min >= current - rule.max_staleness:
            continue
        key = (run_id, instance_id, epoch, part)
        conn.execute(f"UPDATE stream_groups SET state='filtered', reason='stale' WHERE stream=? AND {_KEY}",
                     (stream, *key))
        new_part = None
        if stream == DEFAULT_STREAM and rule.regenerate and can_generate:
            last, size = conn.execute("SELECT max(part), max(size) FROM groups WHERE run_id=? AND instance_id=? "
                                      "AND epoch=?", key[:3]).fetchone()
            new_part = last + 1
            # An empty open part: the runner generates it (a restarted one finds it in `stored_work`).
            conn.execute("INSERT INTO groups(run_id, instance_id, epoch, part, size, n, state) "
                         "VALUES (?,?,?,?,?,0,'open')", (*key[:3], new_part, size))
        stale.append(StaleGroup(key, version_min, current - version_min, new_part))
    return stale


# A ready group's row in `_take`: run_id, instance_id, epoch, part, batch_id (of an earlier lease), version_min.
_ReadyRow = tuple[str, str, int, int, str | None, int | None]


def _one_per_instance(rows: Iterable[_ReadyRow], max_groups: int | None) -> list[_ReadyRow]:
    """The first `max_groups` rows (all when None) whose instance id no earlier row has.

    slime's client (`select_rollout_data`) groups an answer's records by `instance_id` alone, so two groups
    of one instance (two epochs, or two runs) in one answer would become one group of twice the size; the
    later group waits for the next read instead. The cursor is read lazily, so this stops at `max_groups`.
    """
    taken: list[_ReadyRow] = []
    seen: set[str] = set()
    for row in rows:
        if max_groups is not None and len(taken) >= max_groups:
            break
        if row[1] not in seen:
            seen.add(row[1])
            taken.append(row)
    return taken


def _take(conn: sqlite3.Connection, stream: str, max_groups: int | None, lease_s: float | None, now: float,
          order: Order, run_id: str | None) -> Batch:
    """Lease (or deliver) up to `max_groups` of the stream's ready groups, one per instance; with `run_id`, of
    that run only."""
    of_run, run_args = ("run_id=? AND ", (run_id,)) if run_id is not None else ("", ())
    ready = conn.execute(
        f"SELECT run_id, instance_id, epoch, part, batch_id, version_min FROM stream_groups WHERE stream=? AND "
        f"{of_run}state='ready' ORDER BY {_ORDER_SQL[order]}", (stream, *run_args))
    try:
        rows = _one_per_instance(ready, max_groups)
    finally:
        ready.close()
    batch = Batch(None, [], None)
    if rows:
        batch.batch_id = uuid.uuid4().hex
        expires = now + lease_s if lease_s is not None else None
        state = "leased" if lease_s is not None else "delivered"
        conn.execute("INSERT INTO batches(batch_id, created_at, lease_expires, acked_at, num_groups, stream) "
                     "VALUES (?,?,?,?,?,?)",
                     (batch.batch_id, now, expires, None if lease_s is not None else now, len(rows), stream))
        of_role, role_args = ("", ()) if stream == DEFAULT_STREAM else ("AND t.agent_id=? ", (stream,))
        for group_run, instance_id, epoch, part, old_batch, version_min in rows:
            batch.redelivered += old_batch is not None
            key = (group_run, instance_id, epoch, part)
            conn.execute(f"UPDATE stream_groups SET state=?, batch_id=?, lease_expires=? WHERE stream=? AND {_KEY}",
                         (state, batch.batch_id, expires, stream, *key))
            stored = conn.execute(
                f"SELECT {REWARDED_SQL}, coalesce(w.summary, t.summary) FROM trajectories t {REWARDS_JOIN_SQL} "
                f"WHERE {_KEY} {of_role}ORDER BY t.rowid", (*key, *role_args)).fetchall()
            batch.groups.append([StoredRecord.of(with_rewards(blob, cut, head, side), summary)
                                 for blob, cut, head, side, summary in stored])
            batch.run_ids.append(group_run)
            batch.versions.append(version_min)
    batch.next_lease_expiry = conn.execute(
        "SELECT min(lease_expires) FROM stream_groups WHERE stream=? AND state='leased'", (stream,)).fetchone()[0]
    return batch


def group_streams(conn: sqlite3.Connection, key: GroupKey) -> dict[str, dict[str, Any]]:
    """One group on each stream: its records there, versions, state, reason and batch."""
    return {
        stream: {"records": n, "state": state, "reason": reason, "batch_id": batch_id, "version_min": vmin,
                 "version_max": vmax}
        for stream, n, vmin, vmax, state, reason, batch_id in conn.execute(
            f"SELECT stream, records, version_min, version_max, state, reason, batch_id FROM stream_groups "
            f"WHERE {_KEY} ORDER BY stream", key)
    }


def _run_streams(conn: sqlite3.Connection, run_id: str) -> RunStreams:
    streams: dict[str, StreamState] = {DEFAULT_STREAM: StreamState()}
    for stream, base, current in conn.execute(
            "SELECT stream, base_version, trainer_version FROM stream_versions WHERE run_id=?", (run_id,)):
        streams[stream] = StreamState(version=TrainerVersion(base, current), active=True)
    for stream, state, n, used in conn.execute(
            "SELECT stream, state, count(*), count(batch_id) FROM stream_groups WHERE run_id=? GROUP BY 1, 2",
            (run_id,)):
        s = streams.setdefault(stream, StreamState())
        s.counts[state] = n
        s.groups += n
        s.active = s.active or state != "ready" or used > 0  # its stream took (or dropped) a group
    dropped = conn.execute("SELECT count(*) FROM groups WHERE run_id=? AND state='filtered'", (run_id,)).fetchone()[0]
    records = dict(conn.execute("SELECT agent_id, count(*) FROM trajectories WHERE run_id=? AND agent_id IS NOT NULL "
                                "GROUP BY agent_id", (run_id,)).fetchall())
    for role in records:
        streams.setdefault(role, StreamState())
    return RunStreams(streams, dropped, streams[DEFAULT_STREAM].groups, records)


class Streams:
    """Take, ack and version reports on a store's streams."""

    def __init__(self, store: Store):
        self.store = store

    async def take(self, stream: str, max_groups: int | None, lease_s: float | None, order: Order = "oldest",
                   current_version: int | None = None, run_id: str | None = None, now: float | None = None
                   ) -> Batch:
        """Hand out the stream's ready groups (oldest or newest first), at most one per instance id: leased for
        `lease_s`, or consumed when lease_s is None. Leases that ran out are made ready first; with the
        stream's trainer version `current_version`, ready groups of runs with `max_staleness` whose oldest turn
        lags it by more than η are dropped (reason `stale`). With a `run_id`, only that run's groups are handed
        out (other runs' stay ready)."""

        def op(conn: sqlite3.Connection) -> Batch:
            when = now or time.time()
            expired = _expire_leases(conn, stream, when)
            stale = _drop_stale(conn, stream, current_version) if current_version is not None else []
            batch = _take(conn, stream, max_groups, lease_s, when, order, run_id)
            batch.expired_by_run, batch.stale = expired, stale
            return batch

        return await self.store.call(op)

    async def ack(self, batch_id: str, stream: str) -> int | None:
        """Mark a leased batch consumed; returns how many groups it covered (None for an unknown batch). Raises
        `StreamMismatch` when the batch was delivered to another stream than `stream`."""

        def op(conn: sqlite3.Connection) -> int | None:
            row = conn.execute("SELECT stream FROM batches WHERE batch_id=?", (batch_id,)).fetchone()
            if row is None:
                return None
            if row[0] != stream:
                raise StreamMismatch(batch_id, row[0], stream)
            n = conn.execute("UPDATE stream_groups SET state='delivered', lease_expires=NULL "
                             "WHERE batch_id=? AND state IN ('leased','ready')", (batch_id,)).rowcount
            conn.execute("UPDATE batches SET acked_at=? WHERE batch_id=? AND acked_at IS NULL",
                         (time.time(), batch_id))
            return n

        return await self.store.call(op)

    async def report_version(self, run_id: str, stream: str, version: int, rewind: bool = False) -> TrainerVersion:
        """Record a version the stream's trainer reported; raises `VersionConflict` (nothing written) when it
        goes back without `rewind`."""

        def op(conn: sqlite3.Connection) -> TrainerVersion:
            row = conn.execute("SELECT base_version, trainer_version FROM stream_versions WHERE run_id=? AND "
                               "stream=?", (run_id, stream)).fetchone()
            now = (TrainerVersion(*row) if row else TrainerVersion()).advanced(version, rewind)
            conn.execute("INSERT OR REPLACE INTO stream_versions VALUES (?,?,?,?,?)",
                         (run_id, stream, now.base, now.current, time.time()))
            return now

        return await self.store.call(op)

    async def of_run(self, run_id: str) -> RunStreams:
        """Every stream of a run as stored (the default one always)."""
        return await self.store.call(lambda conn: _run_streams(conn, run_id))
