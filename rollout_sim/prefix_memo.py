"""What the simulated engine computed over a conversation's earlier request, found again for its next one.

A conversation resends its whole context every turn. Decoding it and scanning it for the scripted policies anew
would cost the simulator as much as the context — and on a machine it shares with the buffer, it would show in
the buffer's own measured CPU too (its caches), which `bench.proxy --long-session` measures against the context
length. A memo keeps, for recent sequences (a prompt's ids, a prompt's text), a prefix and what was computed over
it; a sequence that extends one of them is computed from where that prefix ends, the result the same.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

S = TypeVar("S", str, list[int])
V = TypeVar("V")


@dataclass(frozen=True)
class Hit(Generic[V]):
    """A remembered prefix of the sequence looked up: its length, and what was computed over it."""

    key: int
    length: int
    value: V


class PrefixMemo(Generic[S, V]):
    """Prefixes of recent sequences (all `str` or all `list[int]`) with a value each; thread-safe (the simulator
    plans turns in worker threads). The most recent prefix a sequence extends is found first: a conversation's
    previous request, which replaced its earlier ones."""

    def __init__(self, size: int = 64):
        self.size = size
        self._entries: OrderedDict[int, tuple[S, V]] = OrderedDict()
        self._next_key = 0
        self._lock = threading.Lock()

    def find(self, seq: S) -> Hit[V] | None:
        """The most recent remembered prefix `seq` starts with, or None."""
        with self._lock:
            for key in reversed(self._entries):
                prefix, value = self._entries[key]
                if _extends(seq, prefix):
                    self._entries.move_to_end(key)
                    return Hit(key, len(prefix), value)
        return None

    def put(self, prefix: S, value: V, replacing: Hit[V] | None = None) -> None:
        """Remember `value` computed over `prefix`, in place of `replacing` (the shorter prefix it was computed
        from: one conversation keeps one entry)."""
        with self._lock:
            if replacing is not None:
                self._entries.pop(replacing.key, None)
            self._entries[self._next_key] = (prefix, value)
            self._next_key += 1
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)


def _extends(seq: Sequence[int] | str, prefix: Sequence[int] | str) -> bool:
    n = len(prefix)
    if n == 0 or n > len(seq):
        return False
    if isinstance(seq, str):
        assert isinstance(prefix, str)
        return seq.startswith(prefix)
    # Cheap refusals before comparing the whole prefix (which copies it).
    return seq[n - 1] == prefix[n - 1] and seq[n // 2] == prefix[n // 2] and seq[:n] == prefix
