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
from rollout_buffer.delivery.store import NewRecord, Store, StoredRecord, WriteResult
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
        self._policies: dict[str, GroupPolicy] = {}
        self._default_run_lock = asyncio.Lock()
        # The writer run, remembered until a run is created (runs are only created through this object), so
        # a burst of first writes does not queue one store round trip each behind the lock.
        self._writer_run_row: dict[str, Any] | None = None
        self._runs_created = 0

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

    # ---- writes ----------------------------------------------------------------------------------
    async def write(self, records: Iterable[TrajectoryRecord], run: dict[str, Any] | None = None) -> WriteResult:
        """Persist records of a run (the writer run by default); completed groups become deliverable."""
        run = run or await self._writer_run()
        items = [
            NewRecord(r.uid, r.instance_id, r.epoch, r.status, encode_record(r), episode=r.extra_info.get("episode_id"))
            for r in records
        ]
        with metrics.STORE_WRITE_SECONDS.time():
            result = await self.store.write_records(run["run_id"], run["group_size"], items,
                                                    self.policy_for(run).finalize)
        metrics.count_write(result.inserted_by_status, result.duplicates, [r for _, r in result.completed])
        if result.completed:
            for _key, reason in result.completed:
                if reason is None:
                    self._since_read.finished.append(_key[1])
                else:
                    self._since_read.filtered[reason] += 1
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
    ) -> Delivery:
        """Whole ready groups, oldest first; waits up to `wait_s` for the first one to be ready.

        An answer holds at most one group per instance id (see `Store.take`). A long-polling client that
        hung up gets nothing taken for it: without a lease those groups would count as consumed and be lost.
        """
        acked = await self.ack(ack) if ack else 0
        deadline = time.monotonic() + wait_s
        while True:
            changed = self._changed
            if client_gone is not None and await client_gone():
                return Delivery([], {})  # nobody is listening; keep the counters for the next reader
            batch = await self.store.take(max_groups, lease_s)
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
        metrics.count_delivery(batch.groups, batch.redelivered)
        meta = self._meta_info(batch.groups, batch.batch_id, acked, batch.redelivered)
        return Delivery(records, meta)

    async def ack(self, batch_id: str) -> int:
        """Mark a leased batch consumed."""
        n = await self.store.ack(batch_id)
        metrics.GROUPS_ACKED.inc(n)
        if n:
            log.debug("batch %s acked (%d groups)", batch_id, n)
        return n

    def _meta_info(
        self, groups: list[list[StoredRecord]], batch_id: str | None, acked: int, redelivered: int
    ) -> dict[str, Any]:
        records = [r for g in groups for r in g]
        n = len(records)
        # Only an answer that delivers groups reports (and so consumes) what happened since the last one:
        # slime's client ignores unsuccessful answers, so ids reported there would never reach its metadata.
        since = ReadCounters()
        if groups:
            since, self._since_read = self._since_read, ReadCounters()
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
        }


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
