"""The model's raw output of one turn, parsed into what the wire formats send back, as it streams in.

`<think>…</think>` opening the output becomes the reasoning (or everything up to `</think>` when the chat
template's generation prompt opened `<think>` itself, as thinking models' templates do); hermes `<tool_call>`
blocks (only when the request offered tools) become tool calls and leave the visible text. A malformed call (not
JSON, no name, arguments not an object) is not turned into a call: it stays in the text as the model wrote it,
and the turn is counted as ill-formed in the record. Reasoning and text are trimmed of surrounding whitespace.
The exact tokens are untouched by any of this: the session keeps the engine's ids.

One parser serves streamed and whole replies (a whole reply is fed at once), so a stream's parts
add up to exactly the reply a non-streamed request gets. Fed text piece by piece, it gives out a part as soon as
it is sure of it and holds back only what may still be reasoning, a call or trailing whitespace: a partial
`<think>`, `</think>` or `<tool_call>` tag, a call until its `</tool_call>`. An output cut inside its reasoning
(length) keeps it as reasoning; a call cut before its closing tag is text.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.proxy.messages import assistant_message, tool_call
from rollout_buffer.tokens.hermes import parse_call_body


@dataclass(frozen=True)
class ReplyCall:
    """One tool call of a reply, with the id sent to the client."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class Reply:
    """One assistant turn as the client sees it, and what it cost."""

    text: str
    reasoning: str
    calls: list[ReplyCall]
    # "stop" | "length" | "tool_calls" | "stop_sequence"
    finish: str
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None
    ill_formed: bool = False
    call_errors: list[str] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """This reply as a canonical assistant message (reasoning left out, as in every echoed history)."""
        return assistant_message(self.text, [tool_call(c.name, c.arguments) for c in self.calls])


@dataclass(frozen=True)
class ReplyPart:
    """A piece of a reply as it streams: `reasoning` or `text` (a piece of it), or a whole `call`."""

    kind: str  # "reasoning" | "text" | "call"
    text: str = ""
    call: ReplyCall | None = None


_THINK, _END_THINK, _CALL, _END_CALL = "<think>", "</think>", "<tool_call>", "</tool_call>"


class ReplyParser:
    """Parses one reply as its text arrives (`feed`, then `close`); the parts so far add up to `text`,
    `reasoning` and `calls`."""

    def __init__(self, tools_offered: bool, reasoning_open: bool = False):
        self.tools_offered = tools_offered
        # The prompt opened the reasoning (`<think>` in the template's generation prompt): the output starts in it.
        self.reasoning_open = reasoning_open
        self.text = ""
        self.reasoning = ""
        self.calls: list[ReplyCall] = []
        self.errors: list[str] = []
        self.fed = ""  # everything fed so far
        self._mode = "think" if reasoning_open else "start"  # start | think | text | call
        self._pending = ""  # fed but not given out yet
        self._held = {"reasoning": "", "text": ""}  # whitespace that may be trailing
        self._parts: list[ReplyPart] = []

    def feed(self, piece: str) -> list[ReplyPart]:
        """The parts `piece` completes."""
        self.fed += piece
        self._pending += piece
        while self._step():
            pass
        return self._take()

    def close(self) -> list[ReplyPart]:
        """The parts held back until the end (trailing whitespace is dropped)."""
        rest, self._pending = self._pending, ""
        if self._mode == "call":
            self._out("text", _CALL + rest)
        else:
            self._out("reasoning" if self._mode == "think" else "text", rest)
        return self._take()

    def _take(self) -> list[ReplyPart]:
        parts, self._parts = self._parts, []
        return parts

    def _step(self) -> bool:
        """Move on by one tag or give out what is safe; True when a tag was passed (try again)."""
        buf = self._pending
        if self._mode == "start":
            lead = buf.lstrip()
            if not lead or (_THINK.startswith(lead) and lead != _THINK):
                return False  # may still open the reasoning
            if lead.startswith(_THINK):
                self._mode, self._pending = "think", lead[len(_THINK):]
            else:
                self._mode = "text"
            return True
        if self._mode == "think":
            return self._until(_END_THINK, "reasoning", "text")
        if self._mode == "text":
            if not self.tools_offered:
                self._out("text", buf)
                self._pending = ""
                return False
            return self._until(_CALL, "text", "call")
        end = buf.find(_END_CALL)
        if end < 0:
            return False
        body, self._pending = buf[:end], buf[end + len(_END_CALL):]
        self._mode = "text"
        call = parse_call_body(body)
        if call.error is not None:
            self.errors.append(call.error)
            self._out("text", _CALL + body + _END_CALL)
        else:
            reply_call = ReplyCall(_call_id(), call.name, call.arguments)
            self.calls.append(reply_call)
            self._parts.append(ReplyPart("call", call=reply_call))
        return True

    def _until(self, tag: str, kind: str, next_mode: str) -> bool:
        """Give out `kind` up to `tag` and switch to `next_mode` after it; without the tag yet, give out all but
        an end that may be the start of it."""
        buf = self._pending
        at = buf.find(tag)
        if at >= 0:
            self._out(kind, buf[:at])
            self._mode, self._pending = next_mode, buf[at + len(tag):]
            return True
        keep = _tag_start(buf, tag)
        self._out(kind, buf[:len(buf) - keep])
        self._pending = buf[len(buf) - keep:]
        return False

    def _out(self, kind: str, piece: str) -> None:
        started = bool(self.reasoning if kind == "reasoning" else self.text)
        piece = self._held[kind] + (piece if started else piece.lstrip())
        body = piece.rstrip()
        self._held[kind] = piece[len(body):]
        if not body:
            return
        if kind == "reasoning":
            self.reasoning += body
        else:
            self.text += body
        self._parts.append(ReplyPart(kind, body))


def _tag_start(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"
