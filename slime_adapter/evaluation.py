"""`generate_rollout(args, rollout_id, data_buffer, evaluation=True)`: slime's evaluation through the buffer.

slime calls its eval function (`--eval-function-path`, by default the rollout function) every
`--eval-interval` rollouts. This one asks the buffer to evaluate slime's eval datasets (`args.eval_datasets`
as slime resolved them from `--eval-prompt-data` / `--eval-config`, with `--n-samples-per-eval-prompt`,
`--eval-temperature`, `--eval-top-p`, `--eval-top-k`, `--eval-max-response-len` and their per-dataset
overrides) at the trainer's current version, waits for the results and returns what slime's `eval_rollout`
returns: `RolloutFnEvalOutput(data={name: {"rewards", "truncated", "samples"}}, metrics=...)`. slime's
`log_eval_rollout_data` logs both: its own `eval/<name>` keys from `data`, and the buffer's summary from
`metrics` — `eval/<name>/mean_reward`, `eval/<name>/pass@k` for k in 1..n (unbiased estimator),
`eval/<name>/truncation_rate`, `eval/<name>/mean_response_length`.

An eval of a version the buffer already holds is not generated again (a restarted trainer re-asking gets the
stored results), and the buffer generates evals beside training with their own in-flight budget
(`--eval-num-process`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from slime_adapter.client import BufferClient, RolloutBufferError
from slime_adapter.flags import AdapterSettings
from slime_adapter.records import RecordError, SampleBuilder, load_tokenizer
from slime_adapter.run_control import trainer_version

log = logging.getLogger(__name__)

# Training rollout ids this process fetched, per buffer URL: an eval after training step R stands for the
# weights that step produced.
_trained: dict[str, int] = {}


@dataclass
class StandaloneEvalOutput:
    """slime's `RolloutFnEvalOutput` (same fields) when slime is not importable."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


def _eval_output_class() -> type:
    try:
        from slime.rollout.base_types import RolloutFnEvalOutput
    except ImportError:
        return StandaloneEvalOutput
    return RolloutFnEvalOutput


@dataclass(frozen=True)
class EvalDataset:
    """One eval dataset as the buffer's `/start_eval` takes it."""

    name: str
    path: str
    n_samples: int
    sampling_params: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None

    def payload(self) -> dict[str, Any]:
        """The dataset's entry in `eval_datasets`."""
        entry: dict[str, Any] = {"path": self.path, "n_samples_per_eval_prompt": self.n_samples,
                                 "sampling_params": self.sampling_params}
        if self.max_tokens is not None:
            entry["max_tokens"] = self.max_tokens
        return entry


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _dataset(args: Any, name: str, path: str, cfg: Any = None) -> EvalDataset:
    """A dataset with slime's precedence: the dataset's own setting, the eval flag, the rollout flag."""

    def pick(attr: str, *flags: str) -> Any:
        return _first(getattr(cfg, attr, None), *(getattr(args, f, None) for f in flags))

    sampling = {
        "temperature": pick("temperature", "eval_temperature", "rollout_temperature"),
        "top_p": pick("top_p", "eval_top_p", "rollout_top_p"),
        "top_k": pick("top_k", "eval_top_k", "rollout_top_k"),
    }
    max_tokens = pick("max_response_len", "eval_max_response_len", "rollout_max_response_len")
    n = pick("n_samples_per_eval_prompt", "n_samples_per_eval_prompt") or 1
    return EvalDataset(name, path, int(n), {k: v for k, v in sampling.items() if v is not None},
                       None if max_tokens is None else int(max_tokens))


def eval_datasets(args: Any) -> list[EvalDataset]:
    """slime's eval datasets: `args.eval_datasets` (slime's resolved configs) or `--eval-prompt-data` pairs."""
    configs = getattr(args, "eval_datasets", None)
    if configs:
        return [_dataset(args, c.name, c.path, c) for c in configs]
    values = list(getattr(args, "eval_prompt_data", None) or [])
    if len(values) == 1:  # slime's legacy form: one path is the aime set
        values = ["aime", values[0]]
    if len(values) % 2:
        raise ValueError("--eval-prompt-data: give name/path pairs")
    datasets = [_dataset(args, values[i], values[i + 1]) for i in range(0, len(values), 2)]
    if not datasets:
        raise ValueError("evaluation needs datasets: set --eval-prompt-data NAME PATH ... or --eval-config")
    return datasets


def note_training_rollout(buffer_url: str, rollout_id: int) -> None:
    """Remember that this process fetched training rollout `rollout_id` (see `eval_version`)."""
    _trained[buffer_url] = max(rollout_id, _trained.get(buffer_url, -1))


def eval_version(args: Any, rollout_id: int, buffer_url: str) -> int:
    """The weight version an eval at `rollout_id` stands for: slime evaluates after training step R and its
    weight update, i.e. with the weights training rollout R + 1 is asked at; an eval before this process
    trained on R (slime's eval before training) has the weights rollout R is asked at."""
    after_training = _trained.get(buffer_url, -1) >= rollout_id
    return trainer_version(args, rollout_id + 1 if after_training else rollout_id)


def eval_payload(args: Any, settings: AdapterSettings, datasets: list[EvalDataset], version: int) -> dict[str, Any]:
    """The `/start_eval` body from slime's args."""
    payload: dict[str, Any] = {
        "eval_datasets": {d.name: d.payload() for d in datasets},
        "eval_num_process": settings.eval_num_process,
        "current_version": version,
        "task_type": settings.task_type,
        "tokenizer_path": getattr(args, "hf_checkpoint", None),
    }
    if getattr(args, "sglang_router_ip", None):
        payload["remote_engine_url"] = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
    return {k: v for k, v in payload.items() if v is not None}


def eval_metrics(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The buffer's summaries as slime metric keys, `eval/<dataset>/...`."""
    out: dict[str, float] = {}
    for name, r in results.items():
        prefix = f"eval/{name}/"
        for key in ("mean_reward", "truncation_rate", "mean_response_length"):
            if r.get(key) is not None:
                out[prefix + key] = float(r[key])
        for k, value in (r.get("pass_at_k") or {}).items():
            out[prefix + k] = float(value)
    return out


def _dataset_data(records: list[dict[str, Any]], builder: SampleBuilder) -> dict[str, Any]:
    """slime's per-dataset eval data: rewards and truncation flags in the file's order (`n` samples of an item
    together, as slime's pass-rate reshapes them), and the samples that could be built."""
    samples = []
    for record in records:
        try:
            samples.append(builder.build(record))
        except RecordError as e:
            log.warning("eval record %s cannot become a sample (it still counts in rewards): %s", record["uid"], e)
    return {
        "rewards": [float(r["reward"]) for r in records],
        "truncated": [r.get("status") == "truncated" for r in records],
        "samples": samples,
    }


def run_eval(args: Any, rollout_id: int, settings: AdapterSettings) -> Any:
    """Start the evals at the trainer's version, wait for them, and return slime's eval output."""
    datasets = eval_datasets(args)
    version = eval_version(args, rollout_id, settings.buffer_url)
    names = [d.name for d in datasets]
    tokenizer_path = getattr(args, "hf_checkpoint", None)

    def tokenizer() -> Any:
        if not tokenizer_path:
            raise RolloutBufferError("a record without exact tokens needs --hf-checkpoint for its tokenizer")
        return load_tokenizer(tokenizer_path)

    with BufferClient(settings.buffer_url, settings.token, settings.retry) as client:
        started = client.start_eval(eval_payload(args, settings, datasets, version))
        log.info("eval %d at version %d: %s", rollout_id, version,
                 [(e["dataset"], e["state"]) for e in started.get("evals", [])])
        while True:
            answer = client.eval_results(version, names, wait_s=settings.wait_s or 30.0)
            if answer.get("finished"):
                break
            log.info("waiting for eval %d at version %d", rollout_id, version)
    results = answer["results"]
    failed = {n: r.get("error") for n, r in results.items() if r.get("state") == "failed"}
    if failed:
        raise RolloutBufferError(f"the buffer's eval at version {version} failed: {failed}")
    builder = SampleBuilder(tokenizer, settings.loss_mask_type)
    data = {name: _dataset_data(results[name].pop("records"), builder) for name in names}
    metrics = eval_metrics(results)
    log.info("eval %d (version %d) buffer summary: %s", rollout_id, version, metrics)
    return _eval_output_class()(data=data, metrics=metrics)
