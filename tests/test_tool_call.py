"""The tool-calling generator end to end (buffer + simulated engine over HTTP, real Qwen3 tokenizer),
and the simulated engine's tool-call policy."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from masks import spans
from runs import drain, wait_finished
from servers import Server, free_port, running

from generators.math import math_reward
from generators.tools import ToolCall, parse_tool_calls
from rollout_buffer.tools.demo import bundled_dataset
from rollout_sim import tool_calls as sim_tool_calls
from rollout_sim.policy import Draw, choose_policy, scripted_reply
from slime_adapter.loss_mask import LossMaskGenerator

FIXTURES = Path(__file__).parent / "tool_fixtures.py"
RIGHT = Draw(correct=True, offset=2, invalid=False)
WRONG = Draw(correct=False, offset=-3, invalid=False)
INVALID = Draw(correct=True, offset=1, invalid=True)


# ------------------------------------------------------------------ servers and run helpers


def sim_engine_args(port: int, tokenizer: str, *extra: str) -> list[str]:
    return ["sim-engine", "--port", str(port), "--tokenizer", tokenizer, "--latency-ms", "5", *extra]


@pytest.fixture(scope="module")
def sim_engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("sim") / "sim.log"
    with running(sim_engine_args(port, qwen_tokenizer_path, "--correct-rate", "0.5"), "/health", port, log) as srv:
        yield srv


@pytest.fixture(scope="module")
def invalid_engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    """A simulated model whose every tool call is malformed JSON."""
    port = free_port()
    log = tmp_path_factory.mktemp("sim") / "sim.log"
    with running(sim_engine_args(port, qwen_tokenizer_path, "--invalid-rate", "1.0"), "/health", port, log) as srv:
        yield srv


@pytest.fixture(scope="module")
def parser_engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    """A simulated model that is always right, served like SGLang with `--tool-call-parser qwen`."""
    port = free_port()
    log = tmp_path_factory.mktemp("sim") / "sim.log"
    args = sim_engine_args(port, qwen_tokenizer_path, "--correct-rate", "1.0", "--tool-call-parser", "qwen")
    with running(args, "/health", port, log) as srv:
        yield srv


def buffer(tmp_path: Path) -> Server:
    port = free_port()
    return Server(["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")], "/healthz", port,
                  tmp_path / "buffer.log")


def demo_rows(n: int) -> list[dict[str, Any]]:
    lines = bundled_dataset("tool_call").read_bytes().splitlines()
    return [orjson.loads(line) for line in lines[:n]]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    return path


def run_to_end(url: str, engine: str, input_file: Path, tokenizer: str, **options: Any) -> tuple[dict, list[dict]]:
    """Start a tool_call run, wait for it to finish, return (status, every delivered record)."""
    payload = {
        "task_type": "tool_call", "input_file": str(input_file), "num_repeat_per_sample": 4,
        "num_process": 16, "remote_engine_url": engine, "max_tokens": 1024, "tokenizer_path": tokenizer,
        "sampling_params": {"temperature": 1.0}, **options,
    }
    resp = httpx.post(f"{url}/start_rollout", json=payload, timeout=30)
    assert resp.status_code == 200, resp.text
    status = wait_finished(url, timeout_s=60)
    return status, drain(url, wait_s=0.2)


def expression_of(prompt: str) -> str:
    found = re.search(r"what is (.+?)\? Use the calculator", prompt)
    assert found, prompt
    return found.group(1)


# ------------------------------------------------------------------ end to end


def test_calculator_run_end_to_end(tmp_path, sim_engine, qwen_tokenizer, qwen_tokenizer_path):
    rows = demo_rows(6)
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    with buffer(tmp_path).start() as srv:
        status, records = run_to_end(srv.url, sim_engine.url, inp, qwen_tokenizer_path)
    assert status["run"]["progress"]["done"] == 24 and status["run"]["progress"]["failed"] == 0
    assert len(records) == 24
    by_id = {r["instance_id"]: r for r in rows}
    im_end = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for r in records:
        row = by_id[r["instance_id"]]
        user, call_turn, tool, answer = r["messages"]
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "tool", "assistant"]
        assert user == {"role": "user", "content": row["prompt"]}
        assert parse_tool_calls(call_turn["content"]) == [ToolCall("calculator", {"expression": expression_of(
            row["prompt"])})]
        assert tool == {"role": "tool", "name": "calculator", "content": row["label"]}, "the calculator's value"
        info = r["extra_info"]
        assert info["stop_reason"] == "answer" and (info["assistant_turns"], info["user_turns"]) == (2, 1)
        assert info["tool_calls"] == [{"turn": 1, "name": "calculator", "reward": 0.0,
                                       "arguments": {"expression": expression_of(row["prompt"])}}]
        # Hand-computed reward: the final answer against the label, plus no tool reward.
        assert r["raw_reward"] == math_reward(answer["content"], row["label"]) == info["answer_reward"]
        assert info["tool_reward"] == 0.0
        # Strict check: the exact sequence is the template's rendering of these messages with the tools.
        assert "tokenization_mismatch" not in info
        tokens, mask, n = r["tokens"], r["loss_mask"], r["response_length"]
        prompt_text = qwen_tokenizer.decode(tokens[: len(tokens) - n])
        assert "<tools>" in prompt_text and '"name": "calculator"' in prompt_text
        # Model tokens (loss 1) are exactly the two assistant turns; the tool response between them is loss 0.
        model_spans = spans(mask, 1)
        assert len(model_spans) == 2
        for (a, b), message in zip(model_spans, (call_turn, answer), strict=True):
            assert tokens[b - 1] == im_end
            assert qwen_tokenizer.decode(tokens[a: b - 1]) == message["content"]
        between = qwen_tokenizer.decode(tokens[model_spans[0][1]: model_spans[1][0]])
        assert f"<tool_response>\n{row['label']}\n</tool_response>" in between
        # Log-probs cover the response: negative on model tokens, 0.0 on observation tokens.
        log_probs = r["rollout_log_probs"]
        assert len(log_probs) == n
        for lp, m in zip(log_probs, mask[-n:], strict=True):
            assert (lp < 0) if m == 1 else (lp == 0.0)
    assert {r["raw_reward"] for r in records} == {0.0, 1.0}, "the simulated model answers right and wrong"


def test_class_tool_lifecycle_tool_reward_and_truncation(tmp_path, sim_engine, qwen_tokenizer_path):
    log = tmp_path / "lifecycle.log"
    config = tmp_path / "tools.yaml"
    config.write_text(f"tools:\n  - class_name: {FIXTURES}:LoggedCalculator\n"
                      f"    config: {{log_path: {log}, reward: 0.25, padding: 400}}\n")
    rows = [{**row, "tools_kwargs": {"calculator": {"create_kwargs": {"tag": f"tag-{i}"}}}}
            for i, row in enumerate(demo_rows(3))]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    with buffer(tmp_path).start() as srv:
        _, records = run_to_end(srv.url, sim_engine.url, inp, qwen_tokenizer_path, tool_config_path=str(config),
                                max_tool_response_length=48, tool_response_truncate_side="left")
    assert len(records) == 12
    tags = {row["instance_id"]: f"tag-{i}" for i, row in enumerate(rows)}
    labels = {row["instance_id"]: row["label"] for row in rows}
    for r in records:
        label = labels[r["instance_id"]]
        tool = r["messages"][2]
        kept = (label + " " + "." * 400)[:48]
        assert tool["content"] == kept + "...(truncated)", "cut to 48 characters, the start kept"
        answer = math_reward(r["messages"][-1]["content"], label)
        assert r["raw_reward"] == answer + 0.25, "answer reward plus the tool's reward"
        assert (r["extra_info"]["answer_reward"], r["extra_info"]["tool_reward"]) == (answer, 0.25)
    events: dict[str, list[str]] = defaultdict(list)
    for line in log.read_text().splitlines():
        kind, instance, *rest = line.split(" ")
        events[instance].append(" ".join([kind, *rest]).strip())
    assert set(events) == {r["uid"] for r in records}, "one instance per trajectory, named by its uid"
    for r in records:
        tag = tags[r["instance_id"]]
        assert events[r["uid"]] == [f"create {tag}", f"execute {tag}", "release"]


@pytest.mark.parametrize(("limits", "roles", "stop_reason"), [
    ({"max_assistant_turns": 3}, ["user", "assistant", "tool", "assistant", "tool", "assistant"],
     "max_assistant_turns"),
    ({"max_user_turns": 1}, ["user", "assistant", "tool", "assistant"], "max_user_turns"),
])
def test_malformed_calls_become_error_messages_until_a_turn_limit(
        tmp_path, invalid_engine, qwen_tokenizer_path, limits, roles, stop_reason):
    inp = write_jsonl(tmp_path / "in.jsonl", demo_rows(2))
    with buffer(tmp_path).start() as srv:
        status, records = run_to_end(srv.url, invalid_engine.url, inp, qwen_tokenizer_path, **limits)
    assert status["run"]["progress"]["failed"] == 0 and len(records) == 8
    for r in records:
        assert [m["role"] for m in r["messages"]] == roles
        for m in r["messages"]:
            if m["role"] == "tool":
                assert m["content"].startswith("Error: the tool call is not valid JSON")
        info = r["extra_info"]
        assert info["stop_reason"] == stop_reason and r["status"] == "completed"
        assert r["raw_reward"] == 0.0, "a trajectory that never answered earns nothing"
        assert all("error" in c for c in info["tool_calls"])


def test_unreadable_tool_config_fails_trajectories_with_the_reason(tmp_path, sim_engine, qwen_tokenizer_path):
    inp = write_jsonl(tmp_path / "in.jsonl", demo_rows(1))
    missing = tmp_path / "absent.yaml"
    with buffer(tmp_path).start() as srv:
        status, records = run_to_end(srv.url, sim_engine.url, inp, qwen_tokenizer_path,
                                     tool_config_path=str(missing))
        rec = httpx.get(f"{srv.url}/trajectories/{status['run']['run_id']}:calc-000:0:0").json()
    assert records == [] and status["run"]["progress"]["failures"] == {"generator_error": 4}
    assert rec["status"] == "failed" and f"cannot read tool config {missing}" in rec["extra_info"]["error"]


PARALLEL_ROWS = [{"instance_id": f"par-{i}", "prompt": f"Compute {a} * {b} and {a} + {b} with the calculator.",
                  "label": str(a + b)} for i, (a, b) in enumerate(((17, 23), (120, 7)))]


def test_parallel_calls_in_token_and_chat_mode_give_the_same_sequence(
        tmp_path, parser_engine, qwen_tokenizer, qwen_tokenizer_path):
    """Token mode keeps the hermes text and answers both calls in one user turn (strict check); chat mode against a
    tool-call parser stores OpenAI tool_calls and tool_call_ids, which the loss-mask generator renders back into the
    very tokens token mode recorded."""
    inp = write_jsonl(tmp_path / "in.jsonl", PARALLEL_ROWS)
    options = {"max_parallel_calls": 2, "num_repeat_per_sample": 2}
    with buffer(tmp_path).start() as srv:
        _, token_records = run_to_end(srv.url, parser_engine.url, inp, qwen_tokenizer_path, **options)
        _, chat_records = run_to_end(srv.url, parser_engine.url, inp, qwen_tokenizer_path, engine_mode="chat",
                                     **options)
    assert len(token_records) == len(chat_records) == 4
    im_end = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    generator = LossMaskGenerator(qwen_tokenizer, "qwen3")
    tokens_of = {r["instance_id"]: r["tokens"] for r in token_records}
    for r in token_records:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "tool", "tool", "assistant"]
        assert len(parse_tool_calls(r["messages"][1]["content"])) == 2
        assert "tokenization_mismatch" not in r["extra_info"], "strict check: one user turn for both results"
        assert qwen_tokenizer.decode(r["tokens"]).count("<tool_response>") == 2
    for r in chat_records:
        call_turn, first, second = r["messages"][1:4]
        assert "<tool_call>" not in call_turn["content"] and r["tokens"] is None
        assert [c["function"]["name"] for c in call_turn["tool_calls"]] == ["calculator", "calculator"]
        assert all(c["id"].startswith("call_") and isinstance(c["function"]["arguments"], str)
                   for c in call_turn["tool_calls"])
        assert [first["tool_call_id"], second["tool_call_id"]] == [c["id"] for c in call_turn["tool_calls"]]
        assert r["extra_info"]["stop_reason"] == "answer" and r["raw_reward"] == 1.0
        ids, mask = generator.get_loss_mask(r["messages"], tools=r["tools"])
        assert ids == tokens_of[r["instance_id"]]
        token_mask = next(t["loss_mask"] for t in token_records if t["instance_id"] == r["instance_id"])
        # The generator also trains the newline after each <|im_end|>; the exact sequence leaves it out.
        assert all(ids[i - 1] == im_end for i, (a, b) in enumerate(zip(mask, token_mask, strict=True)) if a != b)


CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def chat(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": "m", **body}, timeout=10)


def test_sim_engine_answers_tool_calls_in_sglangs_shape(parser_engine) -> None:
    question = [{"role": "user", "content": "Compute 6 * 7 and 6 + 7."}]
    choice = chat(parser_engine.url, messages=question, tools=[CALCULATOR_SCHEMA]).json()["choices"][0]
    message = choice["message"]
    assert message["content"] == "<think>\nI will use the calculator for 6 * 7 and 6 + 7.\n</think>"
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    assert [(c["index"], c["type"], c["function"]) for c in message["tool_calls"]] == [
        (0, "function", {"name": "calculator", "arguments": '{"expression": "6 * 7"}'}),
        (0, "function", {"name": "calculator", "arguments": '{"expression": "6 + 7"}'}),
    ]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in message["tool_calls"])
    # tool_choice "none": the text comes back as generated.
    plain = chat(parser_engine.url, messages=question, tools=[CALCULATOR_SCHEMA], tool_choice="none").json()
    assert plain["choices"][0]["message"]["tool_calls"] is None and plain["choices"][0]["finish_reason"] == "stop"
    assert plain["choices"][0]["message"]["content"].count("<tool_call>") == 2
    # History: string arguments are parsed before the template renders them; a non-object is refused.
    history = [*question, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "[1, 2]"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    refused = chat(parser_engine.url, messages=history, tools=[CALCULATOR_SCHEMA])
    assert refused.status_code == 400 and "must be a JSON object" in refused.text


def test_sim_tool_call_parser_drops_what_sglang_drops() -> None:
    text = ('Before.\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n<tool_call>\n{bad json}\n'
            '</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "π * 2"}}\n</tool_call>')
    content, calls = sim_tool_calls.parse_tool_calls(text, [CALCULATOR_SCHEMA])
    assert content == "Before." and [c["function"] for c in calls] == [
        {"name": "calculator", "arguments": '{"expression": "π * 2"}'}]
    assert sim_tool_calls.parse_tool_calls("no call here", [CALCULATOR_SCHEMA]) is None


# ------------------------------------------------------------------ the simulated engine's tool-call policy


TOOLS_PROMPT = (
    "<|im_start|>system\n# Tools\n\n<tools>\n"
    '{"type": "function", "function": {"name": "calculator", "description": "e.g. (3 + 4) * 5"}}\n'
    "</tools><|im_end|>\n<|im_start|>user\nA shop sells 245 coffees, that is, what is 245 * 5 + 410 * 2?"
    "<|im_end|>\n<|im_start|>assistant\n"
)


def after_tool(content: str) -> str:
    return (TOOLS_PROMPT + '<tool_call>\n{"name": "calculator"}\n</tool_call><|im_end|>\n'
            f"<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_policy_calls_the_calculator_on_the_question() -> None:
    assert choose_policy(TOOLS_PROMPT).name == "tool_call"
    name, reply = scripted_reply(TOOLS_PROMPT, WRONG)
    assert name == "tool_call"
    assert parse_tool_calls(reply) == [ToolCall("calculator", {"expression": "245 * 5 + 410 * 2"})]


def test_policy_calls_in_parallel_for_several_expressions() -> None:
    prompt = TOOLS_PROMPT.replace("what is 245 * 5 + 410 * 2?", "compute 6 * 7 and 12 - 5.")
    assert parse_tool_calls(scripted_reply(prompt, RIGHT)[1]) == [
        ToolCall("calculator", {"expression": "6 * 7"}), ToolCall("calculator", {"expression": "12 - 5"})]


def test_policy_boxes_the_tool_value_right_or_off_by_the_offset() -> None:
    assert scripted_reply(after_tool("2045"), RIGHT)[1].endswith("The answer is \\boxed{2045}.")
    assert scripted_reply(after_tool("2045 ....(truncated)"), WRONG)[1].endswith("\\boxed{2042}.")
    assert parse_tool_calls(scripted_reply(after_tool("2045"), RIGHT)[1]) == []


def test_policy_retries_after_an_error_and_writes_malformed_calls_when_invalid() -> None:
    retry = scripted_reply(after_tool("Error: ValueError: division by zero"), RIGHT)[1]
    assert parse_tool_calls(retry) == [ToolCall("calculator", {"expression": "245 * 5 + 410 * 2"})]
    [broken] = parse_tool_calls(scripted_reply(TOOLS_PROMPT, INVALID)[1])
    assert broken.error is not None and "not valid JSON" in broken.error


def test_policy_without_the_calculator_or_arithmetic() -> None:
    plain = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert choose_policy(plain).name == "math", "no tools offered: the math policy answers"
    no_math = TOOLS_PROMPT.replace("what is 245 * 5 + 410 * 2?", "who wrote Dune?")
    _, reply = scripted_reply(no_math, RIGHT)
    assert "<tool_call>" not in reply and "\\boxed{" in reply
