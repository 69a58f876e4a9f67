"""Evaluation: named eval datasets at a trainer version, each item `n_samples_per_eval_prompt` times, generated
beside the training run through the same generators and engines.

An eval never competes for the training run's slots: its trajectories hold slots of their own budget
(`eval_num_process`, shared by every running eval; the runs' scheduler, `generation.scheduler`), so the
training run keeps its `num_process` in flight while an eval runs. Samples are stored per (dataset, version) as
they finish (`delivery.evals`), with eval sampling params and no group logic (no normalization, no filters, never
delivered to the trainer); an eval asked for again, or resumed after a restart, generates only the samples the
store lacks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.delivery.encoded import encode_record
from rollout_buffer.delivery.evals import EvalKey, EvalSample, EvalStore, EvalSummary
from rollout_buffer.engine.client import EngineClient
from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.generation.inputs import LineIndex
from rollout_buffer.generation.plugins import Generator
from rollout_buffer.generation.resources import engine_options_of
from rollout_buffer.generation.scheduler import InFlight, Slot, Slots
from rollout_buffer.generation.sessions import SessionHost
from rollout_buffer.generation.trajectory import failed_record, produce
from rollout_buffer.schemas import StartEvalRequest, TrajectoryRecord
from rollout_buffer.tokens.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

# Keys of the training run's config an eval does not inherit: they describe the training schedule.
_TRAINING_ONLY = ("input_file", "num_items", "skip_instance_ids", "num_epoch", "num_repeat_per_sample",
                  "num_process", "sampling_params", "max_tokens", "current_version", "max_staleness",
                  "rollout_batch_size", "max_ready_groups", "regenerate_stale", "shuffle", "seed")


@dataclass
class EvalProgress:
    """Live counts of one eval, shown in /status."""

    dataset: str
    version: int
    total: int
    skipped: int = 0  # samples the store already had
    done: int = 0
    failed: int = 0
    in_flight: int = 0
    started_at: float = field(default_factory=time.time)

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view."""
        return {"dataset": self.dataset, "version": self.version, "total": self.total, "skipped": self.skipped,
                "done": self.done, "failed": self.failed, "in_flight": self.in_flight,
                "elapsed_s": time.time() - self.started_at}


def sample_of(records: list[TrajectoryRecord], key: EvalKey, instance_id: str, sample: int,
              position: int) -> EvalSample:
    """One eval sample from the generator's records: the reward is theirs (their mean when a generator returns
    several), failed or truncated when any is, the response length their sum when known."""
    statuses = {r.status for r in records}
    status = next((s for s in ("failed", "truncated", "aborted") if s in statuses), "completed")
    lengths = [r.response_length for r in records if r.response_length is not None]
    blob = b"[" + b",".join(encode_record(r) for r in records) + b"]"
    reward = sum(r.reward for r in records) / len(records)
    return EvalSample(*key, instance_id, sample, position, status, reward, sum(lengths) if lengths else None, blob)


class EvalJob:
    """Generates what the store lacks of one eval (a dataset at a version), within the shared budget."""

    def __init__(self, key: EvalKey, n_samples: int, config: dict[str, Any], generator: Generator,
                 evals: EvalStore, budget: Slots, sessions: SessionHost | None):
        self.key = key
        self.n = n_samples
        self.config = config
        self.generator = generator
        self.evals = evals
        self.sessions = sessions
        self.progress = EvalProgress(*key, total=0)
        self.task: asyncio.Task[None] | None = None
        self._in_flight = InFlight(budget)

    @property
    def run_id(self) -> str:
        """The run id the eval's records carry (`extra_info.run_id`)."""
        return f"eval:{self.key[0]}@{self.key[1]}"

    async def run(self) -> None:
        """Generate the missing samples, then mark the eval finished (failed, with the error, on a crash)."""
        try:
            await self._generate_missing()
            await self.evals.end(self.key, "finished")
            log.info("eval %s finished: %s", self.run_id, self.progress.snapshot())
        except asyncio.CancelledError:
            raise  # stays `running` in the store: the next start resumes it
        except Exception as e:
            log.exception("eval %s failed", self.run_id)
            await self.evals.end(self.key, "failed", f"{type(e).__name__}: {e}")

    async def _generate_missing(self) -> None:
        cfg = self.config
        index = await asyncio.to_thread(LineIndex, Path(cfg["input_file"]))
        stored = await self.evals.stored(self.key)
        self.progress.total = len(index.offsets) * self.n
        engine = EngineClient(_engine_urls(cfg), **engine_options_of(cfg))
        resources = RunResources(
            run_id=self.run_id, task_type=cfg["task_type"], config=cfg, engine=engine,
            tokenizer=await _tokenizer(cfg, self.run_id), sampling_params=dict(cfg.get("sampling_params") or {}),
            max_tokens=cfg.get("max_tokens"), sanity_check=str(cfg.get("tokenization_sanity_check_mode", "strict")),
            chat_template_kwargs=cfg.get("chat_template_kwargs"), sessions=self.sessions,
        )
        try:
            for position in range(len(index.offsets)):
                item = index.read(position)
                for sample in range(self.n):
                    if (item["instance_id"], sample) in stored:
                        self.progress.skipped += 1
                        continue
                    await self._in_flight.start(functools.partial(self._one, item, position, sample, resources))
            await self._in_flight.wait_all()
        finally:
            self._in_flight.cancel()
            index.close()
            if self.sessions is not None:
                await self.sessions.end_run(self.run_id)
            await engine.aclose()

    async def _one(self, item: dict[str, Any], position: int, sample: int, resources: RunResources,
                   slot: Slot) -> None:
        """One sample (holding its eval `slot` until the task ends): generate and store."""
        iid = item["instance_id"]
        ctx = RolloutContext(resources, iid, 0, sample, f"{self.run_id}:{iid}:{sample}")
        self.progress.in_flight += 1
        try:
            records = await produce(self.generator, item, ctx,
                                    lambda f: failed_record(item, ctx, f.kind, f.text, f.info))
        finally:
            ctx.engine.release(ctx.uid)
            self.progress.in_flight -= 1
        for r in records:
            r.extra_info |= {"eval_dataset": self.key[0], "eval_version": self.key[1], "eval_sample": sample}
        result = sample_of(records, self.key, iid, sample, position)
        await self.evals.write(result)
        if result.status == "failed":
            self.progress.failed += 1
        else:
            self.progress.done += 1


class EvalManager:
    """Starts, resumes and reports evals; a (dataset, version) runs at most once at a time."""

    def __init__(self, config: ServerConfig, buffer: RolloutBuffer, generators: dict[str, Generator],
                 sessions: SessionHost | None = None):
        self.config = config
        self.buffer = buffer
        self.generators = generators
        self.sessions = sessions
        self.evals = buffer.evals
        self.budget = Slots(StartEvalRequest.model_fields["eval_num_process"].default)
        self.jobs: dict[EvalKey, EvalJob] = {}
        self._changed = asyncio.Event()

    async def version_for(self, req: StartEvalRequest) -> int:
        """The version an eval stands for: the one asked for, else the latest run's trainer version, else 0."""
        if req.current_version is not None:
            return req.current_version
        run = await self.buffer.runs.latest()
        current = (await self.buffer.ledger(run.run_id)).version.current if run is not None else None
        return current or 0

    async def base_config(self) -> dict[str, Any]:
        """What an eval inherits of the latest run: its task, engines, tokenizer and generator options."""
        run = await self.buffer.runs.latest()
        cfg = dict(run.config) if run is not None else {}
        return {k: v for k, v in cfg.items() if k not in _TRAINING_ONLY and v is not None}

    async def start(self, version: int, datasets: dict[str, tuple[Path, int, dict[str, Any]]],
                    eval_num_process: int) -> list[dict[str, Any]]:
        """Start every dataset (name → (input file, number of items, full config)) at `version`; what the store
        already holds is not generated again. Returns one entry per dataset: its state and counts."""
        self.budget.resize(eval_num_process)
        out = []
        for name, (path, num_items, cfg) in datasets.items():
            key = (name, version)
            n = int(cfg["n_samples_per_eval_prompt"])
            job = self.jobs.get(key)
            if job is not None and job.task is not None and not job.task.done():
                out.append({"dataset": name, "version": version, "state": "running", "already_running": True,
                            "num_items": num_items, "n_samples": job.n})
                continue
            cfg = {**cfg, "input_file": str(path), "num_items": num_items}
            state = await self.evals.begin(key, n, num_items, cfg)
            if state == "running":
                self._launch(key, n, cfg)
            out.append({"dataset": name, "version": version, "state": state, "num_items": num_items,
                        "n_samples": n})
        self._notify()
        return out

    def _launch(self, key: EvalKey, n: int, cfg: dict[str, Any]) -> None:
        job = EvalJob(key, n, cfg, self.generators[cfg["task_type"]], self.evals, self.budget, self.sessions)
        self.jobs[key] = job
        job.task = asyncio.create_task(job.run(), name=f"eval-{job.run_id}")
        job.task.add_done_callback(lambda _: self._notify())
        log.info("eval %s started: %d items x %d samples", job.run_id, cfg.get("num_items", 0), n)

    async def resume(self) -> None:
        """After a restart, carry on every eval the store has as running (stored samples are kept)."""
        for key, n, _num_items, cfg in await self.evals.unfinished():
            gen = self.generators.get(cfg.get("task_type") or "")
            if gen is None or not gen.native or not await asyncio.to_thread(Path(cfg["input_file"]).is_file):
                await self.evals.end(key, "failed", "resume failed: generator or input file is gone")
                continue
            self.budget.resize(int(cfg.get("eval_num_process") or self.budget.limit))
            log.info("resuming eval %s@%s", *key)
            self._launch(key, n, cfg)

    async def results(self, version: int | None, datasets: list[str] | None, wait_s: float) -> list[EvalSummary]:
        """Summaries, waiting up to `wait_s` until none of them is running (and every named dataset exists)."""
        deadline = time.monotonic() + wait_s
        while True:
            changed = self._changed
            found = await self.evals.summaries(version, datasets)
            complete = datasets is None or {s.dataset for s in found} >= set(datasets)
            remaining = deadline - time.monotonic()
            if (complete and all(s.state != "running" for s in found)) or remaining <= 0:
                return found
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                pass

    def snapshot(self) -> dict[str, Any]:
        """The live view: the shared budget and the evals this process ran or runs (`state` running or ended)."""
        jobs = [{**j.progress.snapshot(), "state": "running" if j.task is not None and not j.task.done() else "ended"}
                for j in self.jobs.values()]
        return {"eval_num_process": self.budget.limit, "in_flight": self.budget.in_flight, "jobs": jobs}

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def shutdown(self) -> None:
        """Stop every eval; they stay `running` in the store and resume at the next start."""
        for job in self.jobs.values():
            if job.task is not None and not job.task.done():
                job.task.cancel()
                try:
                    await job.task
                except (asyncio.CancelledError, Exception):
                    pass


def eval_config(base: dict[str, Any], req: StartEvalRequest, name: str, version: int) -> dict[str, Any]:
    """The full config of one dataset's eval: the latest run's (`base`) overridden by the request's."""
    spec = req.datasets()[name]
    cfg: dict[str, Any] = {**base, **(req.model_extra or {}), **(spec.options or {})}
    for key in ("task_type", "remote_engine_url", "tokenizer_path"):
        if getattr(req, key) is not None:
            cfg[key] = getattr(req, key)
    cfg |= {
        "eval_dataset": name, "eval_version": version, "n_samples_per_eval_prompt": spec.n_samples_per_eval_prompt,
        "sampling_params": spec.sampling_params or {}, "max_tokens": spec.max_tokens,
        "pass_threshold": req.pass_threshold, "eval_num_process": req.eval_num_process,
    }
    return cfg


def _engine_urls(cfg: dict[str, Any]) -> list[str]:
    v = cfg.get("remote_engine_url")
    return [] if v is None else ([v] if isinstance(v, str) else list(v))


async def _tokenizer(cfg: dict[str, Any], run_id: str) -> Any | None:
    """The tokenizer of the eval's generator (chat mode without one), as a training run loads it."""
    path = cfg.get("tokenizer_path")
    if cfg.get("engine_mode") == "chat" or not path:
        return None
    try:
        return await asyncio.to_thread(load_tokenizer, path)
    except Exception as e:
        log.warning("eval %s: tokenizer %s did not load (%s); chat mode", run_id, path, e)
        return None
