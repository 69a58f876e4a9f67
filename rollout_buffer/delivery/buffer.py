"""The buffer: accepts trajectories, completes groups, and hands whole groups to consumers (long-poll, leases)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.encoded import EncodedRecord
from rollout_buffer.delivery.evals import EvalStore
from rollout_buffer.delivery.groups import GroupOutcome, GroupPolicy, Record
from rollout_buffer.delivery.ledger import RunLedger
from rollout_buffer.delivery.reads import Reads
from rollout_buffer.delivery.records import CompleteGroup, Finished, Records, WriteResult
from rollout_buffer.delivery.runs import Runs, StoredRun
from rollout_buffer.delivery.store import Store
from rollout_buffer.delivery.streams import DEFAULT_STREAM, Batch, Order, StaleGroup, StoredRecord, Streams
from rollout_buffer.delivery.versions import StalenessRule, TrainerVersion
from rollout_buffer.observability import metrics
from rollout_buffer.schemas import TrajectoryRecord

log = logging.getLogger(__name__)


class HookSource(Protocol):
    """What delivery needs of a generator: its optional slime-named hooks (`generation.plugins.Generator`)."""

    def hook(self, name: str) -> Callable[..., Any] | None: ...


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
    """Group completion and delivery on top of the store; knows generators only through their hooks.

    Its parts, by concern: `runs` (the run registry), `reads` (counts and group listings), `evals` (eval
    bookkeeping); records are written through `write` (which completes groups) and streams are read through
    `deliver` and `ack`.
    """

    def __init__(self, config: ServerConfig, store: Store, generators: Mapping[str, HookSource]):
        self.config = config
        self.generators = generators
        self.store = store
        self.runs = Runs(store)
        self.reads = Reads(store)
        self.evals = EvalStore(store)
        self._records = Records(store)
        self._streams = Streams(store)
        self._changed = asyncio.Event()
        self.closing = False  # the server is stopping: long-polls do not wait (`close_long_polls`)
        # Per stream (from its first read on; the default stream's from the start), per run: an answer reports
        # what happened to the groups of the run it delivers, never another run's.
        self._since_read: dict[str, dict[str, ReadCounters]] = {DEFAULT_STREAM: {}}
        self._policies: dict[str, GroupPolicy] = {}
        self._default_run_lock = asyncio.Lock()
        # The writer run, remembered until a run is created (runs are only created through this object), so
        # a burst of first writes does not queue one store round trip each behind the lock.
        self._writer_run_row: StoredRun | None = None
        self._runs_created = 0
        self._ledgers: dict[str, RunLedger] = {}
        self._ledger_lock = asyncio.Lock()
        # Stale groups queued for generation again, for the run manager to take.
        self.regenerations: asyncio.Queue[StaleGroup] = asyncio.Queue()

    # ---- runs ------------------------------------------------------------------------------------
    async def create_run(self, config: dict[str, Any], group_size: int) -> str:
        """Record a new run (it replaces the running one) and return its id."""
        self._runs_created += 1
        self._writer_run_row = None
        run_id = await self.runs.create(config, group_size)
        log.info("run %s started: task_type=%s group_size=%d", run_id, config.get("task_type"), group_size)
        return run_id

    def policy_for(self, run: StoredRun) -> GroupPolicy:
        """The group policy of a run: its options plus its generator's hooks."""
        cached = self._policies.get(run.run_id)
        if cached is not None:
            return cached
        cfg = run.config
        gen = self.generators.get(cfg.get("task_type") or "")
        policy = GroupPolicy(
            normalize=bool(cfg.get("normalize_rewards", True)),
            drop_zero_variance=bool(cfg.get("drop_zero_variance", False)),
            is_valid_group=gen.hook("is_valid_group") if gen else None,
            transform_group=gen.hook("transform_group") if gen else None,
            hook_timeout_s=self.config.hook_timeout_s,
        )
        self._policies[run.run_id] = policy
        return policy

    async def _writer_run(self) -> StoredRun:
        """The run `/buffer/write` records belong to: the latest one (so a group never straddles runs
        because its run finished mid-group), or a default run when there is none yet."""
        if self._writer_run_row is not None:
            return self._writer_run_row
        async with self._default_run_lock:
            if self._writer_run_row is not None:
                return self._writer_run_row
            created = self._runs_created
            run = await self.runs.latest()
            if run is None:
                run_id = await self.create_run({"task_type": None, "source": "buffer_write"}, self.config.group_size)
                created = self._runs_created
                run = await self.runs.get(run_id)
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
                self._ledgers[run_id] = RunLedger.of_stored(run_id, await self._streams.of_run(run_id))
            return self._ledgers[run_id]

    async def report_version(self, version: int, rewind: bool = False, stream: str = DEFAULT_STREAM
                             ) -> tuple[str, TrainerVersion] | None:
        """Record the version of a stream's trainer (the default stream's, or a role's) for the latest run;
        None when there is no run. Raises `VersionConflict` when it goes back without `rewind`."""
        run = await self.runs.latest()
        if run is None:
            return None
        ledger = await self.ledger(run.run_id)
        before = ledger.stream(stream).version
        ledger.stream(stream).active = True
        if before.current == version:  # every fetch repeats it: nothing to write
            return run.run_id, before
        now = await self._streams.report_version(run.run_id, stream, version, rewind)
        ledger.reported(now, stream)
        log.info("run %s: %strainer version %s%s", run.run_id, f"{stream} " if stream else "", now.current,
                 " (rewound)" if rewind else "")
        if stream == DEFAULT_STREAM:
            self._warn_if_far_ahead(ledger, StalenessRule.of_run(run.config))
        self._notify()  # a long-poll waiting for data re-checks staleness against the new version
        return run.run_id, now

    @staticmethod
    def _warn_if_far_ahead(ledger: RunLedger, rule: StalenessRule | None) -> None:
        lead = ledger.trainer_lead
        limit = rule.max_staleness if rule is not None else 1
        if lead is not None and lead > limit:
            log.warning("run %s: the trainer (version %s) is %d versions ahead of the newest engine version seen "
                        "(%s); are the engines getting the weight updates?", ledger.run_id, ledger.version.current,
                        lead, ledger.engine_version)

    # ---- writes and group completion -------------------------------------------------------------
    async def write(self, records: Iterable[TrajectoryRecord], run: StoredRun | None = None) -> WriteResult:
        """Persist records of a run (the writer run by default); completed groups become deliverable."""
        return await self.write_encoded([EncodedRecord.of(r) for r in records], run)

    async def write_encoded(self, records: list[EncodedRecord], run: StoredRun | None = None) -> WriteResult:
        """`write` for records encoded already (by a session worker, or by `write`)."""
        run = run or await self._writer_run()
        items = [r.row for r in records]
        policy = self.policy_for(run)
        with metrics.STORE_WRITE_SECONDS.time():
            # The built-in policy runs on the store thread between two commits; user hooks in a worker thread.
            result = await self._records.write(run.run_id, run.group_size, items,
                                               None if policy.has_hooks else policy.finalize)
            if result.complete and policy.has_hooks:
                result.finished = await self._finish(policy, result.complete)
        metrics.count_write(result.inserted_by_status, result.duplicates, [f.reason for f in result.finished])
        ledger = self._ledgers.get(run.run_id)
        if ledger is not None:
            for r in records:
                ledger.engine_seen(r.versions[1] if r.versions else None)
        self._completed(result.finished)
        return result

    async def _finish(self, policy: GroupPolicy, groups: list[CompleteGroup]) -> list[Finished]:
        """Run the group policy of each complete group (outside the store) and commit the outcomes."""
        outcomes: list[tuple[CompleteGroup, GroupOutcome]] = []
        for group in groups:
            outcomes.append((group, await policy.outcome(group.records)))
        return await self._records.finish(outcomes)

    def _completed(self, finished: list[Finished]) -> None:
        """Move the ledgers and the counters of each stream by groups that became ready or were dropped."""
        if not finished:
            return
        for key, reason, roles in ((f.key, f.reason, f.roles) for f in finished):
            ledger = self._ledgers.get(key[0])
            if ledger is not None:
                ledger.completed(dropped=reason is not None, roles=roles)
            if reason is None:
                for stream in (DEFAULT_STREAM, *roles):
                    if stream in self._since_read:
                        self._counters(stream, key[0]).finished.append(key[1])
            else:
                for stream in self._since_read:
                    self._counters(stream, key[0]).filtered[reason] += 1
                log.info("group %s/%s epoch %s dropped: %s", key[0], key[1], key[2], reason)
        self._notify()

    async def finish_interrupted(self) -> int:
        """Finish the groups a stopped process left complete but not yet ready or dropped (start-up), one at a
        time (a group of long records is megabytes), each read as its run's policy reads a group completing."""
        keys = await self._records.unfinished()
        for key in keys:
            run = await self.runs.get(key[0])
            if run is None:
                continue
            policy = self.policy_for(run)
            group = await self._records.complete_group(key, by_facts=not policy.has_hooks)
            self._completed(await self._finish(policy, [group]))
        if keys:
            log.info("%d complete groups of an interrupted process were finished", len(keys))
        return len(keys)

    async def get_record(self, uid: str) -> Record | None:
        """One stored trajectory by uid."""
        return await self._records.get(uid)

    async def episodes_stored(self, episodes: list[tuple[str, str, str]]) -> set[str]:
        """Of `(run_id, instance_id, episode uid)`s, the uids some record is stored under."""
        return await self._records.episodes_stored(episodes)

    def close_long_polls(self) -> None:
        """The server is stopping: every long-poll answers now with what is ready (often nothing), and new ones do
        not wait."""
        self.closing = True
        self._notify()

    def _counters(self, stream: str, run_id: str) -> ReadCounters:
        return self._since_read[stream].setdefault(run_id, ReadCounters())

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
        stream: str = DEFAULT_STREAM,
        run_id: str | None = None,
    ) -> Delivery:
        """Whole ready groups of a stream, oldest (or newest) first; waits up to `wait_s` for the first one.

        The default stream holds every group whole; a role's stream (`agent_id`) its records of each group,
        with the role's own leases, acks, trainer version, staleness and counters. An answer holds at most one
        group per instance id (see `streams.Streams.take`). `current_version` is the stream's trainer's
        version (recorded first; `VersionConflict` when it goes back). Against it (or the last version that
        trainer reported), groups of runs with `max_staleness` that lag by more than η are dropped as `stale`
        before anything is taken. A long-polling client that hung up gets nothing taken for it: without a
        lease those groups would count as consumed and be lost.

        Groups come from one run: `run_id`, else the current run (the latest: the one its trainer started or
        resumed). An earlier run's leftovers are never mixed into the current run's batches.
        """
        self._since_read.setdefault(stream, {})
        if current_version is not None:
            await self.report_version(current_version, stream=stream)
        acked = (await self.ack(ack, stream) or 0) if ack else 0  # a batch never delivered acks nothing
        deadline = time.monotonic() + wait_s
        stale: list[StaleGroup] = []
        while True:
            latest = await self.runs.latest()  # the current run, whose trainer's version counts
            of_run = run_id or (latest.run_id if latest else None)
            changed = self._changed
            if client_gone is not None and await client_gone():
                return Delivery([], {})  # nobody is listening; keep the counters for the next reader
            trainer = await self._trainer_version(latest, stream)
            batch = await self._streams.take(stream, max_groups, lease_s, order=order,
                                             current_version=trainer.current, run_id=of_run)
            self._account(batch, stream)
            stale += batch.stale
            remaining = deadline - time.monotonic()
            if batch.groups or remaining <= 0 or self.closing:
                break
            timeout = remaining
            if batch.next_lease_expiry is not None:
                timeout = min(timeout, max(0.01, batch.next_lease_expiry - time.time()))
            metrics.LONG_POLLS.inc()
            try:
                await asyncio.wait_for(changed.wait(), timeout)
            except TimeoutError:
                pass
            finally:
                metrics.LONG_POLLS.dec()
        records = [r for g in batch.groups for r in g]
        lags = [trainer.lag(v) for v in batch.versions]
        metrics.count_delivery(batch.groups, batch.redelivered, [lag for lag in lags if lag is not None])
        meta = self._meta_info(batch.groups, batch.batch_id, acked, batch.redelivered, stream, of_run)
        if meta:
            meta["run_id"] = of_run
        meta.update(_version_meta(trainer, lags, stale))
        return Delivery(records, meta)

    async def _trainer_version(self, run: StoredRun | None, stream: str) -> TrainerVersion:
        if run is None:
            return TrainerVersion()
        return (await self.ledger(run.run_id)).stream(stream).version

    def _account(self, batch: Batch, stream: str) -> None:
        """Move the ledgers by what one take did; count and log stale drops and queue regenerations."""
        taken = Counter(batch.run_ids)
        stale_by_run = Counter(g.key[0] for g in batch.stale)
        for run_id in {*taken, *stale_by_run, *batch.expired_by_run}:
            ledger = self._ledgers.get(run_id)
            if ledger is not None:
                ledger.taken(taken[run_id], batch.expired_by_run.get(run_id, 0), stale_by_run[run_id], stream)
        for group in batch.stale:
            run_id, instance_id, epoch, part = group.key
            self._counters(stream, run_id).filtered["stale"] += 1
            regenerated = group.regenerate_part is not None
            metrics.count_stale(regenerated)
            log.info("group %s/%s epoch %s part %s dropped%s: stale (version %d, %d behind the trainer)%s", run_id,
                     instance_id, epoch, part, f" for {stream}" if stream else "", group.version_min, group.lag,
                     f"; generating it again as part {group.regenerate_part}" if regenerated else "")
            if regenerated:
                self.regenerations.put_nowait(group)

    async def ack(self, batch_id: str, stream: str = DEFAULT_STREAM) -> int | None:
        """Mark a leased batch of a stream consumed (how many groups it covered; None for a batch never delivered);
        `StreamMismatch` when the batch went to another stream."""
        n = await self._streams.ack(batch_id, stream)
        if n is None:
            return None
        metrics.GROUPS_ACKED.inc(n)
        if n:
            log.debug("batch %s acked (%d groups)", batch_id, n)
        return n

    def _meta_info(
        self, groups: list[list[StoredRecord]], batch_id: str | None, acked: int, redelivered: int, stream: str,
        run_id: str | None,
    ) -> dict[str, Any]:
        records = [r for g in groups for r in g]
        n = len(records)
        # Only an answer that delivers groups reports (and so consumes) what happened since the last one, to the
        # groups of the run it delivers: slime's client ignores unsuccessful answers, so ids reported there would
        # never reach its metadata.
        since = ReadCounters()
        if groups and run_id is not None:
            since = self._since_read[stream].pop(run_id, ReadCounters())
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
            **({"agent_id": stream} if stream != DEFAULT_STREAM else {}),
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
        run = await self.runs.latest()
        store = {"last_refusal": self.store.refusal()}
        if run is None:
            return {"run": None, "groups": {}, "records": {}, "filtered": {},
                    "all_groups": await self.reads.group_counts(), "earlier_runs": {}, "roles": {}, "store": store}
        return {
            "run": run.public(),
            "groups": await self.reads.group_counts(run.run_id),
            "records": await self.reads.record_counts(run.run_id),
            "filtered": await self.reads.filter_counts(run.run_id),
            "all_groups": await self.reads.group_counts(),
            # Ready or leased groups earlier runs left: a fetch gets them only by naming the run.
            "earlier_runs": await self.reads.undelivered_by_run(run.run_id),
            "roles": await self.role_counts(run.run_id),
            "store": store,
        }

    async def role_counts(self, run_id: str) -> dict[str, dict[str, Any]]:
        """Per role stream of the run: its groups by stream state, its records and its trainer's version."""
        stored = await self._streams.of_run(run_id)
        return {name: {"groups": dict(state.counts), "records": stored.records_by_role.get(name, 0),
                       "trainer_version": state.version.current}
                for name, state in sorted(stored.streams.items()) if name != DEFAULT_STREAM}

    async def control(self, run_id: str) -> dict[str, Any]:
        """The run's ledger and its admission state as last persisted (the runner's live view replaces it)."""
        ledger = await self.ledger(run_id)
        return {**ledger.snapshot(), "admission": {"state": await self.runs.admission(run_id)}}


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
