"""The Search-R1 generator: its reward and format rules, and whole runs over real HTTP (buffer + simulated
SGLang engine + BM25 retrieval server, real Qwen3 tokenizer)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import httpx
import orjson
import pytest
from demo_cli import run_demo
from runs import drain, wait_finished
from servers import Server, free_port

from generators.search import (
    INVALID_ACTION_HINT,
    SEARCH_R1_PROMPT,
    SearchConfig,
    exact_match,
    format_documents,
    golden_answers,
    is_well_formed,
    normalize_answer,
    parse_action,
    question_text,
    search_reward,
)

DATA = Path(str(resources.files("generators") / "data"))
ROWS = [
    {"question": "Who discovered penicillin", "golden_answers": ["Alexander Fleming", "Fleming"]},
    {"question": "What is the capital city of Kenya?", "answer": "Nairobi", "metadata": {"source": "test"}},
    {"question": "Who wrote Pride and Prejudice?", "golden_answers": ["Jane Austen"]},
    {"question": "What is the largest ocean on Earth?", "golden_answers": ["Pacific Ocean", "Pacific"]},
]
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

# ------------------------------------------------------------------------------------ rules


def test_answers_are_normalised_like_search_r1():
    assert normalize_answer("  The  Eiffel-Tower! ") == "eiffeltower"
    assert normalize_answer("An Apple a day") == "apple day"
    assert exact_match(" the Pacific ocean.", ["Atlantic", "Pacific Ocean"])
    assert not exact_match("Pacific", ["Pacific Ocean"])
    assert exact_match("Gabriel García Márquez", ["gabriel garcía márquez"])


def test_well_formed_means_think_then_search_information_think_then_answer():
    search = "<think>need facts</think>\n<search> q </search>"
    info = "<information>Doc 1(Title: X) x</information>"
    answer = "<think>it is X</think>\n<answer> X </answer>"
    assert is_well_formed(answer)
    assert is_well_formed("\n".join([search, info, answer]))
    assert is_well_formed("\n".join([search, info, search, info, answer]))
    assert not is_well_formed("<answer> X </answer>"), "reasoning comes first"
    assert not is_well_formed("\n".join([search, info])), "no answer"
    assert not is_well_formed("<think>a</think> chatter <answer> X </answer>"), "text between tags"
    assert not is_well_formed(answer + " trailing"), "text after the answer"
    assert not is_well_formed("<think>a</think><search> q </search><think>b</think><answer>X</answer>")
    assert not is_well_formed("\n".join([search, INVALID_ACTION_HINT, answer]))


def test_reward_is_exact_match_with_format_score_for_a_well_formed_wrong_answer():
    gold = ["Nairobi"]
    assert search_reward("nairobi", gold, well_formed=True, format_score=0.2) == 1.0
    assert search_reward("Nairobi", gold, well_formed=False, format_score=0.2) == 1.0
    assert search_reward("Mombasa", gold, well_formed=True, format_score=0.2) == 0.2
    assert search_reward("Mombasa", gold, well_formed=False, format_score=0.2) == 0.0
    assert search_reward(None, gold, well_formed=True, format_score=0.2) == 0.0


def test_actions_and_search_r1_document_rendering():
    assert parse_action("<think>x</think>\n<search> capital of Kenya </search>") == ("search", "capital of Kenya")
    assert parse_action("<answer>\nNairobi\n</answer>") == ("answer", "Nairobi")
    assert parse_action("I should look this up.") == (None, "")
    assert parse_action("<search> unfinished") == (None, "")
    docs = [{"id": "1", "contents": '"Nairobi"\nNairobi is the capital.\nSecond line.'},
            {"title": "Kenya", "text": "A country."}]
    assert format_documents(docs) == (
        'Doc 1(Title: "Nairobi") Nairobi is the capital.\nSecond line.\nDoc 2(Title: "Kenya") A country.'
    )


def test_rows_and_run_options():
    assert question_text({"question": " who discovered penicillin "}) == "who discovered penicillin?"
    assert golden_answers({"answer": "Nairobi"}) == ["Nairobi"]
    assert golden_answers({"golden_answers": ["a", 2], "answer": "ignored"}) == ["a", "2"]
    with pytest.raises(ValueError):
        golden_answers({"golden_answers": []})
    default = SearchConfig.from_run({"task_type": "search"})
    assert (default.max_turns, default.topk, default.search_concurrency, default.format_score) == (2, 3, 256, 0.2)
    assert default.return_logprob and default.prompt_template == SEARCH_R1_PROMPT
    # slime sends numbers as strings
    assert SearchConfig.from_run({"max_turns": "4", "format_score": "0.1"}).max_turns == 4
    for bad in ({"search_url": "ftp://x"}, {"prompt_template": "no placeholder"}, {"format_score": 2}):
        with pytest.raises(ValueError, match="bad search run options"):
            SearchConfig.from_run(bad)


# ------------------------------------------------------------------------------------ whole runs


def sim_engine(tmp: Path, tokenizer: str, *extra: str) -> Server:
    port = free_port()
    args = ["sim-engine", "--port", str(port), "--tokenizer", tokenizer, "--latency-ms", "1", *extra]
    return Server(args, "/health", port, tmp / f"sim-{port}.log")


@pytest.fixture(scope="module")
def engine(tmp_path_factory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with sim_engine(tmp_path_factory.mktemp("sim"), qwen_tokenizer_path, "--correct-rate", "0.5").start() as srv:
        yield srv


@pytest.fixture
def buffer(tmp_path: Path) -> Iterator[Server]:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    with Server(args, "/healthz", port, tmp_path / "buffer.log").start() as srv:
        yield srv


def run(buffer: Server, engine: Server, tmp: Path, tokenizer: str | None, rows=ROWS, **options) -> list[dict]:
    """Start a search run, wait for it, return every record (each group once)."""
    inp = tmp / "questions.jsonl"
    inp.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    payload = {
        "task_type": "search", "input_file": str(inp), "num_repeat_per_sample": 4, "num_process": 16,
        "remote_engine_url": engine.url, "max_tokens": 512, "tokenizer_path": tokenizer,
        "sampling_params": {"temperature": 1.0}, "backoff_s": 0.05,
        "tokenization_sanity_check_mode": "ignore_strippable", **options,
    }
    resp = httpx.post(f"{buffer.url}/start_rollout", json=payload, timeout=30)
    assert resp.status_code == 200, resp.text
    assert wait_finished(buffer.url)["run"]["state"] == "finished"
    records = drain(buffer.url, wait_s=0.2)
    assert len(records) == 4 * len(rows), [r.get("extra_info", {}).get("error") for r in records]
    return records


def model_runs(tokens: list[int], mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) spans of consecutive loss-1 tokens: the model's turns."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def golden_of(question: str) -> list[str]:
    row = next(r for r in ROWS if r["question"].rstrip("?") == question.rstrip("?"))
    gold = row.get("golden_answers") or row["answer"]
    return [gold] if isinstance(gold, str) else gold


def test_search_then_answer_with_exact_tokens_and_em_rewards(tmp_path, buffer, engine, retriever, qwen_tokenizer,
                                                             qwen_tokenizer_path):
    before = httpx.get(f"{retriever.url}/stats").json()["queries"]
    records = run(buffer, engine, tmp_path, qwen_tokenizer_path, search_url=retriever.url, format_score=0.1)
    served = httpx.get(f"{retriever.url}/stats").json()["queries"] - before
    rewards = set()
    for r in records:
        info = r["extra_info"]
        assert r["status"] == "completed" and info["finish_reason"] == "stop"
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"]
        prompt, searched, observation, answered = (m["content"] for m in r["messages"])
        question = prompt.rsplit("Question: ", 1)[1].strip()
        assert prompt.startswith("Answer the given question. You must conduct reasoning inside <think>")
        assert searched.endswith("</search>") and answered.endswith("</answer>")
        query = parse_action(searched)[1]
        assert query == question.rstrip("?")
        # The observation is Search-R1's, built from what the retriever returns for the model's query.
        docs = httpx.post(f"{retriever.url}/retrieve", json={"queries": [query], "topk": 3}).json()["result"][0]
        expected_obs = "<information>" + "\n".join(
            f"Doc {i}(Title: {d['contents'].split(chr(10))[0]}) {d['contents'].split(chr(10), 1)[1]}"
            for i, d in enumerate(docs, 1)) + "</information>"
        assert observation == expected_obs
        # Reward by hand: the simulated model answers with a document title; a wrong one is still well formed.
        answer = ANSWER.search(answered).group(1).strip()
        right = answer.lower() in {g.lower() for g in golden_of(question)}
        assert r["raw_reward"] == (1.0 if right else 0.1)
        rewards.add(r["raw_reward"])
        assert info["answer"] == answer and info["well_formed"] is True
        assert (info["searches"], info["search_errors"], info["invalid_actions"]) == (1, 0, 0)
        assert "tokenization_mismatch" not in info
        # Exact tokens: the model's two turns are loss 1 with their log-probs, everything else loss 0.
        tokens, mask, n = r["tokens"], r["loss_mask"], r["response_length"]
        assert len(tokens) == len(mask) and len(r["rollout_log_probs"]) == n
        assert not any(mask[:-n])
        spans = model_runs(tokens, mask)
        assert [qwen_tokenizer.decode(tokens[a:b]) for a, b in spans] == [searched, answered]
        log_probs = dict(zip(range(len(tokens) - n, len(tokens)), r["rollout_log_probs"], strict=True))
        for i in range(len(tokens) - n, len(tokens)):
            assert (log_probs[i] < 0) if mask[i] else (log_probs[i] == 0.0)
        between = qwen_tokenizer.decode(tokens[spans[0][1]:spans[1][0]])
        assert observation in between and between.count("<information>") == 1
    assert rewards == {1.0, 0.1}, "the simulated model answers some right and some wrong"
    assert {r["extra_info"].get("metadata") is not None for r in records} == {True, False}
    assert sum(r["extra_info"]["searches"] for r in records) == 16
    assert served == 4, "the four repeats of a question share one retrieval request"
    assert sum(r["extra_info"]["search_cache_hits"] for r in records) == 12


def test_a_down_retriever_gives_error_observations_and_the_run_completes(tmp_path, buffer, engine,
                                                                         qwen_tokenizer_path):
    dead = f"http://127.0.0.1:{free_port()}/retrieve"
    records = run(buffer, engine, tmp_path, qwen_tokenizer_path, search_url=dead, max_turns=3, search_retries=0)
    status = httpx.get(f"{buffer.url}/status").json()
    assert status["run"]["progress"]["failed"] == 0
    for r in records:
        assert r["status"] == "completed"
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant", "user", "assistant", "user", "assistant"]
        for obs in (r["messages"][2]["content"], r["messages"][4]["content"]):
            assert obs.startswith("<error>search failed: ") and obs.endswith("</error>")
            assert "unreachable" in obs
        assert r["extra_info"]["search_errors"] == 2 and r["extra_info"]["searches"] == 0
        assert r["raw_reward"] == 0.0, "no answer"
        assert sum(r["loss_mask"]) > 0


def test_invalid_actions_get_the_hint(tmp_path, buffer, retriever, qwen_tokenizer_path):
    with sim_engine(tmp_path, qwen_tokenizer_path, "--invalid-rate", "1.0").start() as confused:
        records = run(buffer, confused, tmp_path, qwen_tokenizer_path, rows=ROWS[:2], search_url=retriever.url)
    for r in records:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"]
        assert r["messages"][2]["content"] == INVALID_ACTION_HINT
        info = r["extra_info"]
        assert (info["invalid_actions"], info["searches"], info["well_formed"]) == (1, 0, False)
        assert r["raw_reward"] == 0.0


def test_chat_mode_runs_the_same_loop_on_messages(tmp_path, buffer, engine, retriever):
    records = run(buffer, engine, tmp_path, None, rows=ROWS[:2], search_url=retriever.url)
    for r in records:
        assert r["tokens"] is None
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"]
        assert r["messages"][2]["content"].startswith("<information>Doc 1(Title: ")
        assert r["raw_reward"] in (1.0, 0.2)


def test_length_limit_and_return_logprob(tmp_path, buffer, engine, retriever, qwen_tokenizer_path):
    records = run(buffer, engine, tmp_path, qwen_tokenizer_path, rows=ROWS[:1], search_url=retriever.url,
                  max_tokens=12)
    for r in records:
        assert r["status"] == "truncated" and r["raw_reward"] == 0.0
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert r["response_length"] == 12
    records = run(buffer, engine, tmp_path, qwen_tokenizer_path, rows=ROWS[:1], search_url=retriever.url,
                  return_logprob=False)
    assert all(r["rollout_log_probs"] is None and r["tokens"] for r in records)


def test_demo_search_task_runs_end_to_end(tmp_path):
    """`rollout-buffer demo --task search` starts the retriever itself (on a few bundled questions here)."""
    questions = tmp_path / "few.jsonl"
    questions.write_bytes(b"".join((DATA / "search_demo.jsonl").read_bytes().splitlines(keepends=True)[:6]))
    rows = run_demo("--task", "search", "--num-repeat", "4", "--batch-groups", "3", "--latency-ms", "1",
                    "--input", str(questions))
    assert rows["groups delivered"] == "6" and rows["samples"] == "24" and rows["failed trajectories"] == "0"
    assert 0.2 < float(rows["mean reward (raw)"]) < 1.0
