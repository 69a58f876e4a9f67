"""`/start_rollout` accepts slime's payload as slime sends it and refuses bad input with a named field."""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson
import pytest
from servers import Server, free_port

from rollout_buffer.schemas import StartRolloutRequest


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    return path


def slime_payload(path: Path, **over: object) -> dict:
    """The payload exactly as slime's agent rollout sends it (note the string group size)."""
    payload = {
        "num_process": 8,
        "num_epoch": 1,
        "remote_engine_url": f"http://127.0.0.1:{free_port()}",
        "remote_buffer_url": "http://127.0.0.1:8889",
        "task_type": "math",
        "input_file": str(path),
        "num_repeat_per_sample": "4",
        "max_tokens": 64,
        "sampling_params": {"max_tokens": 64, "temperature": 0.8, "top_p": 0.9},
        "tokenizer_path": None,
        "skip_instance_ids": [],
        "max_retries": 0,
    }
    payload.update(over)
    return payload


@pytest.fixture
def math_file(tmp_path: Path) -> Path:
    rows = [{"prompt": f"What is {i} + 1?", "label": str(i + 1)} for i in range(3)]
    return write_jsonl(tmp_path / "math.jsonl", rows)


def start(url: str, payload: dict) -> httpx.Response:
    return httpx.post(f"{url}/start_rollout", json=payload, timeout=30)


def test_accepts_slime_payload_with_strings(buffer_server: Server, math_file: Path) -> None:
    resp = start(buffer_server.url, slime_payload(math_file, num_epoch="2", num_process="16"))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["success"] is True and body["run_id"] and body["num_items"] == 3
    run = httpx.get(f"{buffer_server.url}/status").json()["run"]
    assert run["run_id"] == body["run_id"]
    assert run["num_repeat_per_sample"] == 4 and run["num_epoch"] == 2 and run["task_type"] == "math"
    # slime's own extra keys (`max_retries`) are not mistaken for typos; the only warning is the closed engine's.
    assert [w.split(":")[0] for w in body["warnings"]] == ["remote_engine_url"], body["warnings"]


def test_a_misspelled_option_is_kept_but_named_in_a_warning(buffer_server: Server, math_file: Path) -> None:
    """A generator may read any key, so an unknown one is accepted; one spelled like an option most likely left
    that option at its default, and the answer (and the log) says so."""
    # The options generators, sessions and executors read are known too: one of them spelled right is not warned.
    payload = slime_payload(math_file, num_repeats_per_sample=16, sampling_param={"temperature": 0.1},
                            session_ttl=60, session_journal=False, env_workres=4)
    resp = start(buffer_server.url, payload)
    assert resp.status_code == 200, resp.text
    warnings = [w for w in resp.json()["warnings"] if not w.startswith("remote_engine_url:")]  # a closed port
    assert len(warnings) == 4, warnings
    assert warnings[0].startswith("num_repeats_per_sample: not an option of /start_rollout; did you mean "
                                  "num_repeat_per_sample?") and "num_repeat_per_sample stays 4" in warnings[0]
    assert "did you mean sampling_params?" in warnings[1]
    assert "session_ttl: not an option of /start_rollout; did you mean session_ttl_s?" in warnings[2]
    assert "session_ttl_s stays 3600.0" in warnings[2]
    assert "env_workres: not an option of /start_rollout; did you mean env_workers? (kept for the generator; " \
           "env_workers stays 1)" in warnings[3]
    assert httpx.get(f"{buffer_server.url}/status").json()["run"]["num_repeat_per_sample"] == 4
    assert "did you mean num_repeat_per_sample" in buffer_server.log_path.read_text()


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"task_type": "no_such_task"}, "task_type"),
        ({"input_file": "/nonexistent/file.jsonl"}, "input_file"),
        ({"num_epoch": "many"}, "num_epoch"),
        ({"num_repeat_per_sample": 0}, "num_repeat_per_sample"),
        ({"remote_engine_url": "ftp://x"}, "remote_engine_url"),
        ({"remote_engine_url": None}, "remote_engine_url: required"),  # else the run would fail once started
        ({"sampling_params": "hot"}, "sampling_params"),
    ],
)
def test_bad_payload_names_the_field(buffer_server: Server, math_file: Path, change: dict, needle: str) -> None:
    resp = start(buffer_server.url, slime_payload(math_file, **change))
    assert 400 <= resp.status_code < 500
    assert needle in resp.json()["message"]
    assert httpx.get(f"{buffer_server.url}/status").json()["run"] is None


def test_missing_required_field_is_named(buffer_server: Server, math_file: Path) -> None:
    payload = slime_payload(math_file)
    del payload["task_type"]
    resp = start(buffer_server.url, payload)
    assert resp.status_code == 422 and "task_type" in resp.json()["message"]


def test_malformed_line_is_named(buffer_server: Server, tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "1+1", "label": "2"}\n{"prompt": "oops"\n')
    resp = start(buffer_server.url, slime_payload(f))
    assert resp.status_code == 422 and "line 2" in resp.json()["message"]
    f.write_text('{"prompt": "1+1", "label": "2"}\n\n{"prompt": "2+2"}\n')
    resp = start(buffer_server.url, slime_payload(f))
    assert resp.status_code == 422
    assert "line 3" in resp.json()["message"] and "label" in resp.json()["message"]
    f.write_text('[1, 2]\n')
    assert "line 1" in start(buffer_server.url, slime_payload(f)).json()["message"]
    # Ids default to the row's position among rows (blank lines skipped), as the runner numbers them: the third
    # row's default id "1" is taken by an explicit one.
    f.write_text('{"prompt": "1+1", "label": "2"}\n\n{"prompt": "2+2", "label": "4"}\n'
                 '{"prompt": "3+3", "label": "6", "instance_id": "1"}\n')
    resp = start(buffer_server.url, slime_payload(f))
    assert resp.status_code == 422 and "instance_id '1' repeats line 3" in resp.json()["message"]


def test_unreadable_and_empty_input(buffer_server: Server, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert "no tasks" in start(buffer_server.url, slime_payload(empty)).json()["message"]
    folder = tmp_path / "dir.jsonl"
    folder.mkdir()
    resp = start(buffer_server.url, slime_payload(folder))
    assert resp.status_code == 422 and "input_file" in resp.json()["message"]


def test_new_run_replaces_old_and_keeps_its_data(buffer_server: Server, math_file: Path) -> None:
    url = buffer_server.url
    first = start(url, slime_payload(math_file)).json()["run_id"]
    # A complete group of the first run, fed through /buffer/write while it runs.
    for k in range(4):
        rec = {"uid": f"old-{k}", "instance_id": "old", "reward": float(k % 2), "extra_info": {},
               "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
        httpx.post(f"{url}/buffer/write", json=rec).raise_for_status()
    second = start(url, slime_payload(math_file)).json()["run_id"]
    assert second != first
    status = httpx.get(f"{url}/status").json()
    assert status["run"]["run_id"] == second and status["run"]["state"] in ("running", "finished")
    current = httpx.post(f"{url}/get_rollout_data", json={"max_groups": 10}).json()
    assert "old" not in {r["instance_id"] for r in current["data"]["data"]}, "the new run's fetch is its own"
    out = httpx.post(f"{url}/get_rollout_data", json={"max_groups": 10, "run_id": first}).json()
    assert "old" in {r["instance_id"] for r in out["data"]["data"]}


def test_a_near_miss_names_the_value_its_option_keeps() -> None:
    """The payload's own value when it gives the option too; None for a required option it leaves out."""
    req = StartRolloutRequest.model_validate({"task_type": "verifiers", "env_ide": "x", "env_id": "y",
                                              "env_workres": 3})
    assert req.near_misses({"env_id": None, "env_workers": 1}) == [
        "env_ide: not an option of /start_rollout; did you mean env_id? (kept for the generator; env_id stays 'y')",
        "env_workres: not an option of /start_rollout; did you mean env_workers? (kept for the generator; "
        "env_workers stays 1)"]
