"""Prometheus metrics: the service's registry, its metric objects, and the `/metrics` scrape.

Counters and histograms are bumped where the event happens (one line at each call site); gauges that
describe state the service already keeps (ready groups, run progress) are read at scrape time, so they
can never drift from `/status`. Counters start at zero when the process starts, as Prometheus expects.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder

# `_created` series double every counter's output and no dashboard reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client (0.26) leaves out its "-> None"

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

# Engine turns take milliseconds on a simulator and minutes for long reasoning on a real model.
ENGINE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# A group commit usually lands in a millisecond; seconds mean the disk or the store thread is saturated.
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
# Version lag of delivered data: 0 is on-policy, a bounded run stays at or below its max_staleness.
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128)
ADMISSION_STATES = ("running", "paused_staleness", "paused_cap")

# ---- trajectories ------------------------------------------------------------------------------------
RECORDS_WRITTEN = Counter(
    "rollout_buffer_records_written", "Trajectory records persisted, by status", ["status"], registry=REGISTRY
)
RECORDS_DUPLICATE = Counter(
    "rollout_buffer_records_duplicate", "Records ignored because their uid was already stored", registry=REGISTRY
)
TRAJECTORIES_FAILED = Counter(
    "rollout_buffer_trajectories_failed",
    "Trajectories the runner recorded as failed, by reason (engine_<kind>, generator_error, bad_record)",
    ["reason"],
    registry=REGISTRY,
)
TRAJECTORIES_IN_FLIGHT = Gauge(
    "rollout_buffer_trajectories_in_flight", "Trajectories of the current run being generated", registry=REGISTRY
)
TOKENIZATION_MISMATCHES = Counter(
    "rollout_buffer_tokenization_mismatches",
    "Trajectories whose token sequence differs from a full re-render of their messages",
    registry=REGISTRY,
)

# ---- groups ------------------------------------------------------------------------------------------
GROUPS_COMPLETED = Counter(
    "rollout_buffer_groups_completed",
    "Groups that reached their size (ready for delivery or filtered)",
    registry=REGISTRY,
)
GROUPS_FILTERED = Counter(
    "rollout_buffer_groups_filtered", "Complete groups dropped, by reason", ["reason"], registry=REGISTRY
)
GROUPS_DELIVERED = Counter(
    "rollout_buffer_groups_delivered",
    "Groups handed to a consumer by /get_rollout_data (redeliveries included)",
    registry=REGISTRY,
)
GROUPS_REDELIVERED = Counter(
    "rollout_buffer_groups_redelivered",
    "Groups handed out again because their lease expired unacknowledged",
    registry=REGISTRY,
)
GROUPS_ACKED = Counter("rollout_buffer_groups_acked", "Leased groups acknowledged by /ack", registry=REGISTRY)
RECORDS_DELIVERED = Counter(
    "rollout_buffer_records_delivered", "Records handed to a consumer (redeliveries included)", registry=REGISTRY
)
READY_GROUPS = Gauge(
    "rollout_buffer_ready_groups", "Queue depth: complete groups waiting for a consumer", registry=REGISTRY
)
LONG_POLLS = Gauge(
    "rollout_buffer_long_polls", "Requests of /get_rollout_data waiting for a group (long-polls)", registry=REGISTRY
)
LEASED_GROUPS = Gauge(
    "rollout_buffer_leased_groups", "Groups delivered under a lease and not acknowledged yet", registry=REGISTRY
)
ROLE_GROUPS = Gauge(
    "rollout_buffer_role_groups",
    "Groups of the current run with records of a role, by that role stream's state (ready, leased, delivered, "
    "filtered)",
    ["agent_id", "state"],
    registry=REGISTRY,
)
ROLE_RECORDS = Gauge(
    "rollout_buffer_role_records", "Trajectory records of the current run, by role", ["agent_id"], registry=REGISTRY
)
ROLE_TRAINER_VERSION = Gauge(
    "rollout_buffer_role_trainer_version", "The weight version a role's trainer last reported", ["agent_id"],
    registry=REGISTRY,
)
ROLE_STREAM_STATES = ("ready", "leased", "delivered", "filtered")

# ---- versions and admission (fully asynchronous control) --------------------------------------------
DELIVERED_VERSION_LAG = Histogram(
    "rollout_buffer_delivered_lag_versions",
    "Versions the oldest turn of each delivered group was behind the trainer's version",
    buckets=LAG_BUCKETS,
    registry=REGISTRY,
)
GROUPS_STALE = Counter(
    "rollout_buffer_groups_stale",
    "Ready groups dropped at delivery for lagging the trainer by more than max_staleness",
    registry=REGISTRY,
)
GROUPS_REGENERATED = Counter(
    "rollout_buffer_groups_regenerated",
    "Stale groups queued to be generated again (regenerate_stale)",
    registry=REGISTRY,
)
TRAJECTORIES_REQUEUED = Counter(
    "rollout_buffer_trajectories_requeued",
    "Trajectories still aborted after max_abort_resumes, sent back to the queue to be generated again",
    registry=REGISTRY,
)
TRAINER_VERSION = Gauge(
    "rollout_buffer_trainer_version", "The trainer's weight version for the latest run (-1: not reported)",
    registry=REGISTRY,
)
ENGINE_VERSION = Gauge(
    "rollout_buffer_engine_version",
    "Newest engine weight version seen in the latest run's records (-1: none known)",
    registry=REGISTRY,
)
ADMISSION_STATE = Gauge(
    "rollout_buffer_admission_state",
    "Admission state of the latest run: 1 for the current one (running, paused_staleness, paused_cap)",
    ["state"],
    registry=REGISTRY,
)
ADMISSION_TRANSITIONS = Counter(
    "rollout_buffer_admission_transitions",
    "Times admission control entered a state (running, paused_staleness, paused_cap)",
    ["state"],
    registry=REGISTRY,
)
GROUPS_AHEAD = Gauge(
    "rollout_buffer_groups_ahead",
    "Groups started and not dropped that the trainer has not consumed yet (in flight, open or ready)",
    registry=REGISTRY,
)

# ---- engine ------------------------------------------------------------------------------------------
ENGINE_REQUEST_SECONDS = Histogram(
    "rollout_buffer_engine_request_seconds",
    "Latency of HTTP requests to SGLang engines or the router, failed attempts included",
    ["endpoint"],
    buckets=ENGINE_BUCKETS,
    registry=REGISTRY,
)
ENGINE_ERRORS = Counter(
    "rollout_buffer_engine_errors",
    "Failed engine requests by kind (http_5xx, http_4xx, timeout, connection, bad_response)",
    ["kind"],
    registry=REGISTRY,
)
ENGINE_RETRIES = Counter(
    "rollout_buffer_engine_retries", "Engine requests retried after a transient failure", registry=REGISTRY
)
ENGINE_OUTAGES = Counter(
    "rollout_buffer_engine_outages", "Engine outages (no engine answering past the client's quick retries)",
    registry=REGISTRY,
)
ENGINE_OUTAGE_SECONDS = Gauge(
    "rollout_buffer_engine_outage_seconds", "How long the current run's engines have not answered (0: no outage)",
    registry=REGISTRY,
)
ENGINE_ABORT_RESUMES = Counter(
    "rollout_buffer_engine_abort_resumes", "Aborted generations resumed from their partial output", registry=REGISTRY
)
TOKENS_GENERATED = Counter(
    "rollout_buffer_tokens_generated", "Tokens generated by the engines for this service", registry=REGISTRY
)

# ---- executor ----------------------------------------------------------------------------------------
EXECUTOR_RETRIES = Counter(
    "rollout_buffer_executor_retries",
    "Trajectories started again because the executor's worker running them was lost (a Ray actor died)",
    registry=REGISTRY,
)
EXECUTOR_WORKERS_LOST = Counter(
    "rollout_buffer_executor_workers_lost", "Executor workers (Ray actors) lost and replaced", registry=REGISTRY
)

# ---- store -------------------------------------------------------------------------------------------
STORE_WRITE_SECONDS = Histogram(
    "rollout_buffer_store_write_seconds",
    "Time to persist a batch of records (queueing for the group commit included)",
    buckets=STORE_BUCKETS,
    registry=REGISTRY,
)

# ---- agent proxy -------------------------------------------------------------------------------------
PROXY_TURNS = Counter(
    "rollout_buffer_proxy_turns",
    "Model turns served to agents, by protocol and route (continue: extends a branch; fork / new: the agent "
    "rewrote its history and a new branch started)",
    ["protocol", "route"],
    registry=REGISTRY,
)
# Why the proxy refused or failed a request (a fixed set: never free text or ids in labels).
PROXY_ERROR_REASONS = (
    "unknown_session", "session_closed", "unknown_route", "method_not_allowed", "bad_request", "context_length",
    "unauthorized", "body_too_large", "engine_error", "server_error", "client_gone", "restoring",
)
PROXY_ERRORS = Counter(
    "rollout_buffer_proxy_errors",
    "Agent requests to a session's API (/sessions/{id}/v1/...) answered with a 4xx/5xx, by protocol and reason ("
    + ", ".join(PROXY_ERROR_REASONS) + ")",
    ["protocol", "reason"], registry=REGISTRY,
)
PROXY_SESSIONS_CLOSED = Counter(
    "rollout_buffer_proxy_sessions_closed",
    "Agent sessions closed, by outcome (finished, expired, failed, discarded, empty)",
    ["outcome"],
    registry=REGISTRY,
)
SESSION_WORKER_RESTARTS = Counter(
    "rollout_buffer_session_worker_restarts",
    "Session workers started again after they exited (killed, crashed)", registry=REGISTRY,
)
PROXY_SESSIONS_OPEN = Gauge("rollout_buffer_proxy_sessions_open", "Agent sessions open", registry=REGISTRY)

# ---- the buffer's own routes ---------------------------------------------------------------------------
HTTP_ERRORS = Counter(
    "rollout_buffer_http_errors",
    "Requests to the buffer's own routes (slime's protocol, sessions, inspection) answered with a 4xx/5xx, by "
    "route template (unmatched: no route) and status",
    ["route", "status"], registry=REGISTRY,
)

# ---- evals (read at scrape time: each dataset's newest eval, as /status shows it) ----------------------
EVAL_IN_FLIGHT = Gauge(
    "rollout_buffer_eval_trajectories_in_flight", "Eval trajectories being generated (at most eval_num_process)",
    registry=REGISTRY,
)
EVAL_VERSION = Gauge(
    "rollout_buffer_eval_version", "Trainer version of each dataset's newest eval", ["dataset"], registry=REGISTRY
)
EVAL_SAMPLES = Gauge(
    "rollout_buffer_eval_samples", "Samples stored of each dataset's newest eval", ["dataset"], registry=REGISTRY
)
EVAL_MEAN_REWARD = Gauge(
    "rollout_buffer_eval_mean_reward", "Mean reward of each dataset's newest eval", ["dataset"], registry=REGISTRY
)
EVAL_PASS_AT_K = Gauge(
    "rollout_buffer_eval_pass_at_k", "Unbiased pass@k of each dataset's newest eval", ["dataset", "k"],
    registry=REGISTRY,
)
EVAL_TRUNCATION_RATE = Gauge(
    "rollout_buffer_eval_truncation_rate", "Share of truncated samples of each dataset's newest eval", ["dataset"],
    registry=REGISTRY,
)
EVAL_MEAN_RESPONSE_LENGTH = Gauge(
    "rollout_buffer_eval_mean_response_length", "Mean response length in tokens of each dataset's newest eval",
    ["dataset"], registry=REGISTRY,
)
_EVAL_BY_DATASET = (
    (EVAL_VERSION, "version"), (EVAL_SAMPLES, "samples"), (EVAL_MEAN_REWARD, "mean_reward"),
    (EVAL_TRUNCATION_RATE, "truncation_rate"), (EVAL_MEAN_RESPONSE_LENGTH, "mean_response_length"),
)

# ---- run progress (read at scrape time) --------------------------------------------------------------
RUN_INFO = Gauge(
    "rollout_buffer_run_info", "The latest run (value 1)", ["run_id", "task_type", "state"], registry=REGISTRY
)
RUN_PLANNED = Gauge(
    "rollout_buffer_run_planned_trajectories", "Trajectories the latest run will produce", registry=REGISTRY
)
RUN_DONE = Gauge(
    "rollout_buffer_run_done_trajectories", "Trajectories of the latest run finished (not failed)", registry=REGISTRY
)
RUN_FAILED = Gauge(
    "rollout_buffer_run_failed_trajectories", "Trajectories of the latest run recorded as failed", registry=REGISTRY
)
RUN_SKIPPED = Gauge(
    "rollout_buffer_run_skipped_trajectories",
    "Trajectories of the latest run skipped (already stored when it resumed, or skip_instance_ids)",
    registry=REGISTRY,
)
RUN_PROGRESS = Gauge(
    "rollout_buffer_run_progress_ratio", "Share of the latest run's trajectories accounted for", registry=REGISTRY
)


def filter_reason(reason: str) -> str:
    """The label of a drop reason: its name without the detail a hook may append (`name: detail`)."""
    return reason.split(":", 1)[0].strip() or "unknown"


def count_write(inserted_by_status: dict[str, int], duplicates: int, drop_reasons: list[str | None]) -> None:
    """Count what one committed store write did: records by status, duplicates, and the groups it completed
    (one entry each: None when the group became ready, else why it was dropped)."""
    for status, n in inserted_by_status.items():
        RECORDS_WRITTEN.labels(status).inc(n)
    RECORDS_DUPLICATE.inc(duplicates)
    for reason in drop_reasons:
        GROUPS_COMPLETED.inc()
        if reason is not None:
            GROUPS_FILTERED.labels(filter_reason(reason)).inc()


def count_delivery(groups: list[list[Any]], redelivered: int, lags: Iterable[int] = ()) -> None:
    """Count one `/get_rollout_data` answer, with the version lag of each group whose lag is known."""
    GROUPS_DELIVERED.inc(len(groups))
    GROUPS_REDELIVERED.inc(redelivered)
    RECORDS_DELIVERED.inc(sum(len(g) for g in groups))
    for lag in lags:
        DELIVERED_VERSION_LAG.observe(lag)


def count_stale(regenerated: bool) -> None:
    """Count one group dropped as stale at delivery (and queued again when `regenerated`)."""
    GROUPS_STALE.inc()
    GROUPS_FILTERED.labels("stale").inc()
    if regenerated:
        GROUPS_REGENERATED.inc()


def _set_roles(roles: dict[str, dict[str, Any]]) -> None:
    # The current run's roles only: a role of an earlier run must not linger with its last counts.
    for gauge in (ROLE_GROUPS, ROLE_RECORDS, ROLE_TRAINER_VERSION):
        gauge.clear()
    for name, role in roles.items():
        for state in ROLE_STREAM_STATES:
            ROLE_GROUPS.labels(name, state).set(role["groups"].get(state, 0))
        ROLE_RECORDS.labels(name).set(role["records"])
        if role.get("trainer_version") is not None:
            ROLE_TRAINER_VERSION.labels(name).set(role["trainer_version"])


def _set_control(control: dict[str, Any] | None) -> None:
    control = control or {}
    for gauge, key in ((TRAINER_VERSION, "trainer_version"), (ENGINE_VERSION, "engine_version")):
        value = control.get(key)
        gauge.set(-1 if value is None else value)
    admission = control.get("admission") or {}
    for state in ADMISSION_STATES:
        ADMISSION_STATE.labels(state).set(1 if admission.get("state") == state else 0)
    GROUPS_AHEAD.set(admission.get("groups_ahead") or 0)


def chat_tokens(body: Any) -> int:
    """Completion tokens an OpenAI chat answer reports in `usage` (0 when it does not say)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) and n > 0 else 0


def _set_run(run: dict[str, Any] | None, live: dict[str, Any] | None) -> None:
    RUN_INFO.clear()
    if run is None:
        for gauge in (RUN_PLANNED, RUN_DONE, RUN_FAILED, RUN_SKIPPED, RUN_PROGRESS, TRAJECTORIES_IN_FLIGHT,
                      ENGINE_OUTAGE_SECONDS):
            gauge.set(0)
        return
    RUN_INFO.labels(run["run_id"], str(run["config"].get("task_type") or ""), run["state"]).set(1)
    # Live counts while this process runs it; the snapshot saved in the store otherwise (e.g. after a restart).
    if live is not None and live.get("run_id") == run["run_id"]:
        progress, in_flight = live, int(live.get("in_flight") or 0)
    else:
        progress, in_flight = run.get("progress") or {}, 0
    total, done, failed, skipped = (int(progress.get(k) or 0) for k in ("total", "done", "failed", "skipped"))
    RUN_PLANNED.set(total)
    RUN_DONE.set(done)
    RUN_FAILED.set(failed)
    RUN_SKIPPED.set(skipped)
    RUN_PROGRESS.set(min(1.0, (done + failed + skipped) / total) if total else 0.0)
    TRAJECTORIES_IN_FLIGHT.set(in_flight)
    outage = (live or {}).get("engine_outage") if live is progress else None
    ENGINE_OUTAGE_SECONDS.set(float(outage["seconds"]) if outage else 0.0)


def render(groups: dict[str, int], run: dict[str, Any] | None, live: dict[str, Any] | None,
           accept: str = "", control: dict[str, Any] | None = None, sessions_open: int = 0,
           evals: dict[str, Any] | None = None, roles: dict[str, dict[str, Any]] | None = None) -> tuple[bytes, str]:
    """Set the state gauges from what the caller read (group counts by state, the latest stored run, the live
    progress of the run being generated, the run's control view of `/status`, the open agent sessions, the
    evals view of `/status`, the run's role streams as `/status` shows them) and render every metric; returns
    (body, content type) for `accept`."""
    PROXY_SESSIONS_OPEN.set(sessions_open)
    _set_evals(evals or {})
    READY_GROUPS.set(groups.get("ready", 0))
    LEASED_GROUPS.set(groups.get("leased", 0))
    _set_roles(roles or {})
    _set_run(run, live)
    _set_control(control)
    encoder, content_type = choose_encoder(accept)
    return encoder(REGISTRY), content_type


def _set_evals(evals: dict[str, Any]) -> None:
    EVAL_IN_FLIGHT.set(evals.get("in_flight") or 0)
    for gauge, _ in _EVAL_BY_DATASET:
        gauge.clear()
    EVAL_PASS_AT_K.clear()
    for summary in evals.get("latest") or []:
        dataset = summary["dataset"]
        for gauge, key in _EVAL_BY_DATASET:
            if summary.get(key) is not None:
                gauge.labels(dataset).set(summary[key])
        for name, value in (summary.get("pass_at_k") or {}).items():
            EVAL_PASS_AT_K.labels(dataset, name.removeprefix("pass@")).set(value)


def engine_latency() -> dict[str, dict[str, float]]:
    """Engine requests so far per endpoint: `count` and total `sum` of seconds (a dashboard takes the
    difference of two readings for the latency of the interval between them)."""
    out: dict[str, dict[str, float]] = {}
    for family in ENGINE_REQUEST_SECONDS.collect():
        for s in family.samples:
            if s.name.endswith(("_count", "_sum")):
                entry = out.setdefault(s.labels["endpoint"], {"count": 0.0, "sum": 0.0})
                entry[s.name.rsplit("_", 1)[1]] = s.value
    return out


# ---- metrics of trajectories run in other processes ---------------------------------------------------
# The metrics a trajectory bumps wherever it runs (engine calls, tokenization checks, a session's turns). A Ray
# actor of the `ray` executor and a session worker ship what they gained (`Deltas.take`) with their records; the
# buffer adds it (`apply_deltas`), so /metrics counts the same wherever the work ran.
TRAJECTORY_METRICS: dict[str, Counter | Histogram] = {
    m._name: m
    for m in (ENGINE_REQUEST_SECONDS, ENGINE_ERRORS, ENGINE_RETRIES, ENGINE_ABORT_RESUMES, TOKENS_GENERATED,
              TOKENIZATION_MISMATCHES, PROXY_TURNS, PROXY_ERRORS, PROXY_SESSIONS_CLOSED)
}
# (metric name, label values, increments): a counter's one increment, or a histogram's per-bucket counts then
# its sum.
Delta = tuple[str, tuple[str, ...], tuple[float, ...]]


def _totals(metric: Counter | Histogram) -> dict[tuple[str, ...], tuple[float, ...]]:
    """The metric's values so far per label values: a counter's total, a histogram's per-bucket counts + sum."""
    counts: dict[tuple[str, ...], list[float]] = {}
    sums: dict[tuple[str, ...], float] = {}
    for family in metric.collect():
        for s in family.samples:
            labels = tuple(v for k, v in s.labels.items() if k != "le")
            if s.name.endswith(("_total", "_bucket")):  # a histogram's buckets are cumulative, in order
                counts.setdefault(labels, []).append(s.value)
            elif s.name.endswith("_sum"):
                sums[labels] = s.value
    if not isinstance(metric, Histogram):
        return {labels: tuple(v) for labels, v in counts.items()}
    return {labels: (*(c - p for c, p in zip(v, [0.0, *v[:-1]], strict=True)), sums.get(labels, 0.0))
            for labels, v in counts.items()}


class Deltas:
    """What this process's trajectory and session metrics gained since the last `take()` (in a Ray actor, a
    session worker)."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, tuple[str, ...]], tuple[float, ...]] = {}

    def take(self) -> list[Delta]:
        """The gains since the last call, as deltas for `apply_deltas`."""
        out: list[Delta] = []
        for name, metric in TRAJECTORY_METRICS.items():
            for labels, values in _totals(metric).items():
                last = self._last.get((name, labels)) or (0.0,) * len(values)
                gain = tuple(v - p for v, p in zip(values, last, strict=True))
                if any(gain):
                    out.append((name, labels, gain))
                    self._last[(name, labels)] = values
        return out


def apply_deltas(deltas: list[Delta]) -> None:
    """Add the gains of another process's trajectory metrics to this process's."""
    for name, labels, gain in deltas:
        metric = TRAJECTORY_METRICS.get(name)
        if metric is None:
            continue
        child = metric.labels(*labels) if labels else metric
        if isinstance(metric, Histogram):
            # prometheus_client has no public call to add counted observations; its child's bucket values and
            # sum are the same objects `observe()` increments.
            for bucket, n in zip(child._buckets, gain[:-1], strict=True):  # type: ignore[union-attr]
                if n:
                    bucket.inc(n)
            child._sum.inc(gain[-1])  # type: ignore[union-attr]
        else:
            child.inc(gain[0])  # type: ignore[union-attr]
