"""The buffer: accepts trajectories, completes groups, and hands whole groups to consumers (long-poll, leases)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import orjson

from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.groups import GroupPolicy
from rollout_buffer.delivery.ledger import GroupTally, RoleLedger, RunLedger
from rollout_buffer.delivery.store import (
    Batch,
    NewRecord,
    Order,
    StaleGroup,
    Store,
    StoredRecord,
    WriteResult,
    role_of,
)
from rollout_buffer.delivery.versions import StalenessRule, TrainerVersion, version_range
from rollout_buffer.observability import metrics
from rollout_buffer.schemas import TrajectoryRecord

log = logging.getLogger(__name__)


class HookSource(Protocol):
    """What delivery needs of a generator: its optional slime-named hooks (`generation.plugins.Generator`)."""

    def hook(self, name: str) -> Callable[..., Any] | None: ...


class RecordError(ValueError):
    """A record that validates but cannot be stored (e.g. integers beyond 64 bits)."""


def encode_record(record: TrajectoryRecord) -> bytes:
    """The record as stored JSON; raises RecordError naming the uid when JSON cannot hold it.

    Log-probs are kept at float32 precision, in their shortest float32 form: SGLang computes them in
    float32 and slime trains on float32 tensors, and the float64 digits beyond that are nearly half of the
    JSON of a long trajectory (which every consumer then has to parse).
    """
    data = record.model_dump(mode="json")
    if data.get("rollout_log_probs"):
        data["rollout_log_probs"] = np.asarray(data["rollout_log_probs"], dtype=np.float32)
    try:
        return orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as e:
        raise RecordError(f"record {record.uid!r} cannot be stored as JSON: {e}") from None


@dataclass
class Delivery:
    """One answer of `/get_rollout_data`: the records as stored JSON (sent on as they are), and meta_info."""

    records: list[StoredRecord]
    meta_info: dict[str, Any]

    @property
    def success(self) -> bool:
        return bool(self.records)


@dataclass
class ReadCounters:
    """What happened since the last answer that delivered groups: the instance ids of the groups that became
    ready, in order (slime's `finished_groups`, one id per group), and dropped groups by reason."""

    finished: list[str] = field(default_factory=list)
    filtered: Counter[str] = field(default_factory=Counter)


class RolloutBuffer:
    """Group completion and delivery on top of the store; knows generators only through their hooks."""

    def __init__(self, config: ServerConfig, store: Store, generators: Mapping[str, HookSource]):
        self.config = config
        self.store = store
        self.generators = generators
        self._changed = asyncio.Event()
        self._since_read = ReadCounters()
        # The same per role stream, from the stream's first read on (a role is told of groups with its records).
        self._since_read_by_role: dict[str, ReadCounters] = {}
        self._policies: dict[str, GroupPolicy] = {}
        self._default_run_lock = asyncio.Lock()
        # The writer run, remembered until a run is created (runs are only created through this object), so
        # a burst of first writes does not queue one store round trip each behind the lock.
        self._writer_run_row: dict[str, Any] | None = None
        self._runs_created = 0
        self._ledgers: dict[str, RunLedger] = {}
        self._ledger_lock = asyncio.Lock()
        # Called with every stale group queued for generation again (the run manager sets it).
        self.regenerate: Callable[[StaleGroup], None] | None = None

    # ---- runs ------------------------------------------------------------------------------------
    async def create_run(self, config: dict[str, Any], group_size: int) -> str:
        """Record a new run (it replaces the running one) and return its id."""
        self._runs_created += 1
        self._writer_run_row = None
        run_id = await self.store.create_run(config, group_size)
        log.info("run %s started: task_type=%s group_size=%d", run_id, config.get("task_type"), group_size)
        return run_id

    def policy_for(self, run: dict[str, Any]) -> GroupPolicy:
        """The group policy of a run: its options plus its generator's hooks."""
        cached = self._policies.get(run["run_id"])
        if cached is not None:
            return cached
        cfg = run["config"]
        gen = self.generators.get(cfg.get("task_type") or "")
        policy = GroupPolicy(
            normalize=bool(cfg.get("normalize_rewards", True)),
            drop_zero_variance=bool(cfg.get("drop_zero_variance", False)),
            is_valid_group=gen.hook("is_valid_group") if gen else None,
            transform_group=gen.hook("transform_group") if gen else None,
        )
        self._policies[run["run_id"]] = policy
        return policy

    async def _writer_run(self) -> dict[str, Any]:
        """The run `/buffer/write` records belong to: the latest one (so a group never straddles runs
        because its run finished mid-group), or a default run when there is none yet."""
        if self._writer_run_row is not None:
            return self._writer_run_row
        async with self._default_run_lock:
            if self._writer_run_row is not None:
                return self._writer_run_row
            created = self._runs_created
            run = await self.store.latest_run()
            if run is None:
                run_id = await self.create_run({"task_type": None, "source": "buffer_write"}, self.config.group_size)
                created = self._runs_created
                run = await self.store.get_run(run_id)
            assert run is not None
            if created == self._runs_created:  # a run created meanwhile may be newer than what was read
                self._writer_run_row = run
            return run

    # ---- run ledgers and the trainer's version --------------------------------------------------
    async def ledger(self, run_id: str) -> RunLedger:
        """The run's ledger, loaded from the store on first use and kept in step from then on."""
        ledger = self._ledgers.get(run_id)
        if ledger is not None:
            return ledger
        async with self._ledger_lock:
            if run_id not in self._ledgers:
                # One store operation: the events of later operations are applied on top of it, those of
                # earlier ones were dropped (no ledger yet) but are in what it read.
                counts, version = await self.store.run_state(run_id)
                ready_total, roles = await self.store.role_state(run_id)
                ledger = RunLedger(run_id, GroupTally.from_states(counts), version, ready_total=ready_total)
                for name, state in roles.items():
                    ledger.roles[name] = RoleLedger(GroupTally.from_states(state.counts), state.counts.get("groups", 0),
                                                    state.version, state.active)
                self._ledgers[run_id] = ledger
            return self._ledgers[run_id]

    async def report_version(self, version: int, rewind: bool = False, role: str | None = None
                             ) -> tuple[str, TrainerVersion] | None:
        """Record the trainer's version (of `role`'s trainer, with role streams) for the latest run; None when
        there is no run. Raises `VersionConflict` when it goes back without `rewind`."""
        run = await self.store.latest_run()
        if run is None:
            return None
        ledger = await self.ledger(run["run_id"])
        before = ledger.version if role is None else ledger.role(role).version
        if role is not None:
            ledger.role(role).active = True
        if before.current == version:  # every fetch repeats it: nothing to write
            return run["run_id"], before
        if role is None:
            now = await self.store.report_trainer_version(run["run_id"], version, rewind)
            ledger.trainer_reported(now)
        else:
            now = await self.store.report_role_version(run["run_id"], role, version, rewind)
            ledger.role_reported(role, now)
        log.info("run %s: %strainer version %s%s", run["run_id"], f"{role} " if role else "", now.current,
                 " (rewound)" if rewind else "")
        if role is None:
            self._warn_if_far_ahead(ledger, StalenessRule.of_run(run["config"]))
        self._notify()  # a long-poll waiting for data re-checks staleness against the new version
        return run["run_id"], now

    @staticmethod
    def _warn_if_far_ahead(ledger: RunLedger, rule: StalenessRule | None) -> None:
        lead = ledger.trainer_lead
        limit = rule.max_staleness if rule is not None else 1
        if lead is not None and lead > limit:
            log.warning("run %s: the trainer (version %s) is %d versions ahead of the newest engine version seen "
                        "(%s); are the engines getting the weight updates?", ledger.run_id, ledger.version.current,
                        lead, ledger.engine_version)

    async def write(self, records: Iterable[TrajectoryRecord], run: dict[str, Any] | None = None) -> WriteResult:
        """Persist records of a run (the writer run by default); completed groups become deliverable."""
        run = run or await self._writer_run()
        items = [
            NewRecord(r.uid, r.instance_id, r.epoch, r.status, encode_record(r), episode=r.extra_info.get("episode_id"),
                      agent_id=role_of({"extra_info": r.extra_info}), reward=r.reward)
            for r in records
        ]
        with metrics.STORE_WRITE_SECONDS.time():
            result = await self.store.write_records(run["run_id"], run["group_size"], items,
                                                    self.policy_for(run).finalize)
        metrics.count_write(result.inserted_by_status, result.duplicates, [r for _, r in result.completed])
        ledger = self._ledgers.get(run["run_id"])
        if ledger is not None:
            for r in records:
                seen = version_range({"extra_info": r.extra_info, "weight_versions": r.weight_versions})
                ledger.engine_seen(seen[1] if seen else None)
        if result.completed:
            for _key, reason in result.completed:
                roles = result.roles.get(_key, [])
                if ledger is not None:
                    ledger.completed(dropped=reason is not None, roles=roles)
                if reason is None:
                    self._since_read.finished.append(_key[1])
                    for role in roles:
                        if role in self._since_read_by_role:
                            self._since_read_by_role[role].finished.append(_key[1])
                else:
                    self._since_read.filtered[reason] += 1
                    for counters in self._since_read_by_role.values():
                        counters.filtered[reason] += 1
                    log.info("group %s/%s epoch %s dropped: %s", _key[0], _key[1], _key[2], reason)
            self._notify()
        return result

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    # ---- reads -----------------------------------------------------------------------------------
    async def deliver(
        self,
        max_groups: int | None,
        wait_s: float,
        lease_s: float | None,
        ack: str | None = None,
        client_gone: Callable[[], Awaitable[bool]] | None = None,
        order: Order = "oldest",
        current_version: int | None = None,
        stream: str | None = None,
        run_id: str | None = None,
    ) -> Delivery:
        """Whole ready groups, oldest (or newest) first; waits up to `wait_s` for the first one to be ready.

        An answer holds at most one group per instance id (see `Store.take`). `current_version` is the
        trainer's version (recorded first; `VersionConflict` when it goes back). Against it (or the last
        version the trainer reported), groups of runs with `max_staleness` that lag by more than η are dropped
        as `stale` before anything is taken. A long-polling client that hung up gets nothing taken for it:
        without a lease those groups would count as consumed and be lost.

        With a `stream` (a role's `agent_id`) all of this happens on that role's own stream: its records of
        each ready group, its leases and acks, its trainer's version and staleness, its counters.

        Groups come from one run: `run_id`, else the current run (the latest: the one its trainer started or
        resumed). An earlier run's leftovers are never mixed into the current run's batches.
        """
        if stream is not None:
            self._since_read_by_role.setdefault(stream, ReadCounters())
        if current_version is not None:
            await self.report_version(current_version, role=stream)
        acked = await self.ack(ack, stream) if ack else 0
        deadline = time.monotonic() + wait_s
        stale: list[StaleGroup] = []
        while True:
            latest = await self.store.latest_run()  # the current run, whose trainer's version counts
            of_run = run_id or (latest["run_id"] if latest else None)
            changed = self._changed
            if client_gone is not None and await client_gone():
                return Delivery([], {})  # nobody is listening; keep the counters for the next reader
            trainer = await self._trainer_version(latest, stream)
            batch = await self.store.take(max_groups, lease_s, order=order, current_version=trainer.current,
                                          stream=stream, run_id=of_run)
            self._account(batch, stream)
            stale += batch.stale
            remaining = deadline - time.monotonic()
            if batch.groups or remaining <= 0:
                break
            timeout = remaining
            if batch.next_lease_expiry is not None:
                timeout = min(timeout, max(0.01, batch.next_lease_expiry - time.time()))
            try:
                await asyncio.wait_for(changed.wait(), timeout)
            except TimeoutError:
                pass
        records = [r for g in batch.groups for r in g]
        lags = [trainer.lag(v) for v in batch.versions]
        metrics.count_delivery(batch.groups, batch.redelivered, [lag for lag in lags if lag is not None])
        meta = self._meta_info(batch.groups, batch.batch_id, acked, batch.redelivered, stream)
        if meta:
            meta["run_id"] = of_run
        meta.update(_version_meta(trainer, lags, stale))
        return Delivery(records, meta)

    async def _trainer_version(self, run: dict[str, Any] | None, role: str | None = None) -> TrainerVersion:
        if run is None:
            return TrainerVersion()
        ledger = await self.ledger(run["run_id"])
        return ledger.version if role is None else ledger.role(role).version

    def _account(self, batch: Batch, stream: str | None = None) -> None:
        """Move the ledgers by what one take did; count and log stale drops and hand regenerations on."""
        taken = Counter(batch.run_ids)
        stale_by_run = Counter(g.key[0] for g in batch.stale)
        for run_id in {*taken, *stale_by_run, *batch.expired_by_run}:
            ledger = self._ledgers.get(run_id)
            if ledger is None:
                continue
            if stream is None:
                ledger.taken(taken[run_id], batch.expired_by_run.get(run_id, 0), stale_by_run[run_id])
            else:
                ledger.role_taken(stream, taken[run_id], batch.expired_by_run.get(run_id, 0), stale_by_run[run_id])
        counters = self._since_read if stream is None else self._since_read_by_role[stream]
        for group in batch.stale:
            run_id, instance_id, epoch, part = group.key
            counters.filtered["stale"] += 1
            regenerated = group.regenerate_part is not None
            metrics.count_stale(regenerated)
            log.info("group %s/%s epoch %s part %s dropped%s: stale (version %d, %d behind the trainer)%s", run_id,
                     instance_id, epoch, part, f" for {stream}" if stream else "", group.version_min, group.lag,
                     f"; generating it again as part {group.regenerate_part}" if regenerated else "")
            if regenerated and self.regenerate is not None:
                self.regenerate(group)

    async def ack(self, batch_id: str, stream: str | None = None) -> int:
        """Mark a leased batch (of `stream`, a role, or the default stream) consumed; `StreamMismatch` when
        the batch went to another stream."""
        n = await self.store.ack(batch_id, stream)
        metrics.GROUPS_ACKED.inc(n)
        if n:
            log.debug("batch %s acked (%d groups)", batch_id, n)
        return n

    def _meta_info(
        self, groups: list[list[StoredRecord]], batch_id: str | None, acked: int, redelivered: int,
        stream: str | None = None,
    ) -> dict[str, Any]:
        records = [r for g in groups for r in g]
        n = len(records)
        # Only an answer that delivers groups reports (and so consumes) what happened since the last one:
        # slime's client ignores unsuccessful answers, so ids reported there would never reach its metadata.
        since = ReadCounters()
        if groups and stream is None:
            since, self._since_read = self._since_read, ReadCounters()
        elif groups and stream is not None:
            since, self._since_read_by_role[stream] = self._since_read_by_role[stream], ReadCounters()
        raw = [r.raw_reward for r in records]
        meta: dict[str, Any] = {
            "total_samples": n,
            "num_groups": len(groups),
            "avg_group_size": n / len(groups) if groups else 0.0,
            "avg_reward": sum(raw) / n if n else 0.0,
            "avg_normalized_reward": sum(r.reward for r in records) / n if n else 0.0,
            "finished_groups": since.finished,
            "finished_groups_count": len(since.finished),
            "filtered_groups": dict(since.filtered),
            "batch_id": batch_id,
            "acked_groups": acked,
            "redelivered_groups": redelivered,
            **({"agent_id": stream} if stream is not None else {}),
        }
        for reason, count in since.filtered.items():
            meta[f"filtered_{reason.split(':')[0]}"] = count
        meta["tokenization_mismatches"] = sum(r.tokenization_mismatch for r in records)
        self._add_generator_meta(groups, meta)
        return meta

    def _add_generator_meta(self, groups: list[list[StoredRecord]], meta: dict[str, Any]) -> None:
        by_task: dict[str, list[list[StoredRecord]]] = {}
        for g in groups:
            task = g[0].task_type if g else None
            if task:
                by_task.setdefault(task, []).append(g)
        for task, task_groups in by_task.items():
            gen = self.generators.get(task)
            hook = gen.hook("get_group_data_meta_info") if gen else None
            if hook is None:
                continue
            try:
                # Only a hook needs the records parsed.
                extra = hook({str(i): [r.load() for r in g] for i, g in enumerate(task_groups)})
            except Exception as e:
                log.warning("get_group_data_meta_info of %s failed: %s", task, e)
                continue
            if isinstance(extra, dict):
                for k, v in extra.items():
                    meta.setdefault(k, v)

    # ---- status ----------------------------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        """The latest run, and counts of groups and trajectories."""
        run = await self.store.latest_run()
        run_id = run["run_id"] if run else None
        return {
            "run": _public_run(run) if run else None,
            "groups": await self.store.group_counts(run_id) if run_id else {},
            "records": await self.store.record_counts(run_id) if run_id else {},
            "filtered": await self.store.filter_counts(run_id) if run_id else {},
            "all_groups": await self.store.group_counts(),
            # Ready or leased groups earlier runs left: a fetch gets them only by naming the run.
            "earlier_runs": await self.store.undelivered_by_run(run_id) if run_id else {},
            "roles": await self.role_counts(run_id) if run_id else {},
        }

    async def role_counts(self, run_id: str) -> dict[str, dict[str, Any]]:
        """Per role stream of the run: its groups by stream state, its records and its trainer's version."""
        _, roles = await self.store.role_state(run_id)
        return {name: {"groups": {k: v for k, v in state.counts.items() if k not in ("groups", "records")},
                       "records": state.counts.get("records", 0), "trainer_version": state.version.current}
                for name, state in sorted(roles.items())}

    async def control(self, run_id: str) -> dict[str, Any]:
        """The run's ledger and its admission state as last persisted (the runner's live view replaces it)."""
        ledger = await self.ledger(run_id)
        return {**ledger.snapshot(), "admission": {"state": await self.store.admission(run_id)}}


def _public_run(run: dict[str, Any]) -> dict[str, Any]:
    cfg = run["config"]
    return {
        "run_id": run["run_id"],
        "state": run["state"],
        "created_at": run["created_at"],
        "task_type": cfg.get("task_type"),
        "input_file": cfg.get("input_file"),
        "num_repeat_per_sample": run["group_size"],
        "num_epoch": cfg.get("num_epoch"),
        "config": cfg,
        "progress": run["progress"],
        "error": run["error"],
    }


def _version_meta(trainer: TrainerVersion, lags: list[int | None], stale: list[StaleGroup]) -> dict[str, Any]:
    """meta_info about versions: the trainer's, the lag of the delivered groups, stale drops and regenerations."""
    known = [lag for lag in lags if lag is not None]
    meta: dict[str, Any] = {
        "trainer_version": trainer.current,
        "stale_groups": len(stale),
        "regenerated_groups": sum(g.regenerate_part is not None for g in stale),
    }
    if known:
        meta["avg_version_lag"] = sum(known) / len(known)
        meta["max_version_lag"] = max(known)
    return meta
