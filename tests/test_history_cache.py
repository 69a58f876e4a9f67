"""A session converts only the part of a resent history its previous request did not hold, and gets exactly what a
whole conversion gives: the same canonical messages and match keys, tool calls checked against the calls before
them, a rewritten item converted again from where it changed."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rollout_buffer.proxy.history import HistoryCache
from rollout_buffer.proxy.messages import WireError
from rollout_buffer.proxy.openai_chat import OpenAIChatAdapter
from rollout_buffer.proxy.openai_responses import OpenAIResponsesAdapter


def chat_history(turns: int) -> list[dict[str, Any]]:
    """A coding agent's chat history: per turn, the reply's text and its call sent apart (they merge), the tool's
    answer."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You fix bugs."},
                                      {"role": "user", "content": "Fix the failing test."}]
    for t in range(turns):
        call = {"id": f"c{t}", "type": "function", "function": {"name": "shell", "arguments": f'{{"cmd": "ls {t}"}}'}}
        messages += [{"role": "assistant", "content": f"Looking at step {t}."},
                     {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{t}", "content": f"file_{t}.py"}]
    return messages


def responses_history(turns: int) -> list[dict[str, Any]]:
    """Codex's way: its reasoning, a message, a call and the call's output per turn, all resent."""
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Fix the failing test."}]}]
    for t in range(turns):
        items += [{"type": "reasoning", "id": f"rs{t}", "summary": []},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"Step {t}."}]},
                  {"type": "function_call", "call_id": f"call{t}", "name": "exec_command",
                   "arguments": f'{{"cmd": "ls {t}"}}'},
                  {"type": "function_call_output", "call_id": f"call{t}", "output": f"file_{t}.py"}]
    return items


@pytest.mark.parametrize("protocol", ["chat", "responses"])
def test_a_growing_history_is_converted_once_and_as_a_whole_conversion_would(protocol: str) -> None:
    adapter = OpenAIChatAdapter() if protocol == "chat" else OpenAIResponsesAdapter()
    cache = HistoryCache()
    converted_items = 0
    original = HistoryCache.convert

    def counting(self: HistoryCache, head: Any, head_messages: Any, raw: list[Any], one: Any) -> Any:
        def counted(item: Any, i: int, calls: dict[str, None]) -> list[dict[str, Any]]:
            nonlocal converted_items
            converted_items += 1
            return one(item, i, calls)
        return original(self, head, head_messages, raw, counted)

    HistoryCache.convert = counting  # type: ignore[method-assign]
    try:
        total = 0
        for turns in range(1, 8):
            history = chat_history(turns) if protocol == "chat" else responses_history(turns)
            body = ({"messages": history} if protocol == "chat"
                    else {"input": history, "instructions": "Be careful.", "store": False})
            before = converted_items
            cached = adapter.parse(copy.deepcopy(body), cache)
            new_items = converted_items - before
            whole = adapter.parse(copy.deepcopy(body))
            assert cached.messages == whole.messages and cached.keys == whole.keys
            total += new_items
        per_turn = 3 if protocol == "chat" else 4
        # Each request converted its new turn and the item before it (the last boundary), not the whole history.
        assert total <= len(history) + 6 * per_turn
    finally:
        HistoryCache.convert = original  # type: ignore[method-assign]


def test_a_rewritten_item_is_converted_again_from_where_it_changed() -> None:
    adapter, cache = OpenAIChatAdapter(), HistoryCache()
    history = chat_history(4)
    adapter.parse({"messages": copy.deepcopy(history)}, cache)
    edited = copy.deepcopy(history)
    edited[4]["content"] = "file_0.py was deleted"  # the first tool answer rewritten
    cached = adapter.parse({"messages": edited}, cache)
    assert cached.messages == adapter.parse({"messages": copy.deepcopy(edited)}).messages
    assert cached.messages[3] == {"role": "tool", "content": "file_0.py was deleted"}  # after the merged reply
    other_system = [{"role": "system", "content": "Another prompt."}, *copy.deepcopy(history[1:])]
    assert adapter.parse({"messages": other_system}, cache).messages[0]["content"] == "Another prompt."


def test_calls_of_the_reused_part_are_known_and_an_output_without_its_call_is_refused() -> None:
    adapter, cache = OpenAIResponsesAdapter(), HistoryCache()
    history = responses_history(3)
    adapter.parse({"input": copy.deepcopy(history)}, cache)
    # A later request answering the first call again (reused part) is fine; one answering no call is refused.
    again = [*copy.deepcopy(history), {"type": "function_call_output", "call_id": "call0", "output": "again"}]
    assert adapter.parse({"input": again}, cache).messages[-1] == {"role": "tool", "content": "again"}
    orphan = [*copy.deepcopy(history), {"type": "function_call_output", "call_id": "nope", "output": "x"}]
    with pytest.raises(WireError) as refused:
        adapter.parse({"input": orphan}, cache)
    assert refused.value.param == f"input[{len(history)}].call_id"
