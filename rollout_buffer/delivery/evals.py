"""Eval results: one row per (dataset, version), one per generated sample, and their summary.

Eval samples live beside the training data, never in it: they are not grouped, normalized, filtered or
delivered by `/get_rollout_data`. A sample is keyed by (dataset, version, instance_id, sample index), so an
eval of a version asked for again (or resumed after a crash) generates only what the store lacks.

The summary is what verl and AReaL log per eval set: mean reward, pass@k for every k up to the samples per
prompt (the unbiased estimator of Chen et al. 2021, as slime's `compute_pass_rate`), truncation rate and
mean response length. It is computed from the stored rows, so `/eval_results`, `/status`, `/metrics` and
`rollout-buffer export --eval` always agree.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import orjson

from rollout_buffer.delivery.store import Store

EvalKey = tuple[str, int]  # dataset, version


@dataclass(frozen=True)
class EvalSample:
    """One generated sample of an eval item, ready to store."""

    dataset: str
    version: int
    instance_id: str
    sample: int
    position: int
    status: str
    reward: float
    response_length: int | None
    records: bytes  # the generator's records, a JSON list


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `c` correct among `n` samples: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalSummary:
    """What one eval (a dataset at a version) measured so far; pass@k covers the items with all samples."""

    dataset: str
    version: int
    state: str
    n_samples: int
    num_items: int
    samples: int = 0
    failed: int = 0
    complete_items: int = 0
    mean_reward: float | None = None
    pass_at_k: dict[int, float] = field(default_factory=dict)
    truncation_rate: float | None = None
    mean_response_length: float | None = None
    error: str | None = None
    # How it was sampled, so an eval curve describes itself.
    sampling_params: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view (pass@k keyed `pass@k`)."""
        return {
            "dataset": self.dataset, "version": self.version, "state": self.state, "n_samples": self.n_samples,
            "num_items": self.num_items, "expected_samples": self.n_samples * self.num_items,
            "samples": self.samples, "failed": self.failed, "complete_items": self.complete_items,
            "mean_reward": self.mean_reward, "pass_at_k": {f"pass@{k}": v for k, v in self.pass_at_k.items()},
            "truncation_rate": self.truncation_rate, "mean_response_length": self.mean_response_length,
            "sampling_params": self.sampling_params, "max_tokens": self.max_tokens, "error": self.error,
        }


def summarize(summary: EvalSummary, rows: list[tuple[str, int, str, float, int | None]],
              threshold: float) -> EvalSummary:
    """Fill `summary` from the eval's sample rows (instance_id, sample, status, reward, response_length); samples
    beyond `n_samples` (left by an earlier eval of the version with more) are not counted."""
    n = summary.n_samples
    rows = [r for r in rows if r[1] < n]
    if not rows:
        return summary
    summary.samples = len(rows)
    summary.failed = sum(r[2] == "failed" for r in rows)
    summary.mean_reward = sum(r[3] for r in rows) / len(rows)
    summary.truncation_rate = sum(r[2] == "truncated" for r in rows) / len(rows)
    lengths = [r[4] for r in rows if r[4] is not None]
    summary.mean_response_length = sum(lengths) / len(lengths) if lengths else None
    correct: dict[str, list[bool]] = defaultdict(list)
    for instance_id, _, _, reward, _ in rows:
        correct[instance_id].append(reward >= threshold)
    complete = [sum(c) for c in correct.values() if len(c) == n]
    summary.complete_items = len(complete)
    if complete:
        summary.pass_at_k = {k: sum(pass_at_k(n, c, k) for c in complete) / len(complete) for k in range(1, n + 1)}
    return summary


def read_summaries(conn: sqlite3.Connection, version: int | None = None,
                   datasets: list[str] | None = None) -> list[EvalSummary]:
    """Summaries of the evals asked for (each dataset's newest version when `version` is None; every version
    with `version` -1), newest version first. Runs on any connection: the store's thread or a read-only one."""
    where: list[str] = []
    args: list[Any] = []
    if version is not None and version >= 0:
        where.append("e.version=?")
        args.append(version)
    elif version is None:
        where.append("e.version=(SELECT max(version) FROM evals x WHERE x.dataset=e.dataset)")
    if datasets is not None:
        where.append(f"e.dataset IN ({','.join('?' * len(datasets))})")
        args += datasets
    rows = conn.execute(
        "SELECT e.dataset, e.version, e.state, e.n_samples, e.num_items, e.config, e.error FROM evals e "
        f"WHERE {' AND '.join(['1', *where])} ORDER BY e.version DESC, e.dataset", args,
    ).fetchall()
    out = []
    for dataset, ver, state, n, num_items, config, error in rows:
        samples = conn.execute(
            "SELECT instance_id, sample, status, reward, response_length FROM eval_samples "
            "WHERE dataset=? AND version=?", (dataset, ver),
        ).fetchall()
        cfg = orjson.loads(config)
        summary = EvalSummary(dataset, ver, state, n, num_items, error=error,
                              sampling_params=cfg.get("sampling_params") or {}, max_tokens=cfg.get("max_tokens"))
        out.append(summarize(summary, samples, float(cfg.get("pass_threshold", 1.0))))
    return out


def read_records(conn: sqlite3.Connection, dataset: str, version: int, n_samples: int) -> list[bytes]:
    """Every record of an eval's samples, in the dataset file's order, samples in order (each a JSON object)."""
    out: list[bytes] = []
    for (blob,) in conn.execute(
        "SELECT records FROM eval_samples WHERE dataset=? AND version=? AND sample<? ORDER BY position, sample",
        (dataset, version, n_samples),
    ):
        out += [orjson.dumps(r) for r in orjson.loads(blob)]
    return out


class EvalStore:
    """Eval bookkeeping on the service's store (same SQLite file, same thread, same group commit)."""

    def __init__(self, store: Store):
        self.store = store

    async def begin(self, key: EvalKey, n_samples: int, num_items: int, config: dict[str, Any]) -> str:
        """Record that `key` is to be evaluated with `n_samples` per item; returns its state: `finished` when
        the store already holds all of it (nothing to generate), else `running`."""
        dataset, version = key
        blob = orjson.dumps(config)

        def op(conn: sqlite3.Connection) -> str:
            have = conn.execute(
                "SELECT count(*) FROM eval_samples WHERE dataset=? AND version=? AND sample<?",
                (dataset, version, n_samples),
            ).fetchone()[0]
            state = "finished" if have >= n_samples * num_items else "running"
            conn.execute(
                "INSERT INTO evals(dataset, version, state, n_samples, num_items, config, created_at, finished_at) "
                "VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(dataset, version) DO UPDATE SET state=excluded.state, "
                "n_samples=excluded.n_samples, num_items=excluded.num_items, config=excluded.config, error=NULL, "
                "finished_at=CASE WHEN excluded.state='finished' THEN coalesce(finished_at, excluded.finished_at) "
                "END",
                (dataset, version, state, n_samples, num_items, blob, time.time(),
                 time.time() if state == "finished" else None),
            )
            return state

        return await self.store.call(op)

    async def stored(self, key: EvalKey) -> set[tuple[str, int]]:
        """(instance_id, sample) pairs already stored for the eval."""
        rows = await self.store.call(lambda c: c.execute(
            "SELECT instance_id, sample FROM eval_samples WHERE dataset=? AND version=?", key).fetchall())
        return {(i, s) for i, s in rows}

    async def write(self, s: EvalSample) -> bool:
        """Store one sample; False when it was already stored (its first result stays)."""
        return await self.store.call(lambda c: c.execute(
            "INSERT OR IGNORE INTO eval_samples(dataset, version, instance_id, sample, position, status, reward, "
            "response_length, created_at, records) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (s.dataset, s.version, s.instance_id, s.sample, s.position, s.status, s.reward, s.response_length,
             time.time(), s.records),
        ).rowcount == 1)

    async def end(self, key: EvalKey, state: str, error: str | None = None) -> None:
        """Mark a running eval finished or failed."""
        await self.store.call(lambda c: c.execute(
            "UPDATE evals SET state=?, error=?, finished_at=? WHERE dataset=? AND version=? AND state='running'",
            (state, error, time.time(), *key)))

    async def unfinished(self) -> list[tuple[EvalKey, int, int, dict[str, Any]]]:
        """Evals a restarted server must carry on: (key, n_samples, num_items, config)."""
        rows = await self.store.call(lambda c: c.execute(
            "SELECT dataset, version, n_samples, num_items, config FROM evals WHERE state='running' "
            "ORDER BY created_at").fetchall())
        return [((d, v), n, m, orjson.loads(cfg)) for d, v, n, m, cfg in rows]

    async def summaries(self, version: int | None = None, datasets: list[str] | None = None) -> list[EvalSummary]:
        """See `read_summaries`."""
        return await self.store.call(lambda c: read_summaries(c, version, datasets))

    async def records(self, key: EvalKey, n_samples: int) -> list[bytes]:
        """See `read_records`."""
        return await self.store.call(lambda c: read_records(c, *key, n_samples))
