"""The protocol shapes slime's own client relies on, pinned without slime (its code runs in
test_slime_conformance.py when SLIME_SRC is set).

What `slime_plugins/rollout_buffer/rollout_buffer_example.py` reads: `/start_rollout` takes its payload with
numbers as strings; `/get_rollout_data` with `{}` answers `{"success", "message", "data": {"data": [records],
"meta_info": {...}}}`, `success` false while nothing is ready (the client sleeps 3 s and asks again); records
have `uid`, `instance_id`, `messages`, `reward`, `extra_info` (with `finish_reason` and `timestamp`, read by
`select_rollout_data` and the Sample status); `meta_info` has `total_samples` and `avg_reward`
(`log_raw_info`) and `finished_groups`, the list of instance ids finished since the last read, which the
client stores and sends back as `skip_instance_ids`. The client groups an answer's records by `instance_id`
alone, so an answer must never carry two groups of one instance.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import httpx
import orjson
from runs import wait_finished
from servers import Server, free_port, running, sim_engine

N = 2


def read(url: str) -> dict:
    """What slime's client sends and checks: POST `{}`, a 2xx answer, JSON."""
    resp = httpx.post(f"{url}/get_rollout_data", json={}, timeout=30)
    resp.raise_for_status()
    return resp.json()


def by_instance(records: list[dict]) -> dict[str, list[dict]]:
    """The records grouped as slime's `select_rollout_data` groups them."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["instance_id"]].append(r)
    return groups


def test_slimes_payload_and_answers_with_two_epochs(tmp_path: Path, qwen_tokenizer_path: str) -> None:
    rows = [{"instance_id": i, "prompt": f"What is {i} + 4? Box it.", "label": str(i + 4)} for i in range(3)]
    data = tmp_path / "math.jsonl"
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    port = free_port()
    with sim_engine(tmp_path, qwen_tokenizer_path) as engine, \
            running(["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")], "/healthz", port,
                    tmp_path / "buffer.log") as buffer:
        url = buffer.url
        empty = read(url)
        assert set(empty) == {"success", "message", "data"} and empty["success"] is False
        assert empty["data"]["data"] == [] and isinstance(empty["data"]["meta_info"], dict)
        # slime's start_rollout payload, as its client builds it: numbers as strings, ids as it stored them.
        payload = {
            "num_process": "4", "num_epoch": "2", "remote_engine_url": engine.url, "remote_buffer_url": url,
            "task_type": "math", "input_file": str(data), "num_repeat_per_sample": str(N), "max_tokens": "256",
            "sampling_params": {"max_tokens": 256, "temperature": 1.0, "top_p": 1.0},
            "tokenizer_path": qwen_tokenizer_path, "skip_instance_ids": [0],
        }
        started = httpx.post(f"{url}/start_rollout", json=payload, timeout=10)
        assert started.status_code == 200 and started.json()["success"] is True
        status = wait_finished(url, timeout_s=60)
        assert status["run"]["config"]["skip_instance_ids"] == ["0"] and status["run"]["progress"]["skipped"] == N
        answers = [read(url) for _ in range(3)]

    # 5 groups are ready (instance 0's first epoch was skipped), two of them per instance 1 and 2: the first
    # answer holds one group per instance, the second the later epochs, the third nothing.
    first, second, third = answers
    assert first["success"] is True and second["success"] is True and third["success"] is False
    for answer, instances in ((first, {"0", "1", "2"}), (second, {"1", "2"})):
        groups = by_instance(answer["data"]["data"])
        assert set(groups) == instances and all(len(g) == N for g in groups.values())
        for r in answer["data"]["data"]:
            assert {"uid", "instance_id", "messages", "reward", "extra_info"} <= set(r)
            assert isinstance(r["instance_id"], str) and isinstance(r["reward"], float)
            assert r["messages"][-1]["role"] == "assistant" and isinstance(r["messages"][-1]["content"], str)
            assert r["extra_info"]["finish_reason"] == "stop" and float(r["extra_info"]["timestamp"]) > 0
        meta = answer["data"]["meta_info"]
        assert meta["total_samples"] == N * len(instances) and isinstance(meta["avg_reward"], float)
    # Every group had finished before the first read: that answer lists all five, once per group.
    meta1, meta2 = first["data"]["meta_info"], second["data"]["meta_info"]
    assert Counter(meta1["finished_groups"]) == Counter({"0": 1, "1": 2, "2": 2})
    assert meta1["finished_groups_count"] == 5
    assert meta2["finished_groups"] == [] and meta2["finished_groups_count"] == 0


def test_an_empty_answer_reports_nothing_it_would_then_lose(buffer_server: Server) -> None:
    url = buffer_server.url

    def write(instance_id: str, contents: list[str]) -> None:
        for k, content in enumerate(contents):
            record = {"uid": f"{instance_id}-{k}", "instance_id": instance_id, "reward": float(k % 2),
                      "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]}
            httpx.post(f"{url}/buffer/write", json=record, timeout=10).raise_for_status()

    write("dropped", ["a", "b", "c", " "])  # an empty answer: slime's validity rule drops the group
    empty = read(url)
    assert empty["success"] is False and empty["data"]["meta_info"]["filtered_groups"] == {}
    write("kept", ["a", "b", "c", "d"])
    meta = read(url)["data"]["meta_info"]
    assert meta["filtered_groups"] == {"empty_response": 1}
    assert meta["finished_groups"] == ["kept"] and meta["finished_groups_count"] == 1
