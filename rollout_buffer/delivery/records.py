"""Trajectory writes and group completion.

A write stores records (duplicate uids ignored) and marks each group it fills `complete`, handing back its
records. The group policy (filters, normalization, user hooks) then runs outside the write transaction: the
built-in policy on the store thread right after the commit (`Records.write` with `finalize`), a policy with
user hooks in a worker thread, so a slow hook holds up its own group, never a commit. Its outcome is committed
next (`finish`, or the write's sequel): the group is dropped with its reason, or its (possibly transformed)
records are kept and it becomes ready on its streams. A group left `complete` by a crash in between is found
again by `unfinished` at start-up.

The built-in policy changes a record's `reward` and `raw_reward` alone, so it sees a long record by its facts,
and what it decided is kept beside the record's JSON, which is written once (`record_layout`). User hooks get,
and may change, whole records, which are written back whole; so are short records (parsing one costs less than
its facts) and those stored before facts were kept.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import orjson

from rollout_buffer.delivery.groups import GROUP_KEY_SQL as _KEY
from rollout_buffer.delivery.groups import GroupKey, GroupOutcome, Record
from rollout_buffer.delivery.record_images import hold
from rollout_buffer.delivery.record_layout import (
    REWARDED_SQL,
    REWARDS_JOIN_SQL,
    rewards_first,
    rewards_prefix,
    with_rewards,
)
from rollout_buffer.delivery.store import Store, WithSequel
from rollout_buffer.delivery.streams import admit, role_of, summarize
from rollout_buffer.delivery.versions import group_version_range


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
    facts: bytes | None = None  # what the built-in group policy reads of it, as JSON (`record_layout.record_facts`)
    side: bytes | None = None  # its per-token side data (`side_data`)
    images: tuple[str, ...] = ()  # the images it names (`record_images`)


@dataclass
class CompleteGroup:
    """A group whose last episode arrived: its records in write order, for its group policy. For the built-in
    policy, a long record is there as its facts, and `prefixes` says how its stored JSON begins (by uid)."""

    key: GroupKey
    records: list[Record]
    prefixes: dict[str, bytes] = field(default_factory=dict)


@dataclass
class Finished:
    """A complete group's outcome as committed: its drop reason (None: ready) and, when ready, its roles."""

    key: GroupKey
    reason: str | None
    roles: list[str] = field(default_factory=list)


@dataclass
class WriteResult:
    """What one write changed: records stored, duplicates ignored, and the groups it completed."""

    inserted: int = 0
    duplicate_at: list[int] = field(default_factory=list)  # the records (by index) whose uids were stored already
    inserted_by_status: dict[str, int] = field(default_factory=dict)
    complete: list[CompleteGroup] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)  # filled once their outcomes are committed

    @property
    def duplicates(self) -> int:
        """How many of the records were stored already (their uids)."""
        return len(self.duplicate_at)


def _write(conn: sqlite3.Connection, run_id: str, group_size: int, items: list[NewRecord], by_facts: bool
           ) -> WriteResult:
    result = WriteResult()
    now = time.time()
    touched: dict[GroupKey, None] = {}
    for i, item in enumerate(items):
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
        blob, item_facts = item.blob, item.facts
        if part:  # a record past a complete group says which part it belongs to
            blob = _in_part(blob, part)
            item_facts = item_facts and _in_part(item_facts, part)
        new_episode = conn.execute(
            f"SELECT 1 FROM trajectories WHERE {_KEY} AND episode=? LIMIT 1", (*key, episode)
        ).fetchone() is None
        cur = conn.execute(
            "INSERT OR IGNORE INTO trajectories(uid, run_id, instance_id, epoch, part, status, episode, created_at, "
            "record, agent_id, reward, facts, side) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (item.uid, *key, item.status, episode, now, blob, item.agent_id, item.reward, item_facts, item.side),
        )
        if cur.rowcount == 0:
            result.duplicate_at.append(i)
            continue
        result.inserted += 1
        hold(conn, item.uid, item.images)
        result.inserted_by_status[item.status] = result.inserted_by_status.get(item.status, 0) + 1
        conn.execute(
            "INSERT INTO groups(run_id, instance_id, epoch, part, size, n, state) VALUES (?,?,?,?,?,?,'open') "
            "ON CONFLICT DO UPDATE SET n = n + excluded.n",
            (*key, group_size, int(new_episode)),
        )
        touched[key] = None
    # Completion is checked after the whole call so every record of a multi-agent episode is in its group.
    for key in touched:
        n, size, state = conn.execute(f"SELECT n, size, state FROM groups WHERE {_KEY}", key).fetchone()
        if state == "open" and n >= size:
            conn.execute(f"UPDATE groups SET state='complete', completed_at=? WHERE {_KEY}", (now, *key))
            group = _group_facts(conn, key) if by_facts else CompleteGroup(key, _group_records(conn, key))
            result.complete.append(group)
    return result


def _in_part(blob: bytes, part: int) -> bytes:
    record = orjson.loads(blob)
    record.setdefault("extra_info", {})["group_part"] = part
    return orjson.dumps(record)


def _group_records(conn: sqlite3.Connection, key: GroupKey) -> list[Record]:
    return [orjson.loads(blob) for (blob,) in conn.execute(
        f"SELECT record FROM trajectories WHERE {_KEY} ORDER BY rowid", key)]


def _group_facts(conn: sqlite3.Connection, key: GroupKey) -> CompleteGroup:
    """The group for the built-in policy: its long records by their facts, the others (short ones, and those
    stored before facts were kept) whole."""
    group = CompleteGroup(key, [])
    for facts, short in conn.execute(f"SELECT facts, CASE WHEN facts IS NULL THEN record END FROM trajectories "
                                     f"WHERE {_KEY} ORDER BY rowid", key):
        record = orjson.loads(short if facts is None else facts)
        if facts is not None:
            group.prefixes[record["uid"]] = rewards_prefix(record)
        group.records.append(record)
    return group


def _next_seq(conn: sqlite3.Connection) -> int:
    conn.execute("INSERT INTO meta(key, value) VALUES ('ready_seq', 1) "
                 "ON CONFLICT(key) DO UPDATE SET value = value + 1")
    seq: int = conn.execute("SELECT value FROM meta WHERE key='ready_seq'").fetchone()[0]
    return seq


def _finish(conn: sqlite3.Connection, key: GroupKey, outcome: GroupOutcome,
            prefixes: dict[str, bytes] | None = None) -> Finished | None:
    """Commit one complete group's outcome (of the built-in policy, with the `prefixes` of the records it saw by
    their facts); None when it is not complete (finished already)."""
    if outcome.reason is not None:
        dropped = conn.execute(f"UPDATE groups SET state='filtered', reason=? WHERE {_KEY} AND state='complete'",
                               (outcome.reason, *key)).rowcount
        return Finished(key, outcome.reason) if dropped else None
    seq = _next_seq(conn)  # a sequence number left unused when the group was finished already is harmless
    if not conn.execute(f"UPDATE groups SET state='ready', ready_seq=?, version_min=?, version_max=? "
                        f"WHERE {_KEY} AND state='complete'",
                        (seq, *group_version_range(outcome.records), *key)).rowcount:
        return None
    for rec in outcome.records:
        if prefixes and rec["uid"] in prefixes:
            _put_rewards(conn, key, rec, prefixes[rec["uid"]])
            continue
        # The role too: a `transform_group` hook may have changed it, and role streams select by it. A record
        # a hook invented (a uid not of this group) changes nothing. A record written whole keeps no facts:
        # they would say what it was.
        conn.execute(f"UPDATE trajectories SET record=?, summary=?, agent_id=?, facts=NULL WHERE uid=? AND {_KEY}",
                     (orjson.dumps(rec), summarize(rec), role_of(rec), rec["uid"], *key))
    return Finished(key, None, admit(conn, key, outcome.records, seq))


def _put_rewards(conn: sqlite3.Connection, key: GroupKey, facts: Record, stored: bytes) -> None:
    """Keep what the built-in policy decided of a record (its `facts` after it): its JSON's new beginning, in
    place of `stored`, its beginning as stored (checked: the first bytes alone are read); a JSON that begins
    otherwise is written anew, whole."""
    row = conn.execute(f"SELECT rowid FROM trajectories WHERE uid=? AND {_KEY}", (facts["uid"], *key)).fetchone()
    if row is None:
        return
    with conn.blobopen("trajectories", "record", row[0], readonly=True) as blob:
        begins = blob.read(len(stored))
    if begins == stored:
        conn.execute("INSERT OR REPLACE INTO record_rewards(uid, cut, head, summary) VALUES (?,?,?,?)",
                     (facts["uid"], len(stored), rewards_prefix(facts), summarize(facts)))
        return
    (whole,) = conn.execute("SELECT record FROM trajectories WHERE rowid=?", row).fetchone()
    record = orjson.loads(whole) | {"reward": facts["reward"], "raw_reward": facts["raw_reward"]}
    conn.execute("UPDATE trajectories SET record=?, summary=?, facts=NULL WHERE rowid=?",
                 (orjson.dumps(rewards_first(record)), summarize(facts), row[0]))


class Records:
    """Trajectory writes and group completion on a store."""

    def __init__(self, store: Store):
        self.store = store

    async def write(self, run_id: str, group_size: int, records: Iterable[NewRecord],
                    finalize: Callable[[list[Record]], GroupOutcome] | None = None) -> WriteResult:
        """Persist records (duplicate uids ignored); the groups they complete come back `complete`. With
        `finalize` (a group policy that runs no user code), the store thread runs it on each completed group
        once the records are committed, outside any transaction, and commits the outcomes right after
        (`finished`): the write is answered once its groups are ready or dropped, one commit later."""
        items = list(records)

        def first(conn: sqlite3.Connection) -> WriteResult:
            return _write(conn, run_id, group_size, items, by_facts=finalize is not None)

        def sequel(result: WriteResult) -> Callable[[sqlite3.Connection], WriteResult] | None:
            if finalize is None or not result.complete:
                return None
            outcomes = [(group, finalize(group.records)) for group in result.complete]

            def commit(conn: sqlite3.Connection) -> WriteResult:
                result.finished = [f for group, outcome in outcomes
                                   if (f := _finish(conn, group.key, outcome, group.prefixes)) is not None]
                return result

            return commit

        result: WriteResult = await self.store.call(WithSequel(first, sequel))
        return result

    async def finish(self, outcomes: list[tuple[CompleteGroup, GroupOutcome]]) -> list[Finished]:
        """Commit the outcomes of complete groups (one transaction); those finished already are left out."""

        def op(conn: sqlite3.Connection) -> list[Finished]:
            return [f for group, outcome in outcomes
                    if (f := _finish(conn, group.key, outcome, group.prefixes)) is not None]

        return await self.store.call(op)

    async def unfinished(self) -> list[GroupKey]:
        """The complete groups whose outcome was never committed (the process stopped in between), oldest first."""

        def op(conn: sqlite3.Connection) -> list[GroupKey]:
            return [tuple(k) for k in conn.execute(
                "SELECT run_id, instance_id, epoch, part FROM groups WHERE state='complete' ORDER BY completed_at")]

        return await self.store.call(op)

    async def complete_group(self, key: GroupKey, by_facts: bool) -> CompleteGroup:
        """A complete group as its policy gets it: for the built-in policy (`by_facts`), its long records by their
        facts, as when it completed; for one with user hooks, every record whole."""
        return await self.store.call(lambda conn: _group_facts(conn, key) if by_facts
                                     else CompleteGroup(key, _group_records(conn, key)))

    async def get(self, uid: str) -> Record | None:
        """One stored trajectory by uid."""

        def op(conn: sqlite3.Connection) -> Record | None:
            row = conn.execute(f"SELECT {REWARDED_SQL}, t.pruned_at FROM trajectories t {REWARDS_JOIN_SQL} "
                               "WHERE t.uid=?", (uid,)).fetchone()
            if row is None:
                return None
            record: Record = orjson.loads(with_rewards(*row[:4]))
            if row[4] is not None:  # cut down to its facts (`retention`)
                record["pruned_at"] = row[4]
            return record

        return await self.store.call(op)

    async def episodes_stored(self, episodes: list[tuple[str, str, str]]) -> set[str]:
        """Of `(run_id, instance_id, episode uid)`s, the uids some record is stored under."""

        def op(conn: sqlite3.Connection) -> set[str]:
            query = "SELECT 1 FROM trajectories WHERE run_id=? AND instance_id=? AND episode=? LIMIT 1"
            return {uid for run_id, instance_id, uid in episodes
                    if conn.execute(query, (run_id, instance_id, uid)).fetchone() is not None}

        return await self.store.call(op) if episodes else set()
