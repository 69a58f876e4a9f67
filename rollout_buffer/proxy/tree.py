"""A session's message tree as linear branches: where a request continues, forks, or starts afresh.

Each branch is one exact-token `Conversation` and becomes one training sample. A request whose messages
extend a branch's (compared by match keys) continues it from its exact tokens. Otherwise the agent rewrote its
history (summarised, dropped or edited turns): a new branch starts, forked from the branch sharing the most
generated turns with the request — it keeps that prefix's exact tokens as context (loss 0: the parent trains
them) and renders the rest — or, when no generated turn is shared, rendered afresh from the messages.

A branch's `marks[i]` is its conversation's state after turn i + 1; turns before `own_from` were inherited
from its parent. Branches get ids in the order their first turn is committed; a branch whose only turn the
client never received is removed again, so ids may have gaps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.proxy.messages import MessageKey
from rollout_buffer.tokens.conversation import Conversation
from rollout_buffer.tokens.marks import TurnMark


@dataclass
class Branch:
    """One linear path of the tree."""

    conv: Conversation
    keys: list[MessageKey]  # one per committed message of `conv`
    tools_key: bytes
    marks: list[TurnMark] = field(default_factory=list)
    own_from: int = 0
    parent: int | None = None
    shared_messages: int = 0
    id: int | None = None
    busy: bool = False
    forked_at: set[int] = field(default_factory=set)  # turns other branches were forked from
    tool_calls: int = 0
    ill_formed: int = 0
    protocols: set[str] = field(default_factory=set)
    updated_at: float = field(default_factory=time.time)
    # The canonical message behind each key: what a later request naming one of this branch's turns continues
    # from (the Responses API's `previous_response_id`).
    messages: list[dict[str, Any]] = field(default_factory=list)
    # The client's own id of the conversation (its `X-Session-ID`: verifiers sends a trace id per agent run), when
    # it sends one: a request of one lane never continues or forks another lane's branch.
    lane: str | None = None

    @property
    def own_turns(self) -> int:
        return len(self.marks) - self.own_from

    def view(self) -> dict[str, Any]:
        """JSON-ready summary (the session view and a dashboard read it)."""
        return {
            "branch": self.id,
            "lane": self.lane,
            "parent_branch": self.parent,
            "fork_turn": self.own_from,
            "shared_messages": self.shared_messages,
            "turns": len(self.marks),
            "own_turns": self.own_turns,
            "messages": len(self.keys),
            "tokens": len(self.conv.token_ids),
            "response_tokens": len(self.conv.token_ids) - self.conv.prompt_length,
            "finish_reason": self.conv.finish_reason,
            "busy": self.busy,
            "tool_calls": self.tool_calls,
            "ill_formed_turns": self.ill_formed,
            "updated_at": self.updated_at,
        }


@dataclass(frozen=True)
class ResponseRef:
    """Where a turn a later request may name stands (the Responses API's `previous_response_id`): its branch and
    mark, how many leading messages were its request's own instructions, the ids of the tool calls it made."""

    branch: Branch
    mark: TurnMark
    instructions: int
    call_ids: frozenset[str]


@dataclass(frozen=True)
class Route:
    """How a request relates to the tree.

    kind `continue`: extend `branch`. `fork`: a new branch from `branch` after its turn `turns`. `new`: a
    branch rendered afresh (`branch` is the one sharing the most messages, for the record, or None).
    `start`: the index of the first request message the chosen branch does not hold yet.
    """

    kind: str
    branch: Branch | None
    turns: int
    start: int
    shared: int


def common_prefix(a: list[MessageKey], b: list[MessageKey]) -> int:
    """Length of the common prefix of two key lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a request extending a branch), compared in C
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionTree:
    """The committed branches of one session, newest activity first when routing."""

    def __init__(self) -> None:
        self.branches: dict[int, Branch] = {}
        self._next_id = 0
        self.latest: Branch | None = None

    def route(self, keys: list[MessageKey], tools: bytes, lane: str | None = None) -> Route:
        """Where a request with these message keys (the last one not an assistant's) and tools goes; with a `lane`,
        only that lane's branches (and those of none) are continued or forked."""
        best_fork: tuple[int, Branch, int, int] | None = None  # (messages at the fork, branch, turns, shared)
        best_shared: tuple[int, Branch] | None = None
        for branch in sorted(self.branches.values(), key=lambda b: -b.updated_at):
            if branch.tools_key != tools:
                continue
            n = common_prefix(branch.keys, keys)
            if lane is not None and branch.lane is not None and branch.lane != lane:
                if n and (best_shared is None or n > best_shared[0]):
                    best_shared = (n, branch)
                continue
            if n == len(branch.keys) < len(keys) and not branch.busy and not branch.conv.truncated:
                return Route("continue", branch, len(branch.marks), n, n)
            if n and (best_shared is None or n > best_shared[0]):
                best_shared = (n, branch)
            turns = sum(1 for m in branch.marks if m.messages <= n)
            while turns and branch.marks[turns - 1].truncated:
                turns -= 1
            if turns:
                at = branch.marks[turns - 1].messages
                if best_fork is None or at > best_fork[0]:
                    best_fork = (at, branch, turns, n)
        if best_fork is not None:
            at, branch, turns, shared = best_fork
            return Route("fork", branch, turns, at, shared)
        if best_shared is not None:
            return Route("new", best_shared[1], 0, 0, best_shared[0])
        return Route("new", None, 0, 0, 0)

    def add(self, branch: Branch) -> None:
        """Commit a new branch (its first own turn is done): it gets the next id."""
        branch.id = self._next_id
        self._next_id += 1
        self.branches[branch.id] = branch

    def adopt(self, branch: Branch) -> None:
        """Put back a branch that keeps its id (a session restored after a restart)."""
        assert branch.id is not None
        self.branches[branch.id] = branch
        self._next_id = max(self._next_id, branch.id + 1)

    def remove(self, branch: Branch) -> None:
        """Drop a branch whose only turn was never delivered."""
        if branch.id is not None:
            self.branches.pop(branch.id, None)
        if self.latest is branch:
            self.latest = max(self.branches.values(), key=lambda b: b.updated_at, default=None)

    def touch(self, branch: Branch) -> None:
        """`branch` just committed a turn."""
        branch.updated_at = time.time()
        self.latest = branch

    def view(self) -> list[dict[str, Any]]:
        """Every branch's summary, by id."""
        return [self.branches[i].view() for i in sorted(self.branches)]
