"""The buffer against the real SGLang engine on this CPU (`real_sglang/`: SGLang 0.5.23 on tiny float32 Qwen3
checkpoints), directly and through the real sglang-router: a native math run, the demo, the OpenAI chat, Responses
and Anthropic session endpoints with the official clients (a tool round trip among their turns), and a run whose
weights are updated mid-trajectory and whose trainer then moves past a staleness bound. Its venv also runs the
pinned slime's multimodal prompt path (transformers' Qwen-VL processor needs its torchvision) against a vision
run's records.

Every record of every path is checked against the trainer: a transformers float32 forward of the checkpoint that
generated each token (per weight-version segment) over the record's `tokens` gives, at every loss-1 position, the
log-prob the record holds. The tolerance is 1e-4: the engine and the forward compute the same float32 model and
differ only in kernels (SGLang's native attention against transformers' eager one, another order of the sums),
which measured 1.2e-5 at most; a record whose tokens or mask are off by one position is off by several nats
(checked below, so the check itself is checked)."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from demo_cli import run_demo
from runs import drain, math_rows, start, wait_finished, write_jsonl
from servers import buffer_server, free_port, session_host, sglang_router, sim_engine, stop_process
from sessions import ANTHROPIC_TOOLS, OPENAI_TOOLS, finish, open_session, record
from slime_src import SLIME_SRC, needs_slime_src

from rollout_buffer.engine.weight_watch import probe_body
from rollout_buffer.tokens.tokenizer import load_tokenizer

# The first test builds the SGLang venv when it is not cached (5 minutes, more on a slow index) and starts SGLang;
# the engine-restart test starts it again. Every wait inside is bounded on its own.
pytestmark = pytest.mark.timeout(2400)
ROOT = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("RB_REAL_SGLANG_HOME", Path.home() / ".cache" / "rollout-buffer" / "real-sglang"))
TOLERANCE = 1e-4
READY_S = 420  # measured 109–155 s on two quiet cores
A, B = "tiny-qwen3-a", "tiny-qwen3-b"
VLM = "tiny-qwen2.5-vl"
# The checkpoint behind each weight version the tests give the engine ("default": before its first update).
CHECKPOINT_OF = {"default": A, "1": B, "2": A}


@pytest.fixture(scope="module")
def build() -> Path:
    """The venv and checkpoints of `real_sglang/setup.sh` (built the first time, then cached)."""
    done = subprocess.run(["bash", str(ROOT / "real_sglang" / "setup.sh")], capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return (BUILD / "current").resolve()


@dataclass
class RealEngine:
    """The module's SGLang: where it serves, its log folder, and its process (another one once restarted)."""

    port: int
    folder: Path
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def real_engine(build: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealEngine]:
    """Real SGLang serving checkpoint A on a free port, until the module's tests are done."""
    port, folder = free_port(), tmp_path_factory.mktemp("real-sglang")
    running = RealEngine(port, folder, start_sglang(build, folder, port))
    try:
        yield running
    finally:
        stop_process(running.proc)


@pytest.fixture(scope="module")
def engine(real_engine: RealEngine) -> str:
    return real_engine.url


def start_sglang(build: Path, folder: Path, port: int, model: str = A) -> subprocess.Popen[bytes]:
    """Real SGLang serving `model` (checkpoint A) on `port`, its log and IPC sockets in `folder`, once it answers
    /health."""
    log = folder / "sglang.log"
    command = [str(build / "venv" / "bin" / "python"), "-m", "sglang.launch_server", "--model-path",
               str(build / "models" / model), "--device", "cpu", "--dtype", "float32",
               "--attention-backend", "torch_native", "--disable-overlap-schedule", "--max-total-tokens", "8192",
               "--mem-fraction-static", "0.05", "--host", "127.0.0.1", "--port", str(port),
               "--sleep-on-idle"]  # its scheduler otherwise spins a core between requests
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "2",
                                     "TMPDIR": str(folder)})
    deadline = time.monotonic() + READY_S
    while True:  # /health answers 503 until SGLang's own warm-up request is done
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise AssertionError(f"SGLang not ready (exit {proc.returncode}): {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)


@pytest.fixture(scope="module")
def router(build: Path, engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real sglang-router (from the same venv) in front of the engine."""
    log = tmp_path_factory.mktemp("real-router") / "router.log"
    # Real SGLang's /health generates a token: on loaded cores it can take longer than the router's 5 s default.
    with sglang_router([engine], log, "--health-check-timeout-secs", "60",
                       python=str(build / "venv" / "bin" / "python")) as running:
        yield running.url


@pytest.fixture
def engine_a(engine: str, build: Path) -> str:
    """The engine serving checkpoint A as version "default" (as it started), whatever a test before left."""
    if httpx.get(f"{engine}/get_model_info", timeout=10).json()["weight_version"] != "default":
        update_weights(engine, build / "models" / A, "default")
    return engine


def update_weights(engine: str, model: Path, version: str, pause: str = "abort", **load: Any) -> None:
    """What slime does around a weight update: pause (aborting in-flight requests), load, continue."""
    httpx.post(f"{engine}/pause_generation", json={"mode": pause}, timeout=30).raise_for_status()
    loaded = httpx.post(f"{engine}/update_weights_from_disk", timeout=60,
                        json={"model_path": str(model), "weight_version": version, **load})
    assert loaded.status_code == 200 and loaded.json()["success"], loaded.text
    httpx.post(f"{engine}/continue_generation", json={}, timeout=30).raise_for_status()


def trainer_logprobs(build: Path, model: str, sequences: list[list[int]], temperature: float = 1.0,
                     images: list[list[str]] | None = None) -> list[list[float]]:
    """Each sequence's log-probs from a transformers float32 forward at the sampling temperature, with each
    sequence's `images` (base64) for a vision checkpoint (`real_sglang/forward_logprobs.py`)."""
    request: dict[str, Any] = {"model": model, "sequences": sequences, "temperature": temperature}
    if images is not None:
        request["images"] = images
    done = subprocess.run([str(build / "venv" / "bin" / "python"), str(ROOT / "real_sglang" / "forward_logprobs.py")],
                          input=json.dumps(request), capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    result: list[list[float]] = json.loads(done.stdout)
    return result


def trained_positions(record: dict[str, Any], mid_request: bool = False) -> Iterator[tuple[int, float, str]]:
    """(position in `tokens`, log-prob held, weight version) of each loss-1 token of a record: those generated over
    a cache of their own weights, or (`mid_request`) those generated after the weights changed within their
    request, over a cache of older ones (`extra_info.mid_request_update_spans`)."""
    prompt = len(record["tokens"]) - record["response_length"]
    response_mask = record["loss_mask"][-record["response_length"]:]  # `loss_mask` is as long as `tokens`
    spans = record["extra_info"]["weight_version_spans"]
    marked = record["extra_info"].get("mid_request_update_spans", [])
    for k, (mask, logprob) in enumerate(zip(response_mask, record["rollout_log_probs"], strict=True)):
        position = prompt + k
        if mask and any(start <= position < end for start, end, _ in marked) == mid_request:
            yield position, logprob, next(str(v) for start, end, v in spans if start <= position < end)


def assert_trainers_logprobs(build: Path, records: list[dict[str, Any]], temperature: float = 1.0
                             ) -> dict[str, list[list[float]]]:
    """Every loss-1 log-prob of every record equals the forward of the checkpoint its weight version names (at the
    run's sampling temperature), within TOLERANCE; a failure names the first position off and the text before it.
    Returns the forwards, by checkpoint."""
    assert records
    checkpoints = {CHECKPOINT_OF[v] for r in records for *_, v in trained_positions(r)}
    forward = {c: trainer_logprobs(build, str(build / "models" / c), [r["tokens"] for r in records], temperature)
               for c in checkpoints}
    tokenizer = load_tokenizer(str(build / "models" / A))
    for i, rec in enumerate(records):
        assert len(rec["loss_mask"]) == len(rec["tokens"])
        assert sum(rec["loss_mask"]) > 0 and len(rec["rollout_log_probs"]) == rec["response_length"]
        for position, logprob, version in trained_positions(rec):
            expected = forward[CHECKPOINT_OF[version]][i][position - 1]
            assert abs(logprob - expected) <= TOLERANCE, (
                f"{rec['uid']} token {position} (version {version}): the record holds {logprob:.5f}, the trainer "
                f"computes {expected:.5f}; at {tokenizer.decode(rec['tokens'][position:position + 1])!r} after "
                f"{tokenizer.decode(rec['tokens'][max(0, position - 12):position])!r}")
    return forward


def shifted_difference(record: dict[str, Any], forward: list[float]) -> float:
    """The largest |record − forward| over the loss-1 tokens when the record's log-probs are read one token
    along, as a mistake of alignment would."""
    return max(abs(logprob - forward[position]) for position, logprob, _ in trained_positions(record)
               if position + 1 < len(record["tokens"]))


def mid_generation(engine: str, requests: int) -> None:
    """Wait until the engine runs `requests` requests and has generated some tokens of each (SGLang's own load
    report), so that an update comes mid-trajectory."""
    def load() -> dict[str, Any]:
        found: dict[str, Any] = httpx.get(f"{engine}/v1/loads", timeout=10).json()["loads"][0]
        return found

    running = wait_until(lambda: (lambda now: now if now["num_running_reqs"] == requests else None)(load()), 300,
                         f"{requests} requests never ran")
    wait_until(lambda: load()["num_used_tokens"] >= running["num_used_tokens"] + 4 * requests, 300,
               "the requests made no progress")


def wait_until(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return found


@pytest.fixture(params=["direct", "router"])
def generating(request: pytest.FixtureRequest, engine_a: str) -> str:
    """Where a run sends its generation: the engine itself, or the router in front of it."""
    return engine_a if request.param == "direct" else str(request.getfixturevalue("router"))


def test_a_math_run_has_the_trainers_log_probs(generating: str, build: Path, tmp_path: Path) -> None:
    model = str(build / "models" / A)
    with buffer_server(tmp_path, "--data-root", str(build)) as buffer:
        start(buffer.url, generating, write_jsonl(tmp_path / "math.jsonl", math_rows(4)), model,
              num_repeat_per_sample=2, num_process=4, max_tokens=24)
        status = wait_finished(buffer.url, timeout_s=600)
        assert status["run"]["progress"]["failed"] == 0, status
        records = drain(buffer.url)
    assert len(records) == 8 and {r["instance_id"] for r in records} == {f"m{i}" for i in range(4)}
    # A random model's answer runs to max_tokens or stops at its end-of-turn token: either is kept whole. Its
    # random tokens do not survive decoding and encoding again, which the record notes
    # (`tokenization_mismatch`); what it trains on are the engine's tokens.
    assert {r["status"] for r in records} <= {"completed", "truncated"}
    assert {v for r in records for *_, v in trained_positions(r)} == {"default"}
    forward = assert_trainers_logprobs(build, records)[A]
    # The check sees a record off by one token: its log-probs are then those of other tokens.
    assert all(shifted_difference(r, f) > 1.0 for r, f in zip(records, forward, strict=True))


def test_the_demo_through_the_router(router: str, engine_a: str, build: Path, tmp_path: Path) -> None:
    rows = run_demo("--engine-url", router, "--tokenizer", str(build / "models" / A),
                    "--input", str(write_jsonl(tmp_path / "math.jsonl", math_rows(3))), "--num-repeat", "2",
                    "--batch-groups", "3", "--max-tokens", "16", "--data-dir", str(tmp_path / "demo"))
    assert rows["groups delivered"] == "3" and rows["samples"] == "6" and rows["failed trajectories"] == "0"
    exported = subprocess.run(["rollout-buffer", "export", "--data-dir", str(tmp_path / "demo"), "--out", "-"],
                              capture_output=True, text=True, timeout=60, check=True).stdout
    records = [json.loads(line) for line in exported.splitlines()]
    assert len(records) == 6
    assert_trainers_logprobs(build, records, temperature=0.8)  # the demo's


def test_session_endpoints_with_the_official_clients(engine_a: str, build: Path, tmp_path: Path) -> None:
    """Several turns with each wire format, greedy, 12 tokens a turn. The chat and Anthropic sessions bring a tool
    call and its result in their history (a random model calls no tool itself) and stop each reply at a stop
    string, so their turns end whole and go on in one record; a reply cut by its token cap cannot be continued
    (the engine never closed it), so each Responses turn after one starts a branch of its own."""
    model = str(build / "models" / A)
    with session_host(tmp_path, engine_a, model, "--data-root", str(build), max_tokens=400) as buffer:
        uids = {"chat": chat_session(buffer.url), "responses": responses_session(buffer.url),
                "anthropic": anthropic_session(buffer.url)}
        records = {name: [record(buffer.url, uid) for uid in found] for name, found in uids.items()}
    assert [len(found) for found in records.values()] == [1, 2, 1], records
    assert (records["chat"][0]["extra_info"]["turns"], records["anthropic"][0]["extra_info"]["turns"]) == (3, 2)
    assert {name: found[0]["extra_info"]["protocols"] for name, found in records.items()} \
        == {"chat": ["openai"], "responses": ["responses"], "anthropic": ["anthropic"]}
    assert_trainers_logprobs(build, [r for found in records.values() for r in found])


def chat_session(buffer: str) -> list[str]:
    session = open_session(buffer, "chat")
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages: list[Any] = [
        {"role": "system", "content": "You are careful."}, {"role": "user", "content": "What is 12 * 7 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": "12 * 7 + 3"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "87"}]
    request: dict[str, Any] = {"model": "m", "tools": OPENAI_TOOLS, "max_tokens": 12, "temperature": 0,
                               "stop": ["e"]}
    for turn, stream in enumerate((False, True, False)):
        if stream:
            chunks = client.chat.completions.create(messages=messages, stream=True, **request)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = client.chat.completions.create(messages=messages, **request).choices[0].message.content or ""
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then? ({turn})"}]
    return [str(uid) for uid in finish(buffer, session, 1.0)["uids"]]


def responses_session(buffer: str) -> list[str]:
    session = open_session(buffer, "responses")
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    first = client.responses.create(model="m", instructions="You are careful.", input="What is 45 - 6?",
                                    max_output_tokens=12, temperature=0)
    client.responses.create(model="m", previous_response_id=first.id, input="Are you sure?", max_output_tokens=12,
                            temperature=0)
    return [str(uid) for uid in finish(buffer, session, 0.5)["uids"]]


def anthropic_session(buffer: str) -> list[str]:
    session = open_session(buffer, "anthropic")
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    messages: list[Any] = [
        {"role": "user", "content": "What is 45 - 6?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calculator",
                                           "input": {"expression": "45 - 6"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "39"}]}]
    for turn in range(2):
        reply = client.messages.create(model="m", max_tokens=12, stop_sequences=["e"], extra_body={"temperature": 0},
                                       system="You are careful.", messages=messages, tools=ANTHROPIC_TOOLS)
        messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                     {"role": "user", "content": f"And then? ({turn})"}]
    return [str(uid) for uid in finish(buffer, session, 0.0)["uids"]]


def test_weights_updated_mid_run_then_a_staleness_bound(engine_a: str, router: str, build: Path,
                                                         tmp_path: Path) -> None:
    """As slime runs it: generation through the router, weight updates to the engine itself. Trajectories aborted
    by an update resume from their partial tokens on the new weights, each segment's log-probs those of its own
    checkpoint; then a run bounded to η = 0 drops the groups one version behind the trainer and generates them
    again on the engine's new version."""
    with buffer_server(tmp_path, "--data-root", str(build)) as buffer:
        start(buffer.url, router, write_jsonl(tmp_path / "math.jsonl", math_rows(4)), str(build / "models" / A),
              num_repeat_per_sample=2, num_process=8, max_tokens=64)
        mid_generation(engine_a, requests=8)
        update_weights(engine_a, build / "models" / B, "1")
        status = wait_finished(buffer.url, timeout_s=600)
        assert status["run"]["progress"]["failed"] == 0, status
        updated = drain(buffer.url)
        assert len(updated) == 8
        spanning = [r for r in updated if {v for *_, v in trained_positions(r)} == {"default", "1"}]
        assert spanning, [r["extra_info"]["weight_version_spans"] for r in updated]
        assert all(r["extra_info"]["abort_resumes"] >= 1 for r in spanning)
        assert_trainers_logprobs(build, updated)

        # η = 0: the two groups admitted at version 1 wait; the engine moves to version 2 and so does the trainer.
        start(buffer.url, router, write_jsonl(tmp_path / "bounded.jsonl", math_rows(2)), str(build / "models" / A),
              num_repeat_per_sample=2, num_process=4, max_tokens=8, max_staleness=0, rollout_batch_size=2,
              current_version=1, regenerate_stale=True)
        wait_until(lambda: httpx.get(f"{buffer.url}/status", timeout=10).json()["groups"].get("ready") == 2, 300,
                   "the bounded run's groups did not complete")
        update_weights(engine_a, build / "models" / A, "2")
        regenerated, stale, deadline = [], 0, time.monotonic() + 300
        while len(regenerated) < 4:  # a read answers once one group is ready: the second may come in the next
            assert time.monotonic() < deadline, f"regenerated {len(regenerated)} of 4 trajectories"
            fetched = httpx.post(f"{buffer.url}/get_rollout_data", timeout=300, json={
                "current_version": 2, "max_groups": 2, "wait_s": 60, "lease_s": 60}).json()["data"]
            stale += fetched["meta_info"]["stale_groups"]
            regenerated += fetched["data"]
        assert stale == 2
    assert len(regenerated) == 4
    assert {v for r in regenerated for *_, v in trained_positions(r)} == {"2"}
    assert_trainers_logprobs(build, regenerated)


def test_an_update_within_a_request_is_marked_in_the_record(engine_a: str, build: Path, tmp_path: Path) -> None:
    """The unsafe update: under an in-place pause (and `flush_cache: false`, without which SGLang refuses to load
    while requests are held) the held requests go on with checkpoint B over the KV cache checkpoint A computed.
    SGLang's answer then spans two versions within one request, and the record marks the tokens after the change
    (`mid_request_update_spans`): their log-probs are no checkpoint's (B's forward over the same tokens is far
    from them), while the tokens before them are A's exactly."""
    with buffer_server(tmp_path, "--data-root", str(build)) as buffer:
        start(buffer.url, engine_a, write_jsonl(tmp_path / "math.jsonl", math_rows(2)), str(build / "models" / A),
              num_repeat_per_sample=2, num_process=4, max_tokens=64)
        mid_generation(engine_a, requests=4)
        update_weights(engine_a, build / "models" / B, "1", pause="in_place", flush_cache=False)
        status = wait_finished(buffer.url, timeout_s=600)
        assert status["run"]["progress"]["failed"] == 0, status
        records = drain(buffer.url)
    marked = [r for r in records if r["extra_info"].get("mid_request_update_spans")]
    assert marked and all(r["extra_info"]["abort_resumes"] == 0 for r in records), "held, not aborted"
    assert {v for r in marked for *_, v in r["extra_info"]["mid_request_update_spans"]} == {"1"}
    assert_trainers_logprobs(build, records)  # every token but the marked ones
    forward = trainer_logprobs(build, str(build / "models" / B), [r["tokens"] for r in marked])
    for rec, logprobs in zip(marked, forward, strict=True):
        gaps = [abs(logprob - logprobs[position - 1]) for position, logprob, _ in trained_positions(rec, True)]
        assert max(gaps) > 1e-2, f"{rec['uid']}: B's forward gives the marked tokens' log-probs ({max(gaps)})"


def test_weights_swapped_without_a_version_are_noticed(engine_a: str, build: Path, tmp_path: Path) -> None:
    """`/update_weights_from_disk` without `weight_version` swaps the real engine's weights and keeps its version:
    the run's weight watch sees its probe's log-probs move under the same version. The versioned load back to A
    after it (a new version) is not taken for one."""
    with buffer_server(tmp_path, "--data-root", str(build)) as buffer:
        started = httpx.post(f"{buffer.url}/start_rollout", timeout=60, json={  # an agent run holds its engine
            "task_type": "agent", "remote_engine_url": engine_a, "tokenizer_path": str(build / "models" / A),
            "weight_probe_s": 0.5})
        assert started.status_code == 200, started.text

        def weights(after: int) -> dict[str, Any] | None:
            found = httpx.get(f"{buffer.url}/status", timeout=10).json()["control"].get("weights") or {}
            return found if found.get("rounds", 0) > after else None

        before = wait_until(lambda: weights(1), 300, "the engine was not probed")
        assert before["engines"][engine_a] == {"version": "default", "probes": before["rounds"], "spread": 0.0}
        loaded = httpx.post(f"{engine_a}/update_weights_from_disk", timeout=60,
                            json={"model_path": str(build / "models" / B)})
        assert loaded.json()["success"], loaded.text
        after = wait_until(lambda: weights(before["rounds"] + 1), 300, "the engine was not probed again")
        update_weights(engine_a, build / "models" / A, "9")  # the next test's `engine_a` calls it "default" again
        back = wait_until(lambda: weights(after["rounds"] + 1), 300, "the engine was not probed again")
    assert after["unversioned_swaps"] == 1 and after["swaps"][0]["version"] == "default"
    assert after["swaps"][0]["moved"] > 1.0, after  # another checkpoint: far beyond the tolerance
    assert back["unversioned_swaps"] == 1  # the versioned update back is not a swap


def test_what_the_real_engine_refuses(engine_a: str, build: Path, tmp_path: Path) -> None:
    """A token budget past the engine's context is refused at the start, naming the field; a sampling value the
    engine refuses fails each trajectory at once with the engine's own reason, counted, not retried."""
    model = str(build / "models" / A)
    rows = write_jsonl(tmp_path / "math.jsonl", math_rows(2))
    with buffer_server(tmp_path, "--data-root", str(build)) as buffer:
        refused = httpx.post(f"{buffer.url}/start_rollout", timeout=60, json={
            "task_type": "math", "input_file": str(rows), "remote_engine_url": engine_a, "tokenizer_path": model,
            "max_tokens": 5000})
        assert refused.status_code == 422 and "max_tokens" in refused.text and "4096" in refused.text, refused.text
        run_id = start(buffer.url, engine_a, rows, model, num_repeat_per_sample=2, num_process=4, max_tokens=8,
                       sampling_params={"temperature": 1.0, "min_p": 2.0})
        status = wait_finished(buffer.url, timeout_s=300)
        failed = httpx.get(f"{buffer.url}/ui/api/trajectories", params={"run_id": run_id, "status": "failed"},
                           timeout=10).json()["items"]
        errors = [record(buffer.url, item["uid"])["extra_info"]["error"] for item in failed]
    progress = status["run"]["progress"]
    assert (progress["total"], progress["failed"], progress["failures"]) == (4, 4, {"engine_http_4xx": 4}), progress
    assert len(errors) == 4 and all("min_p must be in [0, 1], got 2.0" in error for error in errors), errors


def test_an_engine_killed_mid_run_and_started_again_loses_nothing(real_engine: RealEngine, engine_a: str,
                                                                  build: Path, tmp_path: Path) -> None:
    """kill -9 of the real engine mid-run, started again on its port: the run waits out the outage, and every
    record is delivered whole, with the trainer's log-probs."""
    with buffer_server(tmp_path, "--data-root", str(build)) as buffer:
        start(buffer.url, engine_a, write_jsonl(tmp_path / "math.jsonl", math_rows(4)), str(build / "models" / A),
              num_repeat_per_sample=2, num_process=4, max_tokens=48, max_retries=1)
        mid_generation(engine_a, requests=4)
        os.killpg(real_engine.proc.pid, signal.SIGKILL)
        real_engine.proc.wait(30)
        wait_until(lambda: httpx.get(f"{buffer.url}/status", timeout=10).json()["run"]["progress"]
                   .get("engine_outage"), 120, "the outage shows")
        real_engine.proc = start_sglang(build, real_engine.folder, real_engine.port)
        status = wait_finished(buffer.url, timeout_s=600)
        records = drain(buffer.url)
    progress = status["run"]["progress"]
    assert progress["failed"] == 0 and progress["failures"] == {} and status["filtered"] == {}, progress
    assert len(records) == 8 and {r["instance_id"] for r in records} == {f"m{i}" for i in range(4)}
    assert_trainers_logprobs(build, records)


def shape(value: Any) -> Any:
    """A JSON value's structure: its keys all the way down, each list by its first item, each leaf by its type."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def answer(url: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """(status, JSON body or text) of a GET (no body) or POST."""
    r = httpx.post(url + path, json=body, timeout=60) if body is not None else httpx.get(url + path, timeout=60)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def events(url: str, body: dict[str, Any]) -> list[Any]:
    """The JSON events of a streamed /generate, without the closing [DONE]."""
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_the_simulator_answers_as_real_sglang_does(engine_a: str, build: Path, tmp_path: Path) -> None:
    """The same requests to real SGLang and to the simulator (same tokenizer, same context): the same statuses,
    the same error bodies, the same answer shapes. What the simulator does not imitate is listed in its
    docstring; what this test found is fixed there."""
    model = build / "models" / A
    tokenizer = load_tokenizer(str(model))
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                                         add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)
    greedy = {"input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    with sim_engine(tmp_path, str(model), "--context-length", "4096") as sim:
        for url in (engine_a, sim.url):  # both at version "default", as they started
            assert answer(url, "/update_weights_from_disk", {"model_path": str(model), "weight_version": "default"}) \
                == (200, {"success": True, "num_paused_requests": 0,
                          "message": "Succeeded to update model weights. Weight version updated to default."})
        same = [("/generate", {**greedy, "sampling_params": {"max_new_tokens": 8, "bogus": 1}}),
                ("/generate", {**greedy, "sampling_params": {"max_new_tokens": 100_000}}),
                ("/generate", {**greedy, "sampling_params": {"temperature": -1}}),
                ("/abort_request", {"rid": "none-such"}), ("/flush_cache", {}),
                ("/update_weights_from_disk", {"model_path": "/nonexistent"})]
        for path, body in same:
            assert answer(engine_a, path, body) == answer(sim.url, path, body), (path, body)
        # The simulator keeps no prefix cache: the engine's is flushed first, as its `cached_tokens` shape the answer.
        assert answer(engine_a, "/flush_cache", {})[0] == 200
        real, simulated = answer(engine_a, "/generate", greedy), answer(sim.url, "/generate", greedy)
        assert (real[0], shape(real[1])) == (simulated[0], shape(simulated[1]))
        assert answer(engine_a, "/flush_cache", {})[0] == 200
        # The weight watch's probe: text in, the prompt's log-probs out, the first token's None.
        real, simulated = answer(engine_a, "/generate", probe_body()), answer(sim.url, "/generate", probe_body())
        assert (real[0], shape(real[1])) == (simulated[0], shape(simulated[1]))
        for body in (real[1], simulated[1]):
            rows = body["meta_info"]["input_token_logprobs"]
            assert len(rows) == body["meta_info"]["prompt_tokens"] and rows[0][0] is None and rows[1][0] < 0
        assert answer(engine_a, "/flush_cache", {})[0] == 200
        real_events, sim_events = events(engine_a, greedy), events(sim.url, greedy)
        assert [shape(e) for e in real_events] == [shape(e) for e in sim_events]
        # A stop string ends the text before it and keeps the token that holds it.
        stopped = {**greedy, "sampling_params": {"max_new_tokens": 64, "temperature": 0, "stop": ["e"]}}
        for url in (engine_a, sim.url):
            status, body = answer(url, "/generate", stopped)
            assert status == 200 and body["meta_info"]["finish_reason"] == {"type": "stop", "matched": "e"}
            held = tokenizer.decode(body["output_ids"])
            assert "e" not in body["text"] and held.startswith(body["text"]) and held[len(body["text"])] == "e"
        real_info, sim_info = answer(engine_a, "/get_model_info")[1], answer(sim.url, "/get_model_info")[1]
        assert shape({k: v for k, v in real_info.items() if k != "embedding"}) == shape(sim_info)
        assert shape(answer(engine_a, "/v1/models")[1]) == shape(answer(sim.url, "/v1/models")[1])


@needs_slime_src
def test_slimes_own_multimodal_path_gives_the_records_tokens_and_pixels(build: Path, tmp_path: Path) -> None:
    """A native vision run's records, against the pinned slime's multimodal path run in this venv (whose
    torchvision lets transformers' AutoProcessor load the checkpoint's Qwen-VL processor, as slime's
    `load_processor` does): slime's prompt ids for the same conversation and images are the record's prompt tokens,
    its processor's `image_grid_thw` and `pixel_values` are the adapter's `multimodal_train_inputs`, and the images
    slime would send the engine have the pixels the engine was sent."""
    from transformers import AutoImageProcessor

    from rollout_sim.vision_checkpoint import png, vision_checkpoint
    from slime_adapter.client import BufferClient
    from slime_adapter.records import SampleBuilder, open_image

    checkpoint = vision_checkpoint(tmp_path / "checkpoint")
    shown = {"red": [png((220, 30, 30), (320, 200))], "two": [png((30, 60, 220), (64, 48)), png((30, 180, 60))]}
    rows = [{"instance_id": name, "prompt": "Colours?", "label": "x",
             "images": ["data:image/png;base64," + base64.b64encode(p).decode() for p in pngs]}
            for name, pngs in shown.items()]
    with sim_engine(tmp_path, str(checkpoint)) as engine, buffer_server(tmp_path) as buffer:
        start(buffer.url, engine.url, write_jsonl(tmp_path / "vision.jsonl", rows), str(checkpoint),
              task_type="vision", num_repeat_per_sample=1, max_tokens=16)
        wait_finished(buffer.url)
        records = sorted(drain(buffer.url), key=lambda r: r["instance_id"])
        with BufferClient(buffer.url) as client:
            processor = AutoImageProcessor.from_pretrained(str(checkpoint))
            samples = [SampleBuilder(lambda: None, "qwen3", image=lambda sha: open_image(client.image(sha)),
                                     image_processor=lambda: processor).build(r) for r in records]
            stored = {i["sha256"]: client.image(i["sha256"]) for r in records for i in r["images"]}
    cases = [{"messages": [{**m, "content": [
        {"type": "image", "image": "data:image/png;base64," + base64.b64encode(stored[p["image"][7:]]).decode()}
        if p["type"] == "image" else p for p in m["content"]]} if isinstance(m["content"], list) else m
        for m in rec["messages"][:-1]]} for rec in records]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = tmp_path / "slime"
    out.mkdir()
    done = subprocess.run([str(build / "venv" / "bin" / "python"), str(ROOT / "tests" / "data" / "slime_checks" /
                                                                       "multimodal_prompts.py"),
                           str(checkpoint), str(tmp_path / "cases.json"), str(out)],
                          env={**os.environ, "PYTHONPATH": str(SLIME_SRC)}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "result.json").read_text())
    assert len(results) == len(records) == 2
    for k, (rec, sample, slime) in enumerate(zip(records, samples, results, strict=True)):
        assert slime["processor"] == "Qwen2_5_VLProcessor"
        assert slime["prompt_ids"] == rec["tokens"][:len(rec["tokens"]) - rec["response_length"]], rec["uid"]
        train = sample.multimodal_train_inputs
        assert slime["image_grid_thw"] == train["image_grid_thw"].tolist()
        theirs, ours = np.load(out / f"pixel_values-{k}.npy"), train["pixel_values"].numpy()
        assert theirs.shape == ours.shape and np.allclose(theirs, ours, atol=1e-5)
        assert slime["engine_pixels_equal"] == [True] * len(rec["images"])


@pytest.fixture(scope="module")
def vlm_engine(build: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Real SGLang serving the tiny Qwen2.5-VL, through its own multimodal processor."""
    folder, port = tmp_path_factory.mktemp("real-sglang-vlm"), free_port()
    proc = start_sglang(build, folder, port, VLM)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


def test_images_reach_a_real_vision_model_with_the_trainers_log_probs(vlm_engine: str, build: Path,
                                                                      tmp_path: Path) -> None:
    """A native vision run and an OpenAI chat session that resends its screenshot, on SGLang's own Qwen2.5-VL path
    (each image sent as one pad, which SGLang expands with its processor): every loss-1 log-prob of every record
    equals a transformers forward of the checkpoint over the record's tokens and images, so the tokens hold the
    image tokens where and as many as the engine put them, and the engine saw the pixels the trainer sees."""
    from rollout_sim.vision_checkpoint import png

    model = build / "models" / VLM

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    shown = {"red": [png((220, 30, 30), (320, 200))], "two": [png((30, 60, 220)), png((30, 180, 60))]}
    rows = [{"instance_id": name, "prompt": "Colours?", "label": "x",
             "images": ["data:image/png;base64," + b64(p) for p in pngs]} for name, pngs in shown.items()]
    with buffer_server(tmp_path, "--data-root", str(build)) as buffer:
        start(buffer.url, vlm_engine, write_jsonl(tmp_path / "vision.jsonl", rows), str(model), task_type="vision",
              num_repeat_per_sample=1, max_tokens=8, teacher_engine_url=vlm_engine)
        wait_finished(buffer.url)
        records = drain(buffer.url)
        stored = {i["sha256"]: httpx.get(f"{buffer.url}/images/{i['sha256']}", timeout=10).content
                  for r in records for i in r["images"]}
    (tmp_path / "sessions").mkdir()
    with session_host(tmp_path / "sessions", vlm_engine, str(model), "--data-root", str(build),
                      max_tokens=64) as buffer:
        session = open_session(buffer.url, "screens")
        client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"])
        history: list[Any] = []
        for colour in ((220, 30, 30), (30, 60, 220)):
            history.append({"role": "user", "content": [{"type": "text", "text": "Screen:"}, {
                "type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(png(colour, (128, 96)))}}]})
            reply = client.chat.completions.create(model="policy", messages=history, temperature=0, max_tokens=12,
                                                   stop=["e"])
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
        # A reply its token cap cut cannot be continued: the next turn is then a branch (a record) of its own.
        sessions = [record(buffer.url, uid) for uid in finish(buffer.url, session, 1.0)["uids"]]
        stored |= {i["sha256"]: httpx.get(f"{buffer.url}/images/{i['sha256']}", timeout=10).content
                   for r in sessions for i in r["images"]}
    assert sorted(len(r["images"]) for r in records) == [1, 2]
    assert max(len(r["images"]) for r in sessions) == 2 and sum(r["extra_info"]["turns"] for r in sessions) == 2
    native = {r["uid"] for r in records}
    records += sessions
    forward = trainer_logprobs(build, str(model), [r["tokens"] for r in records],
                               images=[[b64(stored[i["sha256"]]) for i in r["images"]] for r in records])
    for rec, logprobs in zip(records, forward, strict=True):
        positions = list(trained_positions(rec))
        assert positions, rec["uid"]
        for position, logprob, _ in positions:
            assert abs(logprob - logprobs[position - 1]) <= TOLERANCE, (rec["uid"], position, logprob,
                                                                        logprobs[position - 1])
        if rec["uid"] in native:  # the native run's teacher (the same checkpoint) was sent the images too
            start_at = len(rec["tokens"]) - rec["response_length"]
            teacher = rec["teacher_log_probs"]
            assert all(abs(t - logprobs[start_at + k - 1]) <= TOLERANCE for k, t in enumerate(teacher)), rec["uid"]
