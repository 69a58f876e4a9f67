"""The sim engine's scripted policies: what a simulated model answers, right or wrong on purpose."""

from __future__ import annotations

import random
import re
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sim.policy import (
    Draw,
    answer_candidates,
    choose_policy,
    find_arithmetic,
    last_arithmetic,
    make_draw,
    scripted_reply,
)

RIGHT = Draw(correct=True, offset=2, invalid=False)
WRONG = Draw(correct=False, offset=-3, invalid=False)

SEARCH_R1_PROMPT = (
    "<|im_start|>user\nAnswer the given question. You must conduct reasoning inside <think> and </think> "
    "first every time you get new information. After reasoning, if you find you lack some knowledge, you can "
    "call a search engine by <search> query </search> and it will return the top searched results between "
    "<information> and </information>. If you find no further external knowledge needed, you can directly "
    "provide the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: who wrote the novel dune?\n<|im_end|>\n<|im_start|>assistant\n"
)
DOCS = (
    '<information>Doc 1(Title: "Frank Herbert") Frank Herbert was an American author best known for Dune.\n'
    "Doc 2(Title: Dune (novel)) Dune is a 1965 novel.\n</information>"
)


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def boxed(reply: str) -> str:
    found = re.findall(r"\\boxed\{(.+)\}", reply)
    assert found, reply
    return found[-1]


def test_math_reply_reasons_step_by_step_and_boxes_the_value() -> None:
    name, reply = scripted_reply(chat("Compute 3 * (4 + 5)."), RIGHT)
    assert name == "math"
    assert reply.startswith("<think>\n") and "\n</think>\n\n" in reply
    assert "4 + 5 = 9" in reply and "3 * 9 = 27" in reply
    assert reply.endswith("The answer is \\boxed{27}.")


def test_wrong_draw_is_off_by_the_offset_in_reasoning_and_answer() -> None:
    _, reply = scripted_reply(chat("What is 17 + 25?"), WRONG)
    assert boxed(reply) == "39"
    assert "17 + 25 = 39" in reply


def test_division_gives_an_exact_fraction() -> None:
    _, reply = scripted_reply(chat("What is 7 / 2?"), RIGHT)
    assert boxed(reply) == "\\frac{7}{2}"


@settings(max_examples=60, deadline=None)
@given(
    a=st.integers(0, 10_000),
    b=st.integers(0, 10_000),
    op=st.sampled_from(["+", "-", "*"]),
    correct=st.booleans(),
    offset=st.sampled_from([-3, -2, -1, 1, 2, 3]),
)
def test_boxed_answer_is_exact_when_right_and_off_by_offset_when_wrong(
    a: int, b: int, op: str, correct: bool, offset: int
) -> None:
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    _, reply = scripted_reply(chat(f"What is {a} {op} {b}?"), Draw(correct, offset, False))
    assert boxed(reply) == str(value if correct else value + offset)


def test_arithmetic_is_taken_from_the_last_user_turn() -> None:
    text = chat("What is 1 + 1?") + "<think>\n1 + 1 = 2\n</think>\n\n\\boxed{2}<|im_end|>\n" + chat(
        "Now what is (12 - 4) * 3 - 10 / 5?"
    )
    problem = find_arithmetic(text)
    assert problem is not None and problem.value == Fraction(22)


def whole_text_scan(text: str) -> Fraction | None:
    """The last expression of `text`, scanned whole: what `last_arithmetic` must find however it got there."""
    for match in reversed(list(re.finditer(r"(?<![\w.])[(\d][\d\s()+\-*/×÷]*[\d)]", text))):
        problem = find_arithmetic(match.group(0))
        if problem is not None:
            return problem.value
    return None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.text(alphabet="0123456789 +-*/()×÷.\nab", max_size=16),
                          st.booleans()), max_size=30))
def test_a_growing_conversation_is_scanned_from_where_its_previous_text_left_off(
        steps: list[tuple[int, str, bool]]) -> None:
    # Three conversations grow in turns, some rewritten (cut to half their text first): each text is scanned from
    # the memo of an earlier one it extends, and finds what a scan of the whole text finds, also where an
    # expression runs across the point an earlier text ended at.
    texts = ["<|im_start|>user\nfirst ", "<|im_start|>user\nsecond 7", "<|im_start|>user\n(3 "]
    for which, more, rewritten in steps:
        if rewritten:
            texts[which] = texts[which][: len(texts[which]) // 2]
        texts[which] += more
        found = last_arithmetic(texts[which])
        assert (found.value if found is not None else None) == whole_text_scan(texts[which]), texts[which]


def test_unbalanced_prose_brackets_do_not_hide_the_expression() -> None:
    problem = find_arithmetic(chat("(Hint: what is 6 * 7)"))
    assert problem is not None and problem.value == 42


def test_non_arithmetic_prompt_gets_a_boxed_guess() -> None:
    name, reply = scripted_reply(chat("Who painted the Mona Lisa?"), RIGHT)
    assert name == "guess"
    assert re.fullmatch(r"\d+", boxed(reply))


def test_search_first_turn_searches_for_the_question() -> None:
    name, reply = scripted_reply(SEARCH_R1_PROMPT, RIGHT)
    assert name == "search"
    assert "<search> who wrote the novel dune </search>" in reply
    assert "<answer>" not in reply


def test_search_after_information_answers_from_the_documents() -> None:
    _, first = scripted_reply(SEARCH_R1_PROMPT, RIGHT)
    text = SEARCH_R1_PROMPT + first + "\n\n" + DOCS + "\n\n"
    _, right = scripted_reply(text, RIGHT)
    _, wrong = scripted_reply(text, WRONG)
    assert right.endswith("<answer> Frank Herbert </answer>")
    assert "<answer>" in wrong and "Frank Herbert </answer>" not in wrong


def test_search_in_chat_form_sees_information_in_a_later_turn() -> None:
    text = SEARCH_R1_PROMPT + "<search> dune author </search><|im_end|>\n" + chat(DOCS)
    _, reply = scripted_reply(text, RIGHT)
    assert "<answer> Frank Herbert </answer>" in reply


def test_invalid_action_has_no_tags() -> None:
    _, reply = scripted_reply(SEARCH_R1_PROMPT, Draw(True, 1, invalid=True))
    assert "<search>" not in reply and "<answer>" not in reply


def test_answer_candidates_prefer_explicit_answers_then_titles() -> None:
    assert answer_candidates("The answer is Paris. Doc 1(Title: Lyon) x")[:2] == ["Paris", "Lyon"]
    assert answer_candidates(DOCS.removeprefix("<information>"))[:2] == ["Frank Herbert", "Dune (novel)"]


def test_policy_table_order_puts_search_before_math() -> None:
    assert choose_policy(SEARCH_R1_PROMPT.replace("dune", "dune 2 + 2")).name == "search"
    assert choose_policy(chat("What is 2 + 2?")).name == "math"


def test_draws_follow_the_rates_and_the_seed() -> None:
    assert all(make_draw(random.Random(1), 1.0, 0.0).correct for _ in range(50))
    rng = random.Random(2)
    assert not any(make_draw(rng, 0.0, 0.0).correct for _ in range(50))
    rng = random.Random(3)
    share = sum(make_draw(rng, 0.6, 0.0).correct for _ in range(2000)) / 2000
    assert 0.55 < share < 0.65
    a, b = random.Random(7), random.Random(7)
    assert [make_draw(a, 0.5, 0.1) for _ in range(20)] == [make_draw(b, 0.5, 0.1) for _ in range(20)]


def test_a_parallel_calculator_task_calls_every_expression_in_one_turn() -> None:
    tools = '{"type": "function", "function": {"name": "calculator"}}'
    task = (f"<|im_start|>system\n<tools>\n{tools}\n</tools><|im_end|>\n"
            "<|im_start|>user\nCompute 12 * 7 + 3 and 45 - 6 in parallel.<|im_end|>\n<|im_start|>assistant\n")
    name, reply = scripted_reply(task, WRONG)
    assert name == "parallel_tool_call"
    assert re.findall(r'"expression": "([^"]+)"', reply) == ["12 * 7 + 3", "45 - 6"]
    answered = (task + reply + "<|im_end|>\n<|im_start|>user\n<tool_response>\n87\n</tool_response>\n"
                "<tool_response>\n39\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert scripted_reply(answered, WRONG)[1].endswith(
        "The results are: 12 * 7 + 3 = 87, 45 - 6 = 39.")


def test_a_grading_prompt_gets_the_verdict_of_the_response_against_the_reference() -> None:
    def grading(reference: str, response: str) -> str:
        return chat("Given a task, a reference answer, and a response, determine if the response is correct.\n\n"
                    f"Task:\n```\nWhat is 2 + 3?\n```\n\nReference answer:\n```\n{reference}\n```\n\n"
                    f"Response:\n```\n{response}\n```\n\nRespond either \"yes\" or \"no\" only.")

    assert scripted_reply(grading("5", "The answer is \\boxed{5}."), RIGHT) == ("judge", "yes")
    assert scripted_reply(grading("5", "The answer is \\boxed{7}."), RIGHT) == ("judge", "no")
    assert scripted_reply(grading("5", "I think it is 5"), RIGHT) == ("judge", "yes")
