"""Task type `verifiers`: environments written with verifiers' own classes (tests/data/verifiers_envs/), run by the
real `verifiers` package from PyPI in a venv of its own, train through sessions on the simulated engine.

The venv is made once at a pinned version, with `uv` for the harness programs verifiers runs, by the buffer's own
venv maker (rollout_buffer/environments/venvs.py): one test names it by its requirements instead."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from environment_venvs import VERIFIERS, VERIFIERS_ENVS
from masks import spans
from runs import drain, wait_finished
from servers import Server, buffer_server, free_port, sim_engine
from sessions import assert_engine_continues, decode_tail

from generators import verifiers_env


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with sim_engine(tmp_path_factory.mktemp("vf-sim"), qwen_tokenizer_path) as srv:
        yield srv


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with buffer_server(tmp_path_factory.mktemp("vf-buffer")) as srv:
        yield srv


def start(buffer: Server, engine: Server, tokenizer: str, python: str | None, env_id: str, **options: Any
          ) -> httpx.Response:
    """A verifiers run of `env_id`, its interpreter `python` (else `env_requirements` in `options`)."""
    interpreter = {"env_python": python} if python is not None else {}
    return httpx.post(f"{buffer.url}/start_rollout", timeout=600, json={
        "task_type": "verifiers", "remote_engine_url": engine.url, "tokenizer_path": tokenizer, **interpreter,
        "env_id": env_id, "env_paths": [str(VERIFIERS_ENVS)], "num_repeat_per_sample": 2, "max_tokens": 4096,
        **options})


def direct_reward(python: str, module: str, task_cls: str, method: str, data: dict[str, Any], reply: str) -> float:
    """The environment's own reward function run directly (in its venv) on a final reply."""
    script = (f"import asyncio, json, sys; sys.path.insert(0, {str(VERIFIERS_ENVS)!r}); import {module} as m\n"
              f"task = m.{task_cls}(m.{task_cls}.__orig_bases__[0].__args__[0](**json.loads(sys.argv[1])))\n"
              "class Trace: last_reply = sys.argv[2]\n"
              f"print(asyncio.run(task.{method}(Trace())))")
    import json
    out = subprocess.run([python, "-c", script, json.dumps(data), reply], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.strip())


def test_a_judged_single_turn_environment_trains_from_its_own_dataset(verifiers_python: str, buffer: Server,
                                                                      engine: Server, qwen_tokenizer_path: str
                                                                      ) -> None:
    # One trajectory a task: the simulated engine answers a repeated prompt anew, so each record's tokens are
    # checked against its own prompt's latest answer.
    # Judged too: verifiers' reference judge, its own endpoint the engine itself (its calls are not training data).
    judge = {"id": "reference", "base_url": f"{engine.url}/v1", "api_key_var": "RB_TEST_JUDGE_KEY", "model": "judge"}
    log_before = len(buffer.log())
    # The venv named by its requirements: the buffer makes it (here it finds the fixture's, made the same way).
    answer = start(buffer, engine, qwen_tokenizer_path, None, "rb_arith", num_repeat_per_sample=1,
                   env_requirements=[VERIFIERS, "uv"], env_config={"agent": {"harness": {"id": "null"}}},
                   env_args={"task": {"judges": [judge]}})
    assert answer.status_code == 200, answer.text
    assert answer.json()["num_items"] == 3  # the taskset's own tasks: no input_file
    status = wait_finished(buffer.url, timeout_s=300)
    # The worker that listed the tasks ran the episodes: the environment was loaded once for the whole run.
    run_log = buffer.log()[log_before:]
    assert "the run goes on with the worker that listed its tasks" in run_log, run_log[-3000:]
    assert len(re.findall(r"verifiers:rb_arith worker \d+ \(pid \d+\) ready", run_log)) == 1, run_log[-3000:]
    assert status["run"]["progress"]["statuses"] == {"completed": 3}, status["run"]["progress"]
    # The environment's reward functions and metrics, averaged for /status and the dashboard.
    assert set(status["run"]["progress"]["metrics"]) == {"correct", "reference", "reply_chars"}
    records = drain(buffer.url)
    assert sorted(r["instance_id"] for r in records) == ["sum-2-3", "sum-4-5", "sum-7-8"]
    assert status["run"]["progress"]["metrics"]["correct"]["mean"] == sum(
        r["extra_info"]["metrics"]["correct"] for r in records) / 3
    for rec in records:
        env = rec["extra_info"]["env"]
        (trace,) = env["traces"]
        correct, judged = trace["rewards"]["correct"]["score"], trace["rewards"]["reference"]["score"]
        assert judged == correct  # the judge's verdict on the same reply, asked of the engine directly
        assert rec["raw_reward"] == trace["reward"] == correct + judged
        assert rec["extra_info"]["branch_turns"] == 1  # the judge's call is not in the session
        reply = rec["messages"][-1]["content"].split("</think>")[-1].strip()  # the client sees no reasoning
        a, b = (int(x) for x in rec["instance_id"].split("-")[1:])
        assert direct_reward(verifiers_python, "rb_arith", "ArithTask", "correct",
                             {"prompt": "p", "answer": str(a + b)}, reply) == correct
        assert trace["metrics"]["reply_chars"] == len(reply)
        trained = spans(rec["loss_mask"])
        assert len(trained) == 1  # one model turn; the prompt (the environment's text) at loss 0
        assert f"What is {a} + {b}?" in decode_tail(rec["tokens"][:trained[0][0]])
        assert "tokenization_mismatch" not in rec["extra_info"]
        assert_engine_continues(engine, rec)


def test_tool_using_environment_runs_commands_between_model_turns(verifiers_python: str, buffer: Server,
                                                                  engine: Server, qwen_tokenizer_path: str) -> None:
    answer = start(buffer, engine, qwen_tokenizer_path, verifiers_python, "rb_shell", num_repeat_per_sample=1)
    assert answer.status_code == 200, answer.text
    status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["statuses"] == {"completed": 2}, status["run"]["progress"]
    for rec in drain(buffer.url):
        n = int(rec["instance_id"].split("-")[1])
        trained = spans(rec["loss_mask"])
        assert len(trained) == 2  # the bash call, then the answer
        between = decode_tail(rec["tokens"][trained[0][1]:trained[1][0]])
        assert f"rb-marker-{n * 7}" in between and "<tool_response>" in between  # the harness ran it: loss 0
        assert rec["raw_reward"] == 1.0 == rec["extra_info"]["env"]["traces"][0]["reward"]
        assert_engine_continues(engine, rec)


def test_a_crashed_worker_is_replaced_and_its_episodes_retried(verifiers_python: str, buffer: Server, engine: Server,
                                                               qwen_tokenizer_path: str, tmp_path: Path) -> None:
    answer = start(buffer, engine, qwen_tokenizer_path, verifiers_python, "rb_faults",
                   env_args={"mode": "crash_once", "flag_dir": str(tmp_path)}, env_max_episodes=1,
                   env_config={"agent": {"harness": {"id": "null"}}})
    assert answer.status_code == 200, answer.text
    status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["statuses"] == {"completed": 4}, status["run"]["progress"]
    records = drain(buffer.url)  # whole groups of two, nothing lost or stored twice
    assert sorted(r["instance_id"] for r in records) == ["fault-0", "fault-0", "fault-1", "fault-1"]
    assert [r["raw_reward"] for r in records] == [0.5] * 4
    assert sorted(r["extra_info"]["env"]["retries"] for r in records) == [0, 0, 1, 1]
    assert "exited with code 3" in buffer.log()


@pytest.mark.parametrize(("mode", "kind", "options"), [
    ("sleep", "env_timeout", {"env_timeout_s": 3}),
    ("raise", "env_error", {}),
])
def test_time_limits_and_environment_errors_are_recorded_failed(verifiers_python: str, buffer: Server, engine: Server,
                                                                qwen_tokenizer_path: str, mode: str, kind: str,
                                                                options: dict[str, Any]) -> None:
    answer = start(buffer, engine, qwen_tokenizer_path, verifiers_python, "rb_faults", num_repeat_per_sample=1,
                   env_args={"mode": mode}, env_config={"agent": {"harness": {"id": "null"}}}, **options)
    assert answer.status_code == 200, answer.text
    status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["failures"] == {kind: 2}, status["run"]["progress"]
    assert httpx.get(f"{buffer.url}/healthz", timeout=10).status_code == 200


def test_an_environment_that_cannot_load_is_refused_naming_the_option(verifiers_python: str, buffer: Server,
                                                                      engine: Server, qwen_tokenizer_path: str,
                                                                      tmp_path: Path) -> None:
    missing = start(buffer, engine, qwen_tokenizer_path, verifiers_python, "rb_no_such_env")
    assert missing.status_code == 422 and "env_id" in missing.text and "rb_no_such_env" in missing.text, missing.text
    not_python = start(buffer, engine, qwen_tokenizer_path, str(tmp_path / "no" / "bin" / "python"), "rb_arith")
    assert not_python.status_code == 422 and "env_python" in not_python.text, not_python.text
    no_verifiers = start(buffer, engine, qwen_tokenizer_path, sys.executable, "rb_arith")
    assert no_verifiers.status_code == 422 and "env_python" in no_verifiers.text, no_verifiers.text
    # The interpreter lies where another user cannot run it (or the buffer is not root): named, before anything runs.
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "python").symlink_to(verifiers_python)
    other_user = start(buffer, engine, qwen_tokenizer_path, str(private / "python"), "rb_arith", env_user="nobody")
    assert other_user.status_code == 422 and "env_user" in other_user.text, other_user.text
    both = start(buffer, engine, qwen_tokenizer_path, verifiers_python, "rb_arith", env_requirements=["x"])
    assert both.status_code == 422 and "env_python" in both.text, both.text
    uninstallable = start(buffer, engine, qwen_tokenizer_path, None, "rb_arith",
                          env_requirements=["rollout-buffer-no-such-package==0.0.1"])
    assert uninstallable.status_code == 422 and "env_requirements" in uninstallable.text, uninstallable.text


def test_an_environment_is_an_eval_dataset(verifiers_python: str, buffer: Server, engine: Server,
                                           qwen_tokenizer_path: str) -> None:
    answer = start(buffer, engine, qwen_tokenizer_path, verifiers_python, "rb_shell", num_repeat_per_sample=1)
    assert answer.status_code == 200, answer.text
    wait_finished(buffer.url, timeout_s=300)
    drain(buffer.url)
    # Beside the training run's environment, another one evaluated: its own taskset, no file.
    log_before = len(buffer.log())
    evaluated = httpx.post(f"{buffer.url}/start_eval", timeout=120, json={
        "current_version": 3, "n_samples_per_eval_prompt": 2,
        "eval_datasets": {"arith": {"options": {"env_id": "rb_arith", "env_config": {"agent": {"harness": {
            "id": "null"}}}}}}})
    assert evaluated.status_code == 200, evaluated.text
    out = httpx.post(f"{buffer.url}/eval_results", timeout=330,
                     json={"version": 3, "wait_s": 300, "records": True}).json()
    arith = out["results"]["arith"]
    assert (arith["state"], arith["samples"], arith["expected_samples"]) == ("finished", 6, 6), arith
    # The evaluation ran on the worker that listed its taskset.
    assert "verifiers:rb_arith: the run goes on with the worker that listed its tasks" in buffer.log()[log_before:]
    assert sorted({r["instance_id"] for r in arith["records"]}) == ["sum-2-3", "sum-4-5", "sum-7-8"]
    for rec in arith["records"]:
        assert rec["reward"] == rec["extra_info"]["env"]["traces"][0]["reward"]  # evals store rewards as given
    missing = httpx.post(f"{buffer.url}/start_eval", timeout=60, json={
        "current_version": 4, "task_type": "math", "eval_datasets": {"m": {"max_tokens": 64}}})
    assert missing.status_code == 422 and "path" in missing.text, missing.text


def test_a_run_resumes_after_kill_9_and_its_workers_do_not_outlive_the_buffer(
        verifiers_python: str, engine: Server, qwen_tokenizer_path: str, tmp_path: Path) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    srv = Server(args, "/healthz", port, tmp_path / "buffer.log").start()
    try:
        answer = start(srv, engine, qwen_tokenizer_path, verifiers_python, "rb_shell", env_max_episodes=1)
        assert answer.status_code == 200, answer.text
        deadline = time.monotonic() + 120
        while httpx.get(f"{srv.url}/status", timeout=10).json()["run"]["progress"]["done"] < 1:
            assert time.monotonic() < deadline, "no episode finished"
            time.sleep(0.1)
        assert srv.proc is not None
        workers = worker_processes(srv.proc.pid)
        assert workers, "the run's worker is running"
        srv.kill9()
        deadline = time.monotonic() + 30
        while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers):
            assert time.monotonic() < deadline, "the worker outlived the buffer"
            time.sleep(0.1)
        srv = Server(args, "/healthz", port, tmp_path / "buffer.log").start()  # resumes the run
        status = wait_finished(srv.url, timeout_s=300)
        assert status["run"]["progress"]["failed"] == 0, status["run"]["progress"]
        records = drain(srv.url)
        assert sorted(r["instance_id"] for r in records) == ["echo-6", "echo-6", "echo-7", "echo-7"]
        assert len({r["uid"] for r in records}) == 4
    finally:
        srv.stop()


def worker_processes(buffer_pid: int) -> list[psutil.Process]:
    """The buffer's verifiers workers."""
    return [p for p in psutil.Process(buffer_pid).children(recursive=True)
            if any("verifiers_worker.py" in part for part in p.cmdline())]


def test_attempts_scored_against_each_other_keep_their_own_rewards(verifiers_python: str, buffer: Server,
                                                                   engine: Server, qwen_tokenizer_path: str) -> None:
    # verifiers' best-of-n env: two attempts an episode, `finalize` compares them (`best`); each attempt is its own
    # record, with its own reward, told apart by the trace id verifiers sends with each of its requests.
    answer = start(buffer, engine, qwen_tokenizer_path, verifiers_python, "rb_arith", num_repeat_per_sample=1,
                   env_config={"id": "best-of-n", "n": 2, "agent": {"harness": {"id": "null"}}})
    assert answer.status_code == 200, answer.text
    status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["statuses"] == {"completed": 6}, status["run"]["progress"]
    records = drain(buffer.url)
    assert len(records) == 6 and len({r["uid"] for r in records}) == 6
    for instance in ("sum-2-3", "sum-4-5", "sum-7-8"):
        pair = [r for r in records if r["instance_id"] == instance]
        traces = {t["id"]: t for t in pair[0]["extra_info"]["env"]["traces"]}
        assert len(pair) == 2 and {r["extra_info"]["lane"] for r in pair} == set(traces)
        top = max(t["reward"] for t in traces.values())
        for rec in pair:
            trace = traces[rec["extra_info"]["lane"]]
            assert rec["raw_reward"] == trace["reward"]
            reply = rec["messages"][-1]["content"].split("</think>")[-1].strip()
            a, b = (int(x) for x in instance.split("-")[1:])
            assert trace["reward"] == float(f"\\boxed{{{a + b}}}" in reply)  # this attempt's own answer
            assert trace["metrics"]["best"] == float(trace["reward"] == top)


def test_seats_are_role_streams_and_untrained_seats_leave_no_record(verifiers_python: str, buffer: Server,
                                                                     engine: Server, qwen_tokenizer_path: str
                                                                     ) -> None:
    seats = {seat: {"harness": {"id": "null"}} for seat in ("solver", "checker", "observer")}
    answer = start(buffer, engine, qwen_tokenizer_path, verifiers_python, "rb_duo", num_repeat_per_sample=1,
                   env_config=seats)
    assert answer.status_code == 200, answer.text
    status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["statuses"] == {"completed": 6}, status["run"]["progress"]
    for role in ("solver", "checker"):  # each seat is a trainer's stream of its own
        out = httpx.post(f"{buffer.url}/get_rollout_data", timeout=30, json={"agent_id": role}).json()
        records = out["data"]["data"]
        assert sorted(r["instance_id"] for r in records) == ["sum-2-3", "sum-4-5", "sum-7-8"], out
        for rec in records:
            info = rec["extra_info"]
            trace = next(t for t in info["env"]["traces"] if t["id"] == info["lane"])
            assert info["agent_id"] == trace["agent"] == role and rec["raw_reward"] == trace["reward"]
            assert {t["agent"]: t["trainable"] for t in info["env"]["traces"]} == {
                "solver": True, "checker": True, "observer": False}


def test_an_environment_without_a_reward_is_recorded_failed(verifiers_python: str, buffer: Server, engine: Server,
                                                            qwen_tokenizer_path: str) -> None:
    answer = start(buffer, engine, qwen_tokenizer_path, verifiers_python, "rb_unscored", num_repeat_per_sample=1,
                   env_config={"agent": {"harness": {"id": "null"}}})
    assert answer.status_code == 200, answer.text
    status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["failures"] == {"env_reward": 1}, status["run"]["progress"]
    assert "no reward function or judge ran" in buffer.log()


def test_a_truncated_episode_is_recorded_truncated(verifiers_python: str, buffer: Server, engine: Server,
                                                   qwen_tokenizer_path: str) -> None:
    # A token budget the reply cannot fit in: the model's turn is cut, verifiers sees `length`, the record says so.
    answer = start(buffer, engine, qwen_tokenizer_path, verifiers_python, "rb_arith", num_repeat_per_sample=1,
                   max_tokens=8, env_config={"agent": {"harness": {"id": "null"}}})
    assert answer.status_code == 200, answer.text
    status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["statuses"] == {"truncated": 3}, status["run"]["progress"]
    for rec in drain(buffer.url):
        (trace,) = rec["extra_info"]["env"]["traces"]
        assert rec["status"] == "truncated" and rec["extra_info"]["finish_reason"] == "length"
        assert trace["truncated"] and trace["reward"] == rec["raw_reward"]


def test_a_server_runs_only_environments_its_operator_allowed(verifiers_python: str, engine: Server,
                                                               qwen_tokenizer_path: str, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with buffer_server(tmp_path, "--data-root", str(root), "--allow-code", str(root), trusting=False) as srv:
        outside = start(srv, engine, qwen_tokenizer_path, verifiers_python, "rb_arith")
        assert outside.status_code == 403 and "env_python" in outside.text and "--allow-code" in outside.text
        installing = start(srv, engine, qwen_tokenizer_path, None, "rb_arith", env_requirements=[VERIFIERS])
        assert installing.status_code == 403 and "--allow-installs" in installing.text, installing.text


def test_a_listing_worker_no_run_adopts_is_stopped(verifiers_python: str, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    # A run on Ray actors (their own pools): the listing's worker stops once it has listed. A start that failed
    # after the listing: the worker and its scratch folder go once the wait is over.
    monkeypatch.setattr(verifiers_env, "_PARK_S", 0.5)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    payload = {"env_python": verifiers_python, "env_id": "rb_arith", "env_paths": [str(VERIFIERS_ENVS)]}

    def workers() -> set[int]:
        return {p.pid for p in psutil.Process().children(recursive=True)}

    def scratch_folders() -> list[Path]:  # in this process's own folder (processes.scratch_folder)
        return list(tmp_path.glob("rb-scratch-*/rb-env-*"))

    async def scenario() -> None:
        before = workers()
        assert len(await verifiers_env.default_input(payload, False)) == 3
        assert workers() <= before and scratch_folders() == []
        rows = await verifiers_env.default_input(payload, True)
        assert sorted(r["instance_id"] for r in rows) == ["sum-2-3", "sum-4-5", "sum-7-8"]
        (waiting,) = workers() - before
        assert len(scratch_folders()) == 1, "the waiting worker's folder"
        for _ in range(100):
            if not scratch_folders() and not psutil.pid_exists(waiting):
                break
            await asyncio.sleep(0.1)
        assert not scratch_folders() and not psutil.pid_exists(waiting)

    asyncio.run(scenario())


def test_a_listing_worker_waiting_for_its_run_leaves_no_folder_when_the_server_stops(
        verifiers_python: str, tmp_path: Path) -> None:
    # The buffer stops (its interpreter exits) while the listing's pool waits for its run to adopt it.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    script = ("import asyncio, pathlib, sys, tempfile; from generators import verifiers_env; "
              "rows = asyncio.run(verifiers_env.default_input({'env_python': sys.argv[1], 'env_id': 'rb_arith', "
              "'env_paths': [sys.argv[2]]}, True)); "
              "print(len(rows), len(list(pathlib.Path(tempfile.gettempdir()).glob('rb-scratch-*/rb-env-*'))))")
    done = subprocess.run([sys.executable, "-c", script, verifiers_python, str(VERIFIERS_ENVS)], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parent.parent,
                          env={**os.environ, "TMPDIR": str(scratch)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "1"], "the listing's pool, with its folder, waited when the process ended"
    assert list(scratch.iterdir()) == []
