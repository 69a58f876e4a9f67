"""`rollout-buffer status` and `rollout-buffer export` on real runs, and the documented endpoints vs OpenAPI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from ops_helpers import math_rows, start_run, write_jsonl
from runs import wait_finished
from servers import Server, free_port, running
from servers import sim_engine as start_sim_engine

from rollout_buffer.config import AUTH_TOKEN_ENV
from rollout_buffer.schemas import TrajectoryRecord
from rollout_buffer.tools import export
from rollout_buffer.tools import status as status_cli

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "rollout_buffer"]


@pytest.fixture(scope="module")
def sim_engine(tmp_path_factory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with start_sim_engine(tmp_path_factory.mktemp("sim"), qwen_tokenizer_path, "--latency-ms", "20") as srv:
        yield srv


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, sim_engine: Server, qwen_tokenizer_path: str) -> Iterator[tuple[Server, Path]]:
    """A buffer whose math run finished with one failed trajectory (its group dropped): 4 groups ready."""
    tmp = tmp_path_factory.mktemp("buffer")
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp / "data")]
    with running(args, "/healthz", port, tmp / "buffer.log") as srv:
        httpx.post(f"{sim_engine.url}/sim/faults", json={"next": ["http_500"]}).raise_for_status()
        inp = write_jsonl(tmp / "math.jsonl", math_rows(5))
        start_run(srv.url, sim_engine.url, inp, qwen_tokenizer_path, max_retries=0, engine_outage_s=0)
        wait_finished(srv.url)
        yield srv, tmp / "data"


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`rollout-buffer ARGS` with piped output, 120 columns wide, no URL or token from the environment."""
    env = {k: v for k, v in os.environ.items() if k not in (status_cli.URL_ENV, AUTH_TOKEN_ENV)}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**env, "COLUMNS": "120"})


def read_jsonl(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


# ---- status ------------------------------------------------------------------------------------------


def test_status_prints_the_run_progress_bar_and_counts(finished_run, capsys, monkeypatch) -> None:
    srv, _ = finished_run
    monkeypatch.setenv("COLUMNS", "120")
    status_cli.main(["--url", srv.url])
    out = capsys.readouterr().out
    run_id = httpx.get(f"{srv.url}/status").json()["run"]["run_id"]
    assert f"{run_id}  finished  math" in out
    assert "━" in out and "20/20 trajectories 100%" in out
    assert "done 19  failed 1  skipped 0  in flight 0" in out
    assert "ready 4  filtered 1" in out and "completed 19  failed 1" in out
    assert "failed_trajectory 1" in out and "engine_http_5xx 1" in out


def test_status_watch_until_done_follows_a_run_to_its_end(tmp_path, sim_engine, qwen_tokenizer_path) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"),
            "--generator-path", str(Path(__file__).parent / "plugins" / "broken.py")]
    with running(args, "/healthz", port, tmp_path / "buffer.log") as srv:
        inp = write_jsonl(tmp_path / "math.jsonl", math_rows(8))
        # The engine holds the run until the watcher has shown it once: it refreshes while the run goes on.
        httpx.post(f"{sim_engine.url}/pause_generation", json={"mode": "in_place"}, timeout=10).raise_for_status()
        try:
            run_id = start_run(srv.url, sim_engine.url, inp, qwen_tokenizer_path, num_process=2)
            env = {k: v for k, v in os.environ.items() if k not in (status_cli.URL_ENV, AUTH_TOKEN_ENV)}
            watcher = subprocess.Popen([*CLI, "status", "--url", srv.url, "--watch", "--interval", "0.1",
                                        "--until-done"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env={**env, "COLUMNS": "120"})
            assert watcher.stdout is not None
            first_line = watcher.stdout.readline()
        finally:
            httpx.post(f"{sim_engine.url}/continue_generation", json={}, timeout=10).raise_for_status()
        rest, errors = watcher.communicate(timeout=120)
        watched = subprocess.CompletedProcess(watcher.args, watcher.returncode, first_line + rest, errors)
        # A run whose trajectories all fail fails itself: --until-done says so with exit 1.
        start_run(srv.url, sim_engine.url, inp, qwen_tokenizer_path, task_type="broken", failure_window=4)
        failed = cli("status", "--url", srv.url, "--watch", "--interval", "0.1", "--until-done")
    assert watched.returncode == 0, watched.stderr
    blocks = watched.stdout.strip().split("\n\n")
    assert len(blocks) >= 2, "piped output gets one block per refresh"
    assert f"{run_id}  finished" in blocks[-1] and "32/32 trajectories 100%" in blocks[-1]
    assert failed.returncode == 1 and "  failed  broken" in failed.stdout
    assert "the last 4 trajectories all failed" in failed.stdout and "needs a key" in failed.stdout


def test_status_with_a_token_and_without(tmp_path) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--auth-token", "t0k"]
    with running(args, "/healthz", port, tmp_path / "buffer.log") as srv:
        refused = cli("status", "--url", srv.url)
        allowed = cli("status", "--url", srv.url, "--token", "t0k")
    assert refused.returncode == 2 and "--token" in refused.stderr and "ROLLOUT_BUFFER_AUTH_TOKEN" in refused.stderr
    assert allowed.returncode == 0 and "no run yet" in allowed.stdout
    gone = cli("status", "--url", srv.url)
    assert gone.returncode == 2 and f"cannot reach {srv.url}" in gone.stderr


# ---- export ------------------------------------------------------------------------------------------


def test_export_writes_what_the_trainer_received_while_the_server_runs(finished_run, tmp_path) -> None:
    srv, data_dir = finished_run
    taken = httpx.post(f"{srv.url}/get_rollout_data", json={"max_groups": 2, "lease_s": 60}).json()
    httpx.post(f"{srv.url}/ack", json={"batch_id": taken["data"]["meta_info"]["batch_id"]}).raise_for_status()
    received = taken["data"]["data"]

    delivered = cli("export", "--data-dir", str(data_dir), "--out", str(tmp_path / "delivered.jsonl"))
    everything = cli("export", "--data-dir", str(data_dir), "--out", str(tmp_path / "all.jsonl"), "--all",
                     "--run", "latest")
    failed = cli("export", "--data-dir", str(data_dir), "--out", "-", "--all", "--status", "failed")

    assert delivered.returncode == 0, delivered.stderr
    assert "wrote 8 delivered trajectories" in delivered.stderr
    assert everything.returncode == 0 and "wrote 20 stored trajectories from run-" in everything.stderr
    assert read_jsonl(tmp_path / "delivered.jsonl") == received, "the very records (normalized rewards included)"
    records = read_jsonl(tmp_path / "all.jsonl")
    assert len(records) == 20 and len({r["uid"] for r in records}) == 20
    assert Counter(r["status"] for r in records) == {"completed": 19, "failed": 1}
    for r in records:
        TrajectoryRecord.model_validate(r)
    assert [orjson.loads(line)["status"] for line in failed.stdout.splitlines()] == ["failed"]
    assert "engine_http_5xx" in failed.stdout

    # The server did not notice: the rest is still deliverable and new writes land.
    rest = httpx.post(f"{srv.url}/get_rollout_data", json={"lease_s": 60}).json()
    assert rest["data"]["meta_info"]["num_groups"] == 2
    httpx.post(f"{srv.url}/ack", json={"batch_id": rest["data"]["meta_info"]["batch_id"]}).raise_for_status()
    write = httpx.post(f"{srv.url}/buffer/write",
                       json={"uid": "late-1", "instance_id": "x", "messages": [], "reward": 0.0})
    assert write.status_code == 200
    again = cli("export", "--data-dir", str(data_dir), "--out", str(tmp_path / "delivered.jsonl"))
    assert again.returncode == 0 and len(read_jsonl(tmp_path / "delivered.jsonl")) == 16


def test_export_during_a_run_does_not_disturb_it(tmp_path, sim_engine, qwen_tokenizer_path) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    with running(args, "/healthz", port, tmp_path / "buffer.log") as srv:
        inp = write_jsonl(tmp_path / "math.jsonl", math_rows(10))
        start_run(srv.url, sim_engine.url, inp, qwen_tokenizer_path, num_process=2)
        counts = []
        for i in range(5):
            out = tmp_path / f"snap{i}.jsonl"
            with out.open("wb") as f:
                export.export(tmp_path / "data", f, delivered_only=False)
            counts.append(len(read_jsonl(out)))
        status = wait_finished(srv.url)
    assert counts == sorted(counts) and counts[-1] <= 40
    assert status["run"]["progress"]["done"] == 40, "the run went on undisturbed"


def test_export_errors_name_the_problem_and_leave_no_file(finished_run, tmp_path) -> None:
    _, data_dir = finished_run
    out = tmp_path / "x.jsonl"
    unknown = cli("export", "--data-dir", str(data_dir), "--out", str(out), "--run", "run-nope")
    assert unknown.returncode == 2 and "no run 'run-nope'" in unknown.stderr
    missing = cli("export", "--data-dir", str(tmp_path / "empty"), "--out", str(out))
    assert missing.returncode == 2 and "no store" in missing.stderr
    assert list(tmp_path.iterdir()) == [], "no output and no temporary file"


def test_help_of_each_ops_command_has_examples() -> None:
    for command in ("status", "export"):
        result = cli(command, "--help")
        assert result.returncode == 0 and "examples:" in result.stdout
        assert f"rollout-buffer {command} --" in result.stdout


# ---- docs ------------------------------------------------------------------------------------------


def test_every_endpoint_in_the_docs_exists_in_the_openapi_spec(buffer_server: Server) -> None:
    # The buffer's own API page (other pages name the engines' and the retriever's endpoints).
    api = (ROOT / "docs" / "http-api.md").read_text()
    calls = re.findall(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`\s]*)`", api)
    documented = {(method, path.split("?")[0]) for method, path in calls}
    core = {"/start_rollout", "/get_rollout_data", "/ack", "/buffer/write", "/status", "/trajectories/{uid}"}
    assert core <= {p for _, p in documented}, "the HTTP API table of docs/http-api.md went missing"
    spec = httpx.get(f"{buffer_server.url}/openapi.json").json()
    for method, path in sorted(documented):
        if path in ("/docs", "/openapi.json", "/redoc"):
            assert httpx.get(buffer_server.url + path).status_code == 200, path
            continue
        assert path in spec["paths"], f"docs document {method} {path}; the server has {sorted(spec['paths'])}"
        assert method.lower() in spec["paths"][path], f"{path} does not answer {method}"


def test_every_command_help_has_examples() -> None:
    import subprocess
    import sys

    for command in ("serve", "demo", "sim-engine", "retriever", "status", "export"):
        out = subprocess.run([sys.executable, "-m", "rollout_buffer", command, "--help"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "examples:" in out.stdout and f"rollout-buffer {command}" in out.stdout, command


def test_json_log_lines(tmp_path) -> None:
    import orjson
    from servers import free_port, running

    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "d"), "--log-format", "json"]
    with running(args, "/healthz", port, tmp_path / "log") as srv:
        bad = {"uid": "u", "instance_id": "i", "messages": [], "reward": 1.0}
        httpx.post(f"{srv.url}/buffer/write", json=bad).raise_for_status()
    lines = [line for line in srv.log().splitlines() if line.startswith("{")]
    entries = [orjson.loads(line) for line in lines]
    # The first line says where to look: the URL, the dashboard, the store.
    ready = next(e["message"] for e in entries if e["logger"] == "rollout_buffer.server.app")
    assert f"ready on {srv.url} (dashboard {srv.url}/ui), store in {(tmp_path / 'd').resolve()}" in ready, ready
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)
