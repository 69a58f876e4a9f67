"""GET /metrics: Prometheus names, exact counts against real runs (sim engine + buffer over HTTP), auth."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ops_helpers import delta, math_rows, scrape, start_run, value, write_jsonl
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from runs import drain, wait_finished
from servers import Server, free_port, running
from servers import sim_engine as start_sim_engine

from rollout_buffer.observability import metrics

PLUGINS = Path(__file__).parent / "plugins"
# What the issue asks to be measured, by metric family name.
REQUIRED_FAMILIES = {
    "rollout_buffer_records_written": "counter",
    "rollout_buffer_groups_completed": "counter",
    "rollout_buffer_groups_filtered": "counter",
    "rollout_buffer_groups_delivered": "counter",
    "rollout_buffer_groups_redelivered": "counter",
    "rollout_buffer_trajectories_in_flight": "gauge",
    "rollout_buffer_trajectories_failed": "counter",
    "rollout_buffer_engine_request_seconds": "histogram",
    "rollout_buffer_engine_errors": "counter",
    "rollout_buffer_tokens_generated": "counter",
    "rollout_buffer_store_write_seconds": "histogram",
    "rollout_buffer_tokenization_mismatches": "counter",
    "rollout_buffer_ready_groups": "gauge",
    "rollout_buffer_run_progress_ratio": "gauge",
    # fully asynchronous control (issue 16)
    "rollout_buffer_delivered_lag_versions": "histogram",
    "rollout_buffer_groups_stale": "counter",
    "rollout_buffer_groups_regenerated": "counter",
    "rollout_buffer_trajectories_requeued": "counter",
    "rollout_buffer_trainer_version": "gauge",
    "rollout_buffer_engine_version": "gauge",
    "rollout_buffer_admission_state": "gauge",
    "rollout_buffer_groups_ahead": "gauge",
}


@pytest.fixture(scope="module")
def sim_engine(tmp_path_factory, qwen_tokenizer_path: str) -> Iterator[Server]:
    # 100 ms per request and 4 trajectories in flight: a 20-trajectory run takes about half a second,
    # long enough to scrape it while it proceeds.
    with start_sim_engine(tmp_path_factory.mktemp("sim"), qwen_tokenizer_path, "--latency-ms", "100") as srv:
        yield srv


@pytest.fixture(scope="module")
def buffer(tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("buffer")
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp / "data"),
            "--generator-path", str(PLUGINS / "edited_reply.py")]
    with running(args, "/healthz", port, tmp / "buffer.log") as srv:
        yield srv


def sim_stats(sim: Server) -> dict:
    return httpx.get(f"{sim.url}/sim/stats", timeout=10).json()


def test_names_follow_prometheus_conventions() -> None:
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.REGISTRY).decode())}
    ours = {name: f for name, f in families.items() if name.startswith("rollout_buffer_")}
    for name, kind in REQUIRED_FAMILIES.items():
        assert name in ours and ours[name].type == kind, name
    for name, family in ours.items():
        assert family.documentation, f"{name} has no help text"
        if family.type == "counter":
            assert all(s.name == f"{name}_total" for s in family.samples), name
        if family.type == "histogram":
            assert name.endswith(("_seconds", "_versions")), name  # the unit, as Prometheus names it
        if family.type == "gauge":
            assert not name.endswith("_total"), name


def test_counts_match_a_run_with_a_failed_trajectory(tmp_path, sim_engine, buffer, qwen_tokenizer_path) -> None:
    before, sim_before = scrape(buffer.url), sim_stats(sim_engine)
    # The first engine request answers 500 and is not retried (nor waited for as an outage): one trajectory fails,
    # its group is dropped.
    httpx.post(f"{sim_engine.url}/sim/faults", json={"next": ["http_500"]}).raise_for_status()
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(5))
    start_run(buffer.url, sim_engine.url, inp, qwen_tokenizer_path, num_process=4, max_retries=0, engine_outage_s=0)

    written, in_flight = [], []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = scrape(buffer.url)
        written.append(sum(value(m, "rollout_buffer_records_written_total", status=s) for s in ("completed", "failed")))
        in_flight.append(value(m, "rollout_buffer_trajectories_in_flight"))
        if value(m, "rollout_buffer_run_progress_ratio") == 1.0 and value(m, "rollout_buffer_ready_groups") == 4:
            break
        time.sleep(0.02)
    status = wait_finished(buffer.url)
    assert written == sorted(written), "counters never go back"
    assert any(0 < w - written[0] < 20 for w in written), "scraped while the run was half done"
    assert 0 < max(in_flight) <= 4 and in_flight[-1] == 0, "num_process bounds what is in flight"

    after, sim_after = scrape(buffer.url), sim_stats(sim_engine)

    def grew(name: str, **labels: str) -> float:
        return delta(after, before, name, **labels)

    requests = sim_after["by_endpoint"]["/generate"] - sim_before["by_endpoint"].get("/generate", 0)
    assert requests == 20
    assert grew("rollout_buffer_records_written_total", status="completed") == 19
    assert grew("rollout_buffer_records_written_total", status="failed") == 1
    assert grew("rollout_buffer_trajectories_failed_total", reason="engine_http_5xx") == 1
    assert grew("rollout_buffer_engine_errors_total", kind="http_5xx") == 1
    assert grew("rollout_buffer_engine_retries_total") == 0
    assert grew("rollout_buffer_engine_request_seconds_count", endpoint="/generate") == requests
    assert grew("rollout_buffer_engine_request_seconds_sum", endpoint="/generate") >= 0.1 * 19
    tokens = sim_after["completion_tokens"] - sim_before["completion_tokens"]
    assert grew("rollout_buffer_tokens_generated_total") == tokens > 0
    assert grew("rollout_buffer_store_write_seconds_count") == 20
    assert grew("rollout_buffer_groups_completed_total") == 5
    assert grew("rollout_buffer_groups_filtered_total", reason="failed_trajectory") == 1
    assert grew("rollout_buffer_tokenization_mismatches_total") == 0
    assert value(after, "rollout_buffer_ready_groups") == 4
    run_id = status["run"]["run_id"]
    assert value(after, "rollout_buffer_run_info", run_id=run_id, task_type="math", state="finished") == 1
    assert value(after, "rollout_buffer_run_planned_trajectories") == 20
    assert value(after, "rollout_buffer_run_done_trajectories") == 19
    assert value(after, "rollout_buffer_run_failed_trajectories") == 1

    # One group leased and left unacked comes back after its lease; then everything is drained and acked.
    first = httpx.post(f"{buffer.url}/get_rollout_data", json={"max_groups": 1, "lease_s": 0.3}).json()
    assert first["success"]
    time.sleep(0.4)
    records = drain(buffer.url)
    done = scrape(buffer.url)
    assert len(records) == 16
    assert delta(done, after, "rollout_buffer_groups_delivered_total") == 5
    assert delta(done, after, "rollout_buffer_groups_redelivered_total") == 1
    assert delta(done, after, "rollout_buffer_records_delivered_total") == 20
    assert delta(done, after, "rollout_buffer_groups_acked_total") == 4
    assert value(done, "rollout_buffer_ready_groups") == 0 and value(done, "rollout_buffer_leased_groups") == 0


def test_retries_abort_resumes_and_mismatches_are_counted(tmp_path, sim_engine, buffer, qwen_tokenizer_path) -> None:
    before, sim_before = scrape(buffer.url), sim_stats(sim_engine)
    # One 500 (retried) and one abort (resumed from its partial output): every trajectory still completes.
    httpx.post(f"{sim_engine.url}/sim/faults", json={"next": ["http_500", "abort"]}).raise_for_status()
    inp = write_jsonl(tmp_path / "prompts.jsonl", [{"instance_id": f"p{i}", "prompt": f"Say {i}."} for i in range(2)])
    start_run(buffer.url, sim_engine.url, inp, qwen_tokenizer_path, task_type="edited_reply", max_retries=2)
    wait_finished(buffer.url)
    records = drain(buffer.url)
    after, sim_after = scrape(buffer.url), sim_stats(sim_engine)

    def grew(name: str, **labels: str) -> float:
        return delta(after, before, name, **labels)

    assert len(records) == 8 and all(r["status"] == "completed" for r in records)
    assert all(r["extra_info"].get("tokenization_mismatch") for r in records)
    assert grew("rollout_buffer_tokenization_mismatches_total") == 8
    assert grew("rollout_buffer_engine_errors_total", kind="http_5xx") == 1
    assert grew("rollout_buffer_engine_retries_total") == 1
    assert grew("rollout_buffer_engine_abort_resumes_total") == 1
    requests = sim_after["by_endpoint"]["/generate"] - sim_before["by_endpoint"]["/generate"]
    assert requests == 10 == grew("rollout_buffer_engine_request_seconds_count", endpoint="/generate")
    tokens = sim_after["completion_tokens"] - sim_before["completion_tokens"]
    assert grew("rollout_buffer_tokens_generated_total") == tokens > 0
    assert grew("rollout_buffer_records_written_total", status="completed") == 8
    assert grew("rollout_buffer_trajectories_failed_total", reason="engine_http_5xx") == 0


def test_metrics_need_the_token_like_every_endpoint_but_healthz(tmp_path) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--auth-token", "s3cret"]
    with running(args, "/healthz", port, tmp_path / "buffer.log") as srv:
        assert httpx.get(f"{srv.url}/metrics").status_code == 401
        assert httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        resp = httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer s3cret"})
        assert httpx.get(f"{srv.url}/healthz").status_code == 200
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {s.name: s.value for f in text_string_to_metric_families(resp.text) for s in f.samples}
    assert samples["rollout_buffer_ready_groups"] == 0 and samples["rollout_buffer_run_progress_ratio"] == 0
    assert "process_resident_memory_bytes" in samples
