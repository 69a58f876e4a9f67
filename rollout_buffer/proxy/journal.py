"""A harness session's durable form: the frames a committed turn appends to the session's file
(`proxy.session_files`), and the replay that rebuilds the session's branch tree from them after a restart.

The session's first frame holds what identifies it: run, instance, episode uid, key, repeat, URLs, metadata,
opening time. A turn's frame holds only what the turn added to its branch — the messages and exact tokens (ids,
loss mask, log-probs) past the point the branch stood at before the turn (its previous turn; the fork point of a
forked branch; nothing for a new one), the branch's state after the turn, and the reply's match key — never the
whole tree. It is encoded and written on the event loop (a few small copies, token arrays as raw bytes, one
`write`) before the turn is answered, so an answered turn survives `kill -9`. A turn taken back (its client never
received it) appends an undo frame; a closed session's file goes once its records are stored.

Replaying the frames in order gives the tree the session had: the same branch ids, exact tokens, routing keys and
counters. A turn in flight at a crash was never written: the client's retry runs it again.
"""

from __future__ import annotations

import logging
import struct
import time
from array import array
from dataclasses import dataclass
from typing import Any, Final

import orjson
import pybase64

from rollout_buffer.delivery.store import StoreError
from rollout_buffer.generation.context import RolloutContext
from rollout_buffer.proxy.messages import assistant_message, message_key, tool_call, tools_key
from rollout_buffer.proxy.replies import Reply
from rollout_buffer.proxy.session_files import SessionFiles
from rollout_buffer.proxy.tree import Branch, ResponseRef, Route, SessionTree
from rollout_buffer.tokens.conversation import Conversation
from rollout_buffer.tokens.marks import ConversationTail, TurnMark

log = logging.getLogger(__name__)


@dataclass
class StoredSession:
    """An open agent session as written down: what identifies it, its state (JSON), and its turns
    `(seq, meta, tokens, loss_mask, log_probs)` in order."""

    session_id: str
    run_id: str
    instance_id: str
    uid: str
    state: bytes
    turns: list[tuple[int, bytes, bytes, bytes, bytes]]

_IDS: Final = "i"  # token ids as int32
_FLOATS: Final = "d"  # log-probs as float64: exactly what the engine sent
# Frame kinds (the body's first byte), and a turn frame's fixed part: seq, then the lengths of its four parts.
_SESSION, _TURN, _UNDO = b"S", b"T", b"U"
_TURN_HEAD = struct.Struct("<I4I")
_SEQ = struct.Struct("<I")


class Journal:
    """Writes one harness session's frames to its file as its turns are committed. A write the disk refuses
    raises StoreError (nothing of it is kept)."""

    def __init__(self, files: SessionFiles, session_id: str, next_seq: int = 0):
        self.files = files
        self.session_id = session_id
        self._seq = next_seq

    def _write(self, body: bytes, first: bool = False) -> None:
        try:
            if first:
                self.files.create(self.session_id, body)
            else:
                self.files.append(self.session_id, body)
        except OSError as e:
            raise StoreError(f"session {self.session_id} could not be written: {e}") from None

    def opened(self, run_id: str, instance_id: str, uid: str, state: dict[str, Any]) -> None:
        """The session was opened: its first frame."""
        self._write(_SESSION + orjson.dumps([run_id, instance_id, uid, state]), first=True)

    def turn(self, branch: Branch, route: Route, base: TurnMark | None, reply: Reply, protocol: str,
             response: tuple[str, ResponseRef] | None = None) -> int:
        """`branch` just committed a turn routed by `route` (`base`: where a continued branch stood before it),
        answered as `response` when a later request may name it: written; returns the frame's sequence number
        (which `undo` takes)."""
        if route.kind == "continue":
            assert base is not None
            start = (base.messages, base.tokens, base.weight_versions)
        elif route.kind == "fork":
            point = branch.marks[route.turns - 1]
            start = (point.messages, point.tokens, 0)  # a fork's weight versions are its own output's
        else:
            start = (0, 0, 0)
        tail = branch.conv.tail(*start)
        m = tail.mark
        meta: dict[str, Any] = {
            "branch": branch.id, "route": route.kind, "parent": branch.parent, "fork_turns": branch.own_from,
            "shared": branch.shared_messages, "tools": branch.conv.tools if route.kind == "new" else None,
            "from": start,
            "messages": tail.new_messages, "versions": tail.weight_versions, "spans": tail.version_spans,
            "prompt_length": tail.prompt_length,
            "mark": [m.messages, m.tokens, m.weight_versions, m.assistant_turns, m.finish_reason, m.truncated,
                     m.log_probs_complete, m.abort_resumes],
            "reply": [reply.text, [[c.name, c.arguments] for c in reply.calls]],
            "tool_calls": len(reply.calls), "ill_formed": int(reply.ill_formed), "protocol": protocol,
            "at": branch.updated_at, "lane": branch.lane,
        }
        if response is not None:
            response_id, ref = response
            meta["response"] = [response_id, ref.instructions, sorted(ref.call_ids)]
        if tail.images:  # the images its tokens hold, by position (their bytes are in the run's image store)
            meta["images"] = tail.images
        if tail.top_p is not None:  # the kept ids of its tokens: where each token's end, and the ids (int32)
            meta["top_p"] = [tail.top_p[0], pybase64.b64encode(tail.top_p[1]).decode()]
        parts = (orjson.dumps(meta), array(_IDS, tail.token_ids).tobytes(), bytes(tail.loss_mask),
                 array(_FLOATS, tail.log_probs).tobytes())
        return self._append_turn(parts)

    def _append_turn(self, parts: tuple[bytes, ...] | list[bytes]) -> int:
        """Write a turn frame (meta JSON, ids, loss mask, log-probs) under the next sequence number; returns it."""
        seq = self._seq
        self._write(b"".join((_TURN, _TURN_HEAD.pack(seq, *map(len, parts)), *parts)))
        self._seq += 1
        return seq

    def undo(self, seq: int) -> None:
        """The turn `seq` was taken back."""
        self._write(_UNDO + _SEQ.pack(seq))

    def closed(self) -> None:
        """The session is closed (its records stored, or it was discarded): its file goes."""
        self.files.remove(self.session_id)


def load_sessions(files: SessionFiles) -> list[StoredSession]:
    """Every session written to `files`, as stored (turns taken back left out), oldest first. A file whose first
    frame is not a session's is skipped with a warning."""
    out: list[tuple[float, str, StoredSession]] = []
    for session_id, frames in files.load():
        if not frames or frames[0][:1] != _SESSION:
            log.warning("session file %s has no session frame; ignored", session_id)
            continue
        run_id, instance_id, uid, state = orjson.loads(frames[0][1:])
        turns: dict[int, tuple[int, bytes, bytes, bytes, bytes]] = {}
        for body in frames[1:]:
            kind = body[:1]
            if kind == _UNDO:
                turns.pop(_SEQ.unpack_from(body, 1)[0], None)
            elif kind == _TURN:
                seq, *lengths = _TURN_HEAD.unpack_from(body, 1)
                at, parts = 1 + _TURN_HEAD.size, []
                for n in lengths:
                    parts.append(body[at:at + n])
                    at += n
                meta, ids, mask, log_probs = parts
                turns[seq] = (seq, meta, ids, mask, log_probs)
        out.append((state.get("created_at", 0.0), session_id, StoredSession(
            session_id, run_id, instance_id, uid, orjson.dumps(state), [turns[k] for k in sorted(turns)])))
    return [stored for *_, stored in sorted(out)]


def load_state(stored: StoredSession) -> dict[str, Any]:
    """The session row's state (`Journal.opened`)."""
    state: dict[str, Any] = orjson.loads(stored.state)  # stored from a dict by `Journal.opened`
    return state


def replay(stored: StoredSession, ctx: RolloutContext, tree: SessionTree, responses: dict[str, ResponseRef]
           ) -> float | None:
    """Rebuild the branches of `tree`, and the `responses` later requests may name, from a stored session's turns;
    returns the wall time of the last turn (None when it had none). ValueError when the rows do not fit
    together."""
    last_at: float | None = None
    for _seq, meta_blob, ids, mask, log_probs in stored.turns:
        meta = orjson.loads(meta_blob)
        tokens = array(_IDS)
        tokens.frombytes(ids)
        floats = array(_FLOATS)
        floats.frombytes(log_probs)
        mark = TurnMark(*meta["mark"])
        messages_at, tokens_at, versions_at = meta["from"]
        top_p = meta.get("top_p")
        tail = ConversationTail(messages_at, tokens_at, versions_at, meta["messages"], tokens.tolist(), list(mask),
                                floats.tolist(), meta["versions"], meta["spans"], meta["prompt_length"], mark,
                                None if top_p is None else (top_p[0], pybase64.b64decode(top_p[1])),
                                [(int(at), str(sha)) for at, sha in meta.get("images", [])])
        branch = _branch_for(meta, tail, ctx, tree)
        branch.keys.extend(message_key(m) for m in tail.new_messages[:-1])
        branch.messages.extend(tail.new_messages[:-1])
        reply = _reply_message(meta["reply"])
        branch.keys.append(message_key(reply))
        branch.messages.append(reply)
        branch.marks.append(mark)
        if "response" in meta:
            response_id, instructions, call_ids = meta["response"]
            responses[response_id] = ResponseRef(branch, mark, instructions, frozenset(call_ids))
        branch.tool_calls += meta["tool_calls"]
        branch.ill_formed += meta["ill_formed"]
        branch.protocols.add(meta["protocol"])
        branch.updated_at = meta["at"]
        branch.lane = meta.get("lane")
        last_at = max(last_at or 0.0, meta["at"])
    tree.latest = max(tree.branches.values(), key=lambda b: b.updated_at, default=None)
    return last_at


def _branch_for(meta: dict[str, Any], tail: ConversationTail, ctx: RolloutContext, tree: SessionTree) -> Branch:
    """The branch a turn row extends: an existing one, or the new (or forked) branch it starts."""
    if meta["route"] == "continue":
        branch = tree.branches.get(meta["branch"])
        if branch is None:
            raise ValueError(f"turn of unknown branch {meta['branch']}")
        branch.conv.extend_tail(tail)
        return branch
    if meta["route"] == "fork":
        parent = tree.branches.get(meta["parent"])
        turns = meta["fork_turns"]
        if parent is None or not 0 < turns <= len(parent.marks):
            raise ValueError(f"fork of unknown branch {meta['parent']} or turn {turns}")
        conv = parent.conv.fork(parent.marks[turns - 1])
        conv.extend_tail(tail)
        branch = Branch(conv, list(parent.keys[:tail.messages]), parent.tools_key, list(parent.marks[:turns]),
                        turns, parent.id, meta["shared"], messages=parent.messages[:tail.messages])
        parent.forked_at.add(turns)
    else:
        conv = Conversation.restored(tail, ctx.tokenizer, tools=meta["tools"],
                                     sanity_check=ctx.run.sanity_check,  # type: ignore[arg-type]
                                     chat_template_kwargs=ctx.run.chat_template_kwargs, images=ctx.run.images)
        branch = Branch(conv, [], tools_key(meta["tools"]), parent=meta["parent"], shared_messages=meta["shared"])
    branch.id = meta["branch"]
    tree.adopt(branch)
    return branch


def _reply_message(reply: list[Any]) -> dict[str, Any]:
    text, calls = reply
    return assistant_message(text, [tool_call(name, arguments) for name, arguments in calls])


def idle_since(last_at: float | None, created_at: float, now: float) -> float:
    """The reading of a monotonic clock that reads `now` equal to the session's last activity (wall time) before
    the restart."""
    return now - max(0.0, time.time() - (last_at if last_at is not None else created_at))
