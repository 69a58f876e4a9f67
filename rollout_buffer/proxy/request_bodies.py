"""A session's request bodies parsed without parsing again the history they share with the previous one.

A coding agent resends its whole conversation every turn, and its client serializes the same messages to the
same bytes each time: the new body is the previous one up to the end of its last message, then the new messages
and the request's other fields. Parsing it whole costs as much as the context, every turn. `BodyCache` keeps the
previous body and its parse; a new body that shares a prefix with it ending between two messages of the history
array (`messages`, or the Responses API's `input`) is parsed from there on only, and its history is the previous
one's items (the same objects, which the history cache then compares by identity) followed by the new ones.

Where the shared prefix ends is checked, not assumed: the previous body's remainder from that point, after an
opening `{"<items>": [`, must parse to an empty array followed by exactly the fields that came after the history
in the previous body. That holds only when the prefix leaves the parser between two items of the top-level
history array (inside a string, a message or another field, the remainder does not parse, or parses to other
fields), so the result is what parsing the whole body gives. Anything else is parsed whole.

A session holds its last body's bytes for this, beside the parsed history it holds anyway.
"""

from __future__ import annotations

from typing import Any

import orjson

# The prefix is compared a block at a time (each a small copy of `a`'s, compared in place in `b`), then by halves
# in the block that differs.
_BLOCK = 1 << 16
# A remainder is parsed after an opening that names the history array by a key no client sends (JSON can write it
# only this one way), so that a body naming its history twice (the later one replaces the first) is seen and
# parsed whole, as is one that sends that key itself.
_ITEMS = "\x00"
_ITEMS_JSON = b'"\\u0000"'
_OPENING = b"{" + _ITEMS_JSON + b":["


def common_prefix(a: bytes, b: bytes) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    lo = 0
    while lo < n:
        hi = min(n, lo + _BLOCK)
        if not b.startswith(a[lo:hi], lo):
            break
        lo = hi
    else:
        return n
    while hi - lo > 1:  # b[lo:hi] differs from a[lo:hi] and everything before lo is equal
        mid = (lo + hi) // 2
        if b.startswith(a[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo  # the block narrowed to the one byte that differs


# Below this a body is parsed whole: the comparison and the two small parses would cost more than they save.
WORTH_BYTES = 1 << 14


class BodyCache:
    """One session's last request body and its parse (see the module docstring); bodies of `min_bytes` or more
    are continued from the previous one."""

    __slots__ = ("_key", "_min_bytes", "_parsed", "_raw")

    def __init__(self, min_bytes: int = WORTH_BYTES) -> None:
        self._min_bytes = min_bytes
        self._raw = b""
        self._key = ""
        self._parsed: dict[str, Any] | None = None

    def parse(self, raw: bytes, key: str) -> Any:
        """`raw` parsed as JSON (orjson's errors raised as they are), its `key` array continued from the previous
        body's where the two share it."""
        parsed = self._continued(raw, key)
        if parsed is None:
            parsed = orjson.loads(raw)
        if isinstance(parsed, dict) and isinstance(parsed.get(key), list):
            self._raw, self._key, self._parsed = raw, key, parsed
        else:
            self._raw, self._key, self._parsed = b"", "", None
        return parsed

    def _continued(self, raw: bytes, key: str) -> dict[str, Any] | None:
        before = self._parsed
        if before is None or key != self._key or len(raw) < self._min_bytes:
            return None
        if raw == self._raw:
            return before
        at = common_prefix(self._raw, raw)
        if at >= len(raw) or raw[at] != ord(",") or raw.find(_ITEMS_JSON, at) >= 0:
            return None
        fields = list(before)
        after = {k: before[k] for k in fields[fields.index(key) + 1:]}
        try:
            if orjson.loads(_OPENING + self._raw[at:]) != {_ITEMS: [], **after}:
                return None
            tail = orjson.loads(_OPENING + raw[at + 1:])
        except orjson.JSONDecodeError:
            return None
        if not isinstance(tail, dict) or key in tail:  # the history named again: it replaces the first one
            return None
        parsed = {k: before[k] for k in fields[:fields.index(key)]}  # the fields before the history: shared bytes
        parsed[key] = before[key] + tail.pop(_ITEMS)
        parsed.update(tail)
        return parsed
