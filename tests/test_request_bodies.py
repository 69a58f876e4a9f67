"""A session's request body parsed from where it stops sharing bytes with the previous one gives exactly what
parsing it whole gives, whatever the client changed between two requests; a resent history keeps the previous
request's items (so comparing it with the converted history costs nothing)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_buffer.proxy.request_bodies import WORTH_BYTES, BodyCache, common_prefix

SERIALIZERS: dict[str, Callable[[Any], bytes]] = {
    "openai-python": lambda body: json.dumps(body).encode(),  # httpx: ", " and ": ", ASCII escapes
    "compact": lambda body: json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode(),
    "indented": lambda body: json.dumps(body, indent=2).encode(),
    "orjson": orjson.dumps,
}

text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12) | st.sampled_from(
    ["]", "],", '"]', "},{", '"messages": [', "\\", ","])
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]), "content": text}) | \
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=3)})
other = st.dictionaries(st.sampled_from(["model", "tools", "stream", "temperature", "input"]),
                        st.integers(-(2**53), 2**53) | text | st.lists(text, max_size=3), max_size=3)
# One request after another: append messages (the usual case), rewrite one, change the other fields, repeat a body.
step = st.one_of(st.tuples(st.just("append"), st.lists(message, min_size=1, max_size=3)),
                 st.tuples(st.just("rewrite"), st.integers(min_value=0), message),
                 st.tuples(st.just("drop-last"), st.just(None)),
                 st.tuples(st.just("fields"), other),
                 st.tuples(st.just("same"), st.just(None)))


def _apply(messages: list[Any], fields: dict[str, Any], change: tuple[str, Any, Any] | tuple[str, Any]
           ) -> tuple[list[Any], dict[str, Any]]:
    kind = change[0]
    if kind == "append":
        return messages + change[1], fields
    if kind == "rewrite" and messages:
        at = change[1] % len(messages)
        return [*messages[:at], change[2], *messages[at + 1:]], fields
    if kind == "drop-last" and len(messages) > 1:
        return messages[:-1], fields
    if kind == "fields":
        return messages, change[1]
    return messages, fields


@settings(max_examples=300, deadline=None, derandomize=True)
@given(serializer=st.sampled_from(sorted(SERIALIZERS)), key=st.sampled_from(["messages", "input"]),
       first=st.lists(message, min_size=1, max_size=4), head=other, steps=st.lists(step, min_size=1, max_size=6),
       history_first=st.booleans())
def test_every_body_parses_as_orjson_parses_it_whole(serializer: str, key: str, first: list[Any],
                                                     head: dict[str, Any], steps: list[Any],
                                                     history_first: bool) -> None:
    dump = SERIALIZERS[serializer]
    cache = BodyCache(min_bytes=0)
    messages, fields = first, {k: v for k, v in head.items() if k != key}

    def body() -> bytes:
        return dump({key: messages, **fields} if history_first else {**fields, key: messages})

    assert cache.parse(body(), key) == orjson.loads(body())
    for change in steps:
        messages, fields = _apply(messages, {k: v for k, v in fields.items() if k != key}, change)
        raw = body()
        assert cache.parse(raw, key) == orjson.loads(raw), (change, raw)


@pytest.mark.parametrize("output", ["x" * 40, "x" * 40_000])
def test_a_long_resent_history_keeps_the_previous_requests_items(output: str) -> None:
    """Past `WORTH_BYTES` a resent history is the previous request's items; a short body is parsed whole."""
    cache = BodyCache()
    messages = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": output}]
    fields = {"tools": [{"type": "function", "function": {"name": "shell"}}], "stream": False}
    first = cache.parse(json.dumps({"model": "m", "messages": messages, **fields}).encode(), "messages")
    messages += [{"role": "assistant", "content": "Running it."}, {"role": "user", "content": "1 failed"}]
    second = cache.parse(json.dumps({"model": "m", "messages": messages, **fields}).encode(), "messages")
    assert second == {"model": "m", "messages": messages, **fields}
    reused = [a is b for a, b in zip(first["messages"], second["messages"][:2], strict=False)]
    assert reused == [len(output) > WORTH_BYTES] * 2


def _m(i: int) -> str:
    return f'{{"role": "user", "content": "m{i}"}}'


@pytest.mark.parametrize("bodies", [
    # The history named twice: the later one replaces the first, as orjson (and Python's json) read it.
    [f'{{"messages": [{_m(0)}, {_m(1)}]}}', f'{{"messages": [{_m(0)}, {_m(1)}, {_m(2)}], "messages": [{_m(9)}]}}'],
    [f'{{"messages": [{_m(0)}], "model": "m", "messages": [{_m(1)}]}}',
     f'{{"messages": [{_m(0)}], "model": "m", "messages": [{_m(1)}, {_m(2)}]}}'],
    [f'{{"messages": [{_m(0)}, {_m(1)}], "messages": []}}',
     f'{{"messages": [{_m(0)}, {_m(1)}, {_m(2)}], "messages": []}}'],
    # A field named as the history's stand-in is named while the remainder is parsed.
    [f'{{"messages": [{_m(0)}]}}', f'{{"messages": [{_m(0)}, {_m(1)}], "\\u0000": [9]}}'],
    # Another array grows where the history would: not the history's end.
    [f'{{"messages": [{_m(0)}], "tools": [1]}}', f'{{"messages": [{_m(0)}], "tools": [1, 2]}}'],
    [f'{{"tools": [1], "messages": [{_m(0)}]}}', f'{{"tools": [1, 2], "messages": [{_m(0)}]}}'],
    # The last message's own array grows, or its text changes at a bracket.
    ['{"messages": [{"role": "user", "content": [1]}]}', '{"messages": [{"role": "user", "content": [1, 2]}]}'],
    ['{"messages": [{"role": "user", "content": "a]"}]}', '{"messages": [{"role": "user", "content": "a,b"}]}'],
])
def test_bodies_that_only_look_like_a_continued_history_parse_as_orjson_parses_them(bodies: list[str]) -> None:
    cache = BodyCache(min_bytes=0)
    for raw in bodies:
        assert cache.parse(raw.encode(), "messages") == orjson.loads(raw)


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'{"messages": 3}', b'{"messages": [1]} x'])
def test_what_is_not_a_body_with_a_history_is_parsed_or_refused_as_a_whole(raw: bytes) -> None:
    cache = BodyCache(min_bytes=0)
    cache.parse(b'{"messages": [1]}', "messages")
    try:
        expected = orjson.loads(raw)
    except orjson.JSONDecodeError:
        with pytest.raises(orjson.JSONDecodeError):
            cache.parse(raw, "messages")
    else:
        assert cache.parse(raw, "messages") == expected


@settings(deadline=None, derandomize=True)
@given(a=st.binary(max_size=300), b=st.binary(max_size=300), shared=st.integers(min_value=0, max_value=200_000))
def test_common_prefix_is_the_longest_shared_start(a: bytes, b: bytes, shared: int) -> None:
    base = bytes(range(256)) * (shared // 256)  # crosses the blocks the comparison goes by
    x, y = base + a, base + b
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    assert common_prefix(x, y) == n
