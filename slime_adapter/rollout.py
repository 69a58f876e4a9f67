"""`generate_rollout`: slime's rollout function (`--rollout-function-path slime_adapter.generate_rollout`).

Each call returns `rollout_batch_size` groups for one training step:

1. start the buffer's run unless `GET /status` shows it already running for this task;
2. fetch whole groups (long-poll, leased) until, with what slime's data buffer already holds, there are
   enough; groups are used newest first, like slime's `select_rollout_data`, and surplus groups stay in
   the data buffer for the next call instead of being dropped;
3. put the fetched groups into the data buffer and only then ack their batches, so a trainer that dies
   between fetch and ack loses nothing: the buffer delivers the unacked groups again after the lease;
4. take the batch out of the data buffer with its own `get_samples` (so `--buffer-filter-path` applies).

Irregular groups. slime's data buffer only takes groups of exactly `n_samples_per_prompt` samples (its
`add_samples` asserts it). Groups of another size — multi-agent episodes, whose records carry
`extra_info.agent_id`/`episode_id`, or runs that transform groups — are therefore kept beside the data
buffer (tied to it, in this process) and returned as their own inner lists, each counting as one group
of the batch. slime flattens the nested list, so any sizes are accepted; the buffer has already
normalized rewards within each group, so run slime with `--disable-rewards-normalization`, or its
batch-wide fallback for unequal groups would renormalize across groups.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

from slime_adapter.client import BufferClient, Delivery, RolloutBufferError
from slime_adapter.evaluation import note_training_rollout, run_eval
from slime_adapter.flags import AdapterSettings
from slime_adapter.groups import RecordGroup, newest_first, split_groups
from slime_adapter.meta_info import log_raw_info
from slime_adapter.records import RecordError, SampleBuilder, load_image_processor, load_tokenizer, open_image
from slime_adapter.run_control import ensure_rollout_started, trainer_version

log = logging.getLogger(__name__)

SampleGroup = list[Any]
# Pause between fetches when the buffer answers empty at once (long-poll disabled with wait_s 0).
_IDLE_POLL_S = 1.0

# Irregular groups waiting for the next call, per data buffer; they go when the data buffer goes.
_irregular_groups: weakref.WeakKeyDictionary[Any, list[SampleGroup]] = weakref.WeakKeyDictionary()


def held_irregular_groups(data_buffer: Any) -> list[SampleGroup]:
    """Groups whose size is not `n_samples_per_prompt`, held beside `data_buffer` for later calls."""
    return _irregular_groups.setdefault(data_buffer, [])


@dataclass
class _Fetched:
    delivery: Delivery
    groups: list[RecordGroup]
    fetched_at: float


class GroupCollector:
    """Fetches groups for one call and commits them to the data buffer before acking them."""

    def __init__(self, client: BufferClient, settings: AdapterSettings, builder: SampleBuilder,
                 data_buffer: Any, n_samples_per_prompt: int, rollout_id: int, current_version: int | None = None):
        self.client = client
        self.settings = settings
        self.builder = builder
        self.data_buffer = data_buffer
        self.n = n_samples_per_prompt
        self.rollout_id = rollout_id
        self.current_version = current_version
        self.meta_infos: list[dict[str, Any]] = []
        # Groups dropped at commit because records of theirs cannot become samples, and those records.
        self.dropped = {"dropped_groups": 0, "unusable_records": 0}
        self._pending: list[_Fetched] = []
        self._arrivals = 0

    def fill(self, batch_size: int) -> None:
        """Fetch until the data buffer and the held irregular groups add up to `batch_size` groups."""
        # A loop, because groups that cannot become samples are dropped at commit time.
        while (missing := batch_size - self.held_groups()) > 0:
            self.collect(missing)

    def held_groups(self) -> int:
        """Groups ready for training: in the data buffer, plus irregular ones held beside it."""
        return self.data_buffer.get_buffer_length() + len(held_irregular_groups(self.data_buffer))

    def collect(self, num_groups: int) -> None:
        """Fetch until `num_groups` more groups are in the data buffer (or held, when irregular)."""
        got = 0
        last_report = time.monotonic()
        while got < num_groups:
            wait_s = self._wait_before_fetch()
            # Under a staleness bound take only what this batch needs: surplus held by the trainer ages
            # where the buffer cannot see it, and its consumption would release generation too early.
            bounded = self.settings.max_staleness is not None
            delivery = self.client.get_rollout_data(wait_s=wait_s, lease_s=self.settings.lease_s,
                                                    max_groups=num_groups - got if bounded else None,
                                                    current_version=self.current_version,
                                                    agent_id=self.settings.role)
            if delivery.meta_info:
                self.meta_infos.append(delivery.meta_info)
            if not delivery.records:
                self._check_run_alive(got, num_groups)
                if wait_s == 0:
                    time.sleep(_IDLE_POLL_S)
                if time.monotonic() - last_report > 60:
                    log.info("waiting for rollout data: %d of %d groups so far", got, num_groups)
                    last_report = time.monotonic()
                continue
            groups = split_groups(delivery.records, self._arrivals)
            self._arrivals += len(groups)
            self._pending.append(_Fetched(delivery, groups, time.monotonic()))
            got += len(groups)
            log.info("fetched %d groups (%d of %d)", len(groups), got, num_groups)
        self.commit()

    def _wait_before_fetch(self) -> float:
        """The long-poll wait; commits pending groups first if waiting could outlast their lease."""
        wait_s = self.settings.wait_s
        lease_s = self.settings.lease_s
        if self._pending and lease_s is not None:
            lease_left = lease_s - (time.monotonic() - self._pending[0].fetched_at)
            # A quarter of the lease stays in reserve for building samples and acking.
            if lease_left - wait_s < lease_s / 4:
                self.commit()
        return wait_s

    def commit(self) -> None:
        """Samples of the pending groups into the data buffer (newest first), then ack their batches."""
        if not self._pending:
            return
        groups = newest_first([g for f in self._pending for g in f.groups])
        regular: list[SampleGroup] = []
        irregular: list[SampleGroup] = []
        for group in groups:
            samples, errors = [], []
            for record in group.records:
                try:
                    samples.append(self.builder.build(record))
                except RecordError as e:
                    errors.append(str(e))
            if errors:
                # A group short of a sample cannot be trained as a group. It is acked with the rest:
                # delivered again it would fail again and stall training for good. `fill` fetches another.
                self.dropped["dropped_groups"] += 1
                self.dropped["unusable_records"] += len(errors)
                log.error("dropping group %s (epoch %d), %d of its %d records cannot become samples: %s",
                          group.instance_id, group.epoch, len(errors), len(group.records), "; ".join(errors))
                continue
            (regular if len(samples) == self.n else irregular).append(samples)
        if regular:
            self.data_buffer.add_samples(regular)
        if irregular:
            held_irregular_groups(self.data_buffer).extend(irregular)
            log.info("holding %d groups whose size is not %d beside the data buffer", len(irregular), self.n)
        key = str(self.rollout_id)
        consumed = list(self.data_buffer.get_metadata().get(key, []))
        self.data_buffer.update_metadata({key: consumed + [g.instance_id for g in groups]})
        for fetched in self._pending:
            if fetched.delivery.batch_id is not None and self.settings.lease_s is not None:
                self.client.ack(fetched.delivery.batch_id, self.settings.role)
        self._pending = []

    def _check_run_alive(self, got: int, wanted: int) -> None:
        """Stop waiting, with a clear error, when the buffer's run failed or has no more data to give."""
        status = self.client.status()
        run = status.get("run") or {}
        state = run.get("state")
        outage = (run.get("progress") or {}).get("engine_outage")
        if outage:  # generation waits for the engines: say so at each empty poll, the trainer is not stuck on us
            log.warning("the buffer's engines (%s) have not answered for %.0f s (the run fails past %g s): %s",
                        ", ".join(outage.get("engines") or []), outage.get("seconds", 0), outage.get("budget_s", 0),
                        outage.get("error"))
        # Open groups of an ended run never complete, so only ready ones count as data to come.
        if state not in ("finished", "failed") or self._stream_groups(status).get("ready", 0):
            return
        self.commit()  # then our own leases no longer count as groups that may come back
        if self._stream_groups(self.client.status()).get("leased", 0):
            return
        why = f"failed ({run.get('error')})" if state == "failed" else "finished and has no more groups"
        hint = "" if state == "failed" else ": raise --num-epoch or lower --num-rollout"
        run_id = run.get("run_id")
        raise RolloutBufferError(f"the buffer's run {run_id} {why}; got {got} of {wanted} groups{hint}")


    def _stream_groups(self, status: dict[str, Any]) -> dict[str, int]:
        """The run's groups by state for the stream this trainer reads (its role's, or the default one)."""
        if self.settings.role is None:
            return status.get("groups", {})
        return ((status.get("roles") or {}).get(self.settings.role) or {}).get("groups", {})


def take_batch(data_buffer: Any, batch_size: int) -> list[SampleGroup]:
    """Remove one training batch: held irregular groups take places first, the data buffer fills the rest."""
    held = held_irregular_groups(data_buffer)
    irregular = held[:batch_size]
    del held[: len(irregular)]
    # Never ask for more than the data buffer holds: slime's would top up with unanswered dataset prompts.
    num_regular = min(batch_size - len(irregular), data_buffer.get_buffer_length())
    batch = (data_buffer.get_samples(num_regular) if num_regular > 0 else []) + irregular
    rollouts: dict[Any, int] = {}  # the samples of one trajectory (a session's branches) share slime's rollout_id
    for group_index, group in enumerate(batch):
        for sample in group:
            if hasattr(sample, "group_index"):
                sample.group_index = group_index
            if hasattr(sample, "rollout_id"):
                sample.rollout_id = rollouts.setdefault((sample.metadata or {}).get("rollout_id", id(sample)),
                                                        len(rollouts))
    return batch


def moe_shape(args: Any) -> tuple[int, int] | None:
    """slime's MoE shape (`--num-layers`, `--moe-router-topk`) that routed experts are replayed in, when set."""
    layers, top_k = getattr(args, "num_layers", None), getattr(args, "moe_router_topk", None)
    return (int(layers), int(top_k)) if layers and top_k else None


def generate_rollout(
    args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False
) -> list[SampleGroup] | Any:
    """slime's rollout function: `rollout_batch_size` groups of samples from the rollout buffer; with
    `evaluation`, slime's eval output for its eval datasets (`slime_adapter.evaluation`)."""
    if evaluation:
        return run_eval(args, rollout_id, AdapterSettings.from_args(args))
    settings = AdapterSettings.from_args(args)
    batch_size = int(args.rollout_batch_size)
    n = int(args.n_samples_per_prompt)
    tokenizer_path = getattr(args, "hf_checkpoint", None)

    def tokenizer() -> Any:
        if not tokenizer_path:
            raise RolloutBufferError("a record without exact tokens needs --hf-checkpoint for its tokenizer")
        return load_tokenizer(tokenizer_path)

    version = trainer_version(args, rollout_id)
    note_training_rollout(settings.buffer_url, rollout_id)
    with BufferClient(settings.buffer_url, settings.token, settings.retry) as client:
        builder = SampleBuilder(tokenizer, settings.loss_mask_type, moe_shape(args),
                                image=lambda sha: open_image(client.image(sha)),
                                image_processor=lambda: load_image_processor(tokenizer_path))
        ensure_rollout_started(client, args, settings, data_buffer.get_metadata(), version)
        collector = GroupCollector(client, settings, builder, data_buffer, n, rollout_id, version)
        collector.fill(batch_size)
    if collector.meta_infos or collector.dropped["dropped_groups"]:
        log_raw_info(args, collector.meta_infos, rollout_id, collector.dropped)
    return take_batch(data_buffer, batch_size)
