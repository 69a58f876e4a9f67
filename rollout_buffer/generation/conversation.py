"""One trajectory's conversation: OpenAI messages and, in token mode, the exact token sequence beside them.

Token mode (a tokenizer is given) keeps what the model really saw and produced:

- the prompt is the chat template's rendering of the first messages with the generation prompt (loss 0);
- an assistant turn appends the engine's own output ids (loss 1, with their log-probs) and is never
  re-tokenized; what the template writes after the end-of-turn token (Qwen's "\\n" after `<|im_end|>`)
  follows at loss 0, and the whole closing when the engine stopped on a stop string instead;
- user and tool messages append only the template's text for them (loss 0), rendered after a fixed base
  history, so templates that rewrite earlier turns (Qwen3 drops old reasoning) cannot shift the delta;
- a turn cut by the length limit (or aborted) ends the conversation: there is no clean place to go on.

The sanity check compares the sequence with the template applied to the final messages at once:

- `strict`: token for token. Qwen3's template drops the `<think>` block of every assistant turn that
  precedes a later user message, and adds an empty one to a final turn that has none, so with reasoning
  models `strict` reports those turns: the sequence keeps the reasoning the model generated, which is
  what training must see.
- `ignore_strippable`: decoded text, ignoring whitespace and `<think>…</think>` blocks on both sides,
  the two things such templates rewrite. Qwen3's expected difference passes; a changed word, a lost
  message or a wrong delta is still reported.
- `disable`: no check.

Branches (the agent proxy): `mark()` after an assistant turn remembers where the conversation stood;
`restore(mark)` undoes what came after it (a turn the client never received), and `fork(mark)` starts a new
conversation from that point whose earlier tokens are context (loss 0, part of its prompt), for an agent that
rewrote its history. `add_context` appends messages of any role at loss 0, assistant ones too (turns the
engine did not generate for this conversation). `tail(...)` is what a conversation gained since a point, and
`extend_tail` / `restored` rebuild an exact copy from tails (a persisted agent session after a restart).

Chat mode (no tokenizer) keeps the messages only.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import re
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from rollout_buffer.delivery.versions import mask_older_versions
from rollout_buffer.generation.chat_render import chat_renderer
from rollout_buffer.generation.tokenizer import end_of_turn_ids

SanityCheckMode = Literal["strict", "ignore_strippable", "disable"]

# Environment messages are rendered after this history, which has no assistant turn for a template to
# rewrite; only the text past it is appended.
BASE_HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello."},
]
_PROBE_REPLY = "rollout-buffer probe reply"
_REASONING = re.compile(r"<think>.*?</think>", re.DOTALL)
# Finish reasons that leave the assistant turn unfinished.
_CUT = frozenset({"length", "abort"})
# Template renders and encodes of conversations up to this size (characters of message content) run on the
# event loop: a math prompt renders and encodes in about 0.1 ms, while a hop to a worker thread costs the loop
# more than that under load (future chaining plus a GIL hand-off each way). Bigger ones go to a thread.
INLINE_CHARS = 2048
_PER_MESSAGE_CHARS = 32  # the template's framing of one message
_SNIPPET_TOKENS = (8, 24)
_SNIPPET_CHARS = (40, 120)


@dataclass(frozen=True)
class TurnMark:
    """Where a conversation stood right after one of its assistant turns (`Conversation.mark`)."""

    messages: int
    tokens: int
    weight_versions: int
    assistant_turns: int
    finish_reason: str | None
    truncated: bool
    log_probs_complete: bool


@dataclass(frozen=True)
class ConversationTail:
    """What a conversation gained after a point (`Conversation.tail`): the new messages, tokens with their loss
    mask and log-probs, new weight versions, the version spans ending past the point, and the state it ended in
    (prompt length, the mark of its last assistant turn). `messages`, `tokens`, `versions`: the point, as
    counts."""

    messages: int
    tokens: int
    versions: int
    new_messages: list[dict[str, Any]]
    token_ids: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    weight_versions: list[str]
    version_spans: list[list[Any]]
    prompt_length: int
    mark: TurnMark


@dataclass(frozen=True)
class _Frame:
    """What the chat template writes around messages, for one tokenizer, tool list and template options."""

    base_text: str
    generation_prompt_ids: tuple[int, ...]
    # The generation prompt opens a reasoning block (`<think>`): the model's output starts inside it.
    opens_reasoning: bool
    closing_text: str  # after an assistant reply's content: end-of-turn token and what follows it
    closing_ids: tuple[int, ...]
    end_of_turn: frozenset[int]
    # Added tokens the tokenizer's encoding provably restarts after (see `_restart_tokens`), by id.
    restart_tokens: dict[int, str]


@functools.lru_cache(maxsize=256)
def _frame(tokenizer: Any, tools_json: bytes, options_json: bytes) -> _Frame:
    render = chat_renderer(tokenizer, tools_json, options_json).render
    base = render(BASE_HISTORY, False)
    with_prompt = render(BASE_HISTORY, True)
    replied = render([*BASE_HISTORY, {"role": "assistant", "content": _PROBE_REPLY}], False)
    if not with_prompt.startswith(base):
        raise ValueError("chat template rewrites the history when asked for a generation prompt")
    closing = replied[replied.rindex(_PROBE_REPLY) + len(_PROBE_REPLY):]
    closing_ids = tokenizer.encode(closing, add_special_tokens=False)
    eot = end_of_turn_ids(tokenizer)
    if not closing_ids or closing_ids[0] != eot[0]:
        raise ValueError(f"chat template closes assistant turns with {closing!r}, not an end-of-turn token")
    return _Frame(
        base_text=base,
        generation_prompt_ids=tuple(tokenizer.encode(with_prompt[len(base):], add_special_tokens=False)),
        opens_reasoning=with_prompt.rstrip().endswith("<think>"),
        closing_text=closing,
        closing_ids=tuple(closing_ids),
        end_of_turn=frozenset(eot),
        restart_tokens=_restart_tokens(tokenizer),
    )


def _restart_tokens(tokenizer: Any) -> dict[int, str]:
    """Added tokens (`<|im_start|>`, ...) at whose end the fast tokenizer's encoding starts afresh.

    A fast tokenizer cuts the text at added tokens before anything else, so the ids of `a + b` are the ids of
    `a` and of `b` when `a` ends with such a token, provided the token strips no whitespace next to it, is
    matched on the raw text, and is not part of a longer added token (which could match across the cut).
    """
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return {}
    added = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
    contents = [t.content for t in added.values()]
    return {
        i: t.content for i, t in added.items()
        if not (t.lstrip or t.rstrip or t.single_word or t.normalized)
        and t.content and not any(t.content != other and t.content in other for other in contents)
    }


# The repeats of one task (a GRPO group) open with the same prompt, usually back to back: render it once.
# Only prompts up to this size (as JSON) are kept, which bounds the cache to a few MB.
_PROMPT_CACHE_MAX_BYTES = 8192


@dataclass(frozen=True)
class _Prompt:
    """A rendered prompt, its ids, and the part of both up to its last restart token (when verified)."""

    text: str
    ids: tuple[int, ...]
    head: tuple[str, tuple[int, ...]] | None


@functools.lru_cache(maxsize=256)
def _prompt(tokenizer: Any, messages_json: bytes, tools_json: bytes, options_json: bytes) -> _Prompt:
    text = chat_renderer(tokenizer, tools_json, options_json).render(orjson.loads(messages_json), True)
    ids = tuple(encode(tokenizer, text))
    return _Prompt(text, ids, _head(tokenizer, _frame(tokenizer, tools_json, options_json), text, ids))


def _head(tokenizer: Any, frame: _Frame, text: str, ids: tuple[int, ...]) -> tuple[str, tuple[int, ...]] | None:
    """`text` and `ids` up to the last restart token, when encoding the two halves apart gives `ids` again.

    Every sequence that starts with this head then encodes as the head's ids followed by the encoding of the
    rest: the tokenization check encodes only what follows the prompt's last `<|im_start|>`. Computed once
    per prompt (the cache above), so the two verifying encodes are shared by the whole group.
    """
    k = next((k for k in range(len(ids) - 1, -1, -1) if ids[k] in frame.restart_tokens), None)
    if k is None:
        return None
    cut = text.rfind(frame.restart_tokens[ids[k]]) + len(frame.restart_tokens[ids[k]])
    head_text, head_ids = text[:cut], ids[:k + 1]
    if tuple(encode(tokenizer, head_text)) != head_ids or tuple(encode(tokenizer, text[cut:])) != ids[k + 1:]:
        return None
    return head_text, head_ids


def encode(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False)`, through the Rust tokenizer directly when there is one:
    same ids without the ~30% Python wrapping of transformers, and `encode_batch` lets go of the GIL while
    it works (this runs for every trajectory, in worker threads for long ones)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode_batch([text], add_special_tokens=False)[0].ids
    return tokenizer.encode(text, add_special_tokens=False)


class Conversation:
    """Messages of one trajectory (one per role in multi-agent runs) and, with a tokenizer, its exact tokens.

    Build it with the opening messages; then alternate `generation_ids()` → engine → `add_assistant(...)`
    and `add_messages([...])` for tool results or user turns; finish with `check()` and `record_fields()`.
    The `a`-prefixed variants run template renders and tokenization in a thread, off the event loop, unless
    the conversation is small enough (`INLINE_CHARS`) that the hop would cost more than the work.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    token_mode: bool
    sanity_check: SanityCheckMode
    token_ids: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    weight_versions: list[str]
    # [start, end, weight_version] over token positions: which weights generated each stretch of output.
    version_spans: list[list[Any]]
    prompt_length: int
    truncated: bool
    finish_reason: str | None

    def __init__(
        self,
        messages: list[dict[str, Any]],
        tokenizer: Any = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        sanity_check: SanityCheckMode = "strict",
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not messages:
            raise ValueError("a conversation starts with at least one message")
        self._setup(tokenizer, tools, sanity_check, chat_template_kwargs)
        self.messages = list(messages)
        if self.token_mode:
            self._render_prompt(self.messages)

    def _setup(self, tokenizer: Any, tools: list[dict[str, Any]] | None, sanity_check: SanityCheckMode,
               chat_template_kwargs: dict[str, Any] | None) -> None:
        if sanity_check not in ("strict", "ignore_strippable", "disable"):
            raise ValueError(f"sanity_check must be strict, ignore_strippable or disable: {sanity_check!r}")
        self.messages = []
        self.tools = tools
        self.sanity_check = sanity_check
        self.token_mode = tokenizer is not None
        self.token_ids, self.loss_mask, self.log_probs, self.weight_versions = [], [], [], []
        self.version_spans = []
        self.prompt_length = 0
        self.truncated = False
        self.finish_reason = None
        self._tokenizer = tokenizer
        self._options = dict(chat_template_kwargs or {})
        self._log_probs_complete = True
        self._open = False  # token_ids ends with the generation prompt
        self._forked = False  # a fork before its first own turn: the prompt extends to that turn
        self._assistant_turns = 0
        # The run of environment messages since the last assistant turn, re-rendered as a whole when it
        # grows (consecutive tool messages share one block in Qwen's template).
        self._env_messages_start = 0
        self._env_tokens_start = 0
        self._env_text = ""
        self._prompt_head: tuple[str, tuple[int, ...]] | None = None
        if self.token_mode:
            self._template_key = (orjson.dumps(tools), orjson.dumps(self._options, option=orjson.OPT_SORT_KEYS))
            self._frame = _frame(tokenizer, *self._template_key)
            self._renderer = chat_renderer(tokenizer, *self._template_key)

    @classmethod
    def restored(cls, tail: ConversationTail, tokenizer: Any, *, tools: list[dict[str, Any]] | None = None,
                 sanity_check: SanityCheckMode = "strict", chat_template_kwargs: dict[str, Any] | None = None
                 ) -> Conversation:
        """A token-mode conversation rebuilt from the `tail` of one taken from its start (a persisted agent
        session after a restart): the same tokens, masks, log-probs and messages; nothing is rendered again."""
        conv = cls.__new__(cls)
        conv._setup(tokenizer, tools, sanity_check, chat_template_kwargs)
        conv.extend_tail(tail)
        return conv

    @classmethod
    async def acreate(
        cls,
        messages: list[dict[str, Any]],
        tokenizer: Any = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        sanity_check: SanityCheckMode = "strict",
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> Conversation:
        """`Conversation(...)` with the prompt rendered and tokenized in a thread (inline when small)."""
        kwargs: dict[str, Any] = {
            "tools": tools, "sanity_check": sanity_check, "chat_template_kwargs": chat_template_kwargs,
        }
        if tokenizer is None or _light(messages, tools):
            return cls(messages, tokenizer, **kwargs)
        return await asyncio.to_thread(functools.partial(cls, messages, tokenizer, **kwargs))

    # -- token mode -------------------------------------------------------------------------------

    @property
    def prompt_opens_reasoning(self) -> bool:
        """True when the chat template's generation prompt opens `<think>` (the output starts as reasoning)."""
        return self._frame.opens_reasoning

    def generation_ids(self) -> list[int]:
        """The tokens to send to the engine for the next assistant turn, generation prompt included."""
        self._require_tokens()
        self._require_not_truncated()
        return self.token_ids + ([] if self._open else list(self._frame.generation_prompt_ids))

    def add_assistant(
        self,
        output_ids: list[int],
        log_probs: list[float] | None,
        text: str,
        *,
        weight_version: str | None = None,
        finish_reason: str = "stop",
        version_segments: list[tuple[int, str | None]] | None = None,
    ) -> None:
        """Append one engine turn: its own output ids (loss 1) and log-probs, and `text` as the message.

        `text` should be what the ids decode to; it is kept in `messages` and never re-tokenized.
        `finish_reason` is the engine's ("stop", "length", "abort"): an output that neither ends with an
        end-of-turn token nor stopped cleanly truncates the conversation. `version_segments` lists
        (tokens, weight_version) of the answers the turn was generated in (abort resumes may cross a weight
        update); without it the whole turn has `weight_version`.
        """
        self._require_tokens()
        self._require_not_truncated()
        if log_probs is not None and len(log_probs) != len(output_ids):
            raise ValueError(f"{len(log_probs)} log-probs for {len(output_ids)} output ids")
        if not self._open:
            self._append(self._frame.generation_prompt_ids, 0)
        self._add_version_spans(len(self.token_ids), len(output_ids), weight_version, version_segments)
        if self._forked:
            self.prompt_length, self._forked = len(self.token_ids), False
        self._append(output_ids, 1, log_probs)
        if log_probs is None and output_ids:
            self._log_probs_complete = False
        if output_ids and output_ids[-1] in self._frame.end_of_turn:
            self._append(self._frame.closing_ids[1:], 0)
        elif finish_reason in _CUT:
            self.truncated = True
        else:
            # Stopped on a stop string: the template's closing finishes the turn, but was not generated.
            self._append(self._frame.closing_ids, 0)
        self._end_assistant_turn(text, finish_reason)
        self._open = False
        self._env_tokens_start = len(self.token_ids)

    async def aadd_assistant(
        self,
        output_ids: list[int],
        log_probs: list[float] | None,
        text: str,
        *,
        weight_version: str | None = None,
        finish_reason: str = "stop",
        version_segments: list[tuple[int, str | None]] | None = None,
    ) -> None:
        """`add_assistant` for async callers; it renders nothing, so it runs inline."""
        self.add_assistant(output_ids, log_probs, text, weight_version=weight_version,
                           finish_reason=finish_reason, version_segments=version_segments)

    def _add_version_spans(self, start: int, count: int, version: str | None,
                           segments: list[tuple[int, str | None]] | None) -> None:
        if not segments or sum(n for n, _ in segments) != count:
            segments = [(count, version)]
        for n, v in segments:
            if n <= 0 and len(segments) > 1:
                continue  # an answer without tokens (aborted at once) generated nothing with its weights
            self._note_version(v)
            if n <= 0:
                continue
            last = self.version_spans[-1] if self.version_spans else None
            if last is not None and last[1] == start and last[2] == v:
                last[1] = start + n
            else:
                self.version_spans.append([start, start + n, v])
            start += n

    def _note_version(self, version: str | None) -> None:
        if version is not None and version not in self.weight_versions:
            self.weight_versions.append(version)

    def response_tokens_used(self) -> int:
        """Tokens the response will hold once the next assistant turn starts (generation prompt counted)."""
        self._require_tokens()
        if self._forked:
            return 0
        pending = 0 if self._open or self.truncated else len(self._frame.generation_prompt_ids)
        return len(self.token_ids) + pending - self.prompt_length

    def record_fields(self, mask_offpolicy: bool = False) -> dict[str, Any]:
        """The exact-token fields of the trajectory record; `{}` in chat mode.

        `loss_mask` covers every token; `rollout_log_probs` covers the response (0.0 on loss-0 tokens) and
        is left out when some turn came without log-probs, rather than faked. `mask_offpolicy` sets loss 0
        on tokens generated with an older weight version than the newest one of the conversation.
        """
        if not self.token_mode:
            return {}
        loss_mask = list(self.loss_mask)
        if mask_offpolicy:
            mask_older_versions(loss_mask, ((start, end, v) for start, end, v in self.version_spans))
        fields: dict[str, Any] = {
            "tokens": list(self.token_ids),
            "loss_mask": loss_mask,
            "response_length": len(self.token_ids) - self.prompt_length,
            "weight_versions": list(self.weight_versions),
        }
        if self._log_probs_complete:
            fields["rollout_log_probs"] = self.log_probs[self.prompt_length:]
        return fields

    # -- both modes -------------------------------------------------------------------------------

    def add_assistant_text(self, text: str, finish_reason: str = "stop", *,
                           tool_calls: list[dict[str, Any]] | None = None,
                           reasoning_content: str | None = None, weight_version: str | None = None) -> None:
        """Chat mode: append an assistant message the engine produced from `messages`.

        `tool_calls` (OpenAI shape: `id`, `type`, `function` with `name` and JSON-string `arguments`), as a
        server with a tool-call parser answers them, and a separated `reasoning_content` are kept in the
        message, so the chat template renders the turn as the model wrote it; `weight_version` is the
        engine's version for the turn.
        """
        if self.token_mode:
            raise RuntimeError("token mode keeps the engine's output ids: use add_assistant")
        self._require_not_truncated()
        if finish_reason in _CUT:
            self.truncated = True
        self._note_version(weight_version)
        self._end_assistant_turn(text, finish_reason, tool_calls, reasoning_content)

    def add_messages(self, new: list[dict[str, Any]]) -> None:
        """Append user or tool messages; in token mode their template text follows at loss 0."""
        if any(m.get("role") == "assistant" for m in new):
            raise ValueError("assistant turns come from the engine: use add_assistant")
        self.add_context(new)

    def add_context(self, new: list[dict[str, Any]]) -> None:
        """Append messages of any role as context (loss 0), assistant messages the engine did not generate
        for this conversation included; rendered like `add_messages`."""
        self._require_not_truncated()
        if not new:
            return
        if self.token_mode:
            self._append_environment(new)
        else:
            self.messages.extend(new)

    async def aadd_messages(self, new: list[dict[str, Any]]) -> None:
        """`add_messages` with the template render in a thread (inline when small)."""
        if any(m.get("role") == "assistant" for m in new):
            raise ValueError("assistant turns come from the engine: use add_assistant")
        await self.aadd_context(new)

    async def aadd_context(self, new: list[dict[str, Any]]) -> None:
        """`add_context` with the template render in a thread (inline when small)."""
        rendered = self.messages if self._assistant_turns == 0 else self.messages[self._env_messages_start:]
        if self.token_mode and not _light([*rendered, *new], self.tools):
            await asyncio.to_thread(self.add_context, new)
        else:
            self.add_context(new)

    def mark(self) -> TurnMark:
        """The state right after the last assistant turn, for `restore` and `fork`.

        Valid for as long as the conversation exists: past its first assistant turn a conversation only grows.
        Raises RuntimeError before the first assistant turn or while messages follow the last one.
        """
        self._require_tokens()
        if self._assistant_turns == 0 or self._env_messages_start != len(self.messages):
            raise RuntimeError("a mark is taken right after an assistant turn")
        return TurnMark(len(self.messages), len(self.token_ids), len(self.weight_versions), self._assistant_turns,
                        self.finish_reason, self.truncated, self._log_probs_complete)

    def restore(self, mark: TurnMark) -> None:
        """Undo everything appended after `mark` (taken on this conversation)."""
        self._require_tokens()
        if mark.messages > len(self.messages) or mark.tokens > len(self.token_ids):
            raise ValueError("the mark is past the end of this conversation")
        del self.messages[mark.messages:], self.weight_versions[mark.weight_versions:]
        self._truncate_to(mark.tokens)
        self.version_spans = [[start, min(end, mark.tokens), v] for start, end, v in self.version_spans
                              if start < mark.tokens]
        self._assistant_turns = mark.assistant_turns
        self.finish_reason, self.truncated = mark.finish_reason, mark.truncated
        self._log_probs_complete = mark.log_probs_complete
        self._open = False
        self._env_messages_start, self._env_tokens_start, self._env_text = mark.messages, mark.tokens, ""

    def fork(self, mark: TurnMark) -> Conversation:
        """A new conversation holding this one as it stood at `mark`: those tokens, and the messages added before
        its first own turn, are its prompt (loss 0); what it generates from then on is its response. The
        original is untouched."""
        self._require_tokens()
        if mark.truncated:
            raise RuntimeError("cannot continue from a turn that was cut")
        other = copy.copy(self)
        other.messages = self.messages[:mark.messages]
        other.token_ids = self.token_ids[:mark.tokens]
        other.loss_mask = [0] * mark.tokens
        other.log_probs = [0.0] * mark.tokens
        other.weight_versions = []
        other.version_spans = []  # like its weight versions: its own output's (copy.copy would share the list)
        other.prompt_length = mark.tokens
        other.finish_reason, other.truncated, other._log_probs_complete = mark.finish_reason, False, True
        other._assistant_turns = mark.assistant_turns
        other._open, other._forked = False, True
        other._env_messages_start, other._env_tokens_start, other._env_text = mark.messages, mark.tokens, ""
        return other

    def tail(self, messages: int, tokens: int, versions: int) -> ConversationTail:
        """What the conversation holds past its first `messages` messages, `tokens` tokens and `versions` weight
        versions, taken right after an assistant turn: what `extend_tail` appends to a copy standing there."""
        return ConversationTail(
            messages, tokens, versions, self.messages[messages:], self.token_ids[tokens:], self.loss_mask[tokens:],
            self.log_probs[tokens:], self.weight_versions[versions:], self._spans_past(tokens), self.prompt_length,
            self.mark())

    def _spans_past(self, tokens: int) -> list[list[Any]]:
        """Copies of the version spans that end past `tokens` (the last few: spans are in token order)."""
        k = len(self.version_spans)
        while k and self.version_spans[k - 1][1] > tokens:
            k -= 1
        return [list(s) for s in self.version_spans[k:]]

    def extend_tail(self, tail: ConversationTail) -> None:
        """Append a `tail` (of a conversation that stood where this one stands): this one then equals it."""
        self._require_tokens()
        if (len(self.messages), len(self.token_ids), len(self.weight_versions)) != (
                tail.messages, tail.tokens, tail.versions):
            raise ValueError("the tail does not start where this conversation stands")
        mark = tail.mark
        if (mark.messages, mark.tokens, mark.weight_versions) != (
                tail.messages + len(tail.new_messages), tail.tokens + len(tail.token_ids),
                tail.versions + len(tail.weight_versions)) or not (
                len(tail.token_ids) == len(tail.loss_mask) == len(tail.log_probs)):
            raise ValueError("the tail is inconsistent with its own end")
        self.messages.extend(tail.new_messages)
        self.token_ids.extend(tail.token_ids)
        self.loss_mask.extend(tail.loss_mask)
        self.log_probs.extend(tail.log_probs)
        self.weight_versions.extend(tail.weight_versions)
        self.version_spans = [*(s for s in self.version_spans if s[1] <= tail.tokens),
                              *(list(s) for s in tail.version_spans)]
        self.prompt_length = tail.prompt_length
        self._assistant_turns = mark.assistant_turns
        self.finish_reason, self.truncated = mark.finish_reason, mark.truncated
        self._log_probs_complete = mark.log_probs_complete
        self._open = self._forked = False
        self._env_messages_start, self._env_tokens_start, self._env_text = mark.messages, mark.tokens, ""

    def check(self) -> dict[str, Any] | None:
        """Compare the sequence with the template's rendering of the final messages (see the module doc).

        Returns None when consistent (and always in chat mode or with `disable`); otherwise where they
        first differ: `position` (a token index, or a character offset in the decoded sequence for
        `ignore_strippable`), `unit`, decoded `expected` / `actual` snippets and both lengths. Never raises:
        a template that fails to render is reported under `error`.
        """
        if not self.token_mode or self.sanity_check == "disable":
            return None
        try:
            expected = self._full_render()
            if self.sanity_check == "strict":
                return self._compare_tokens(self._expected_ids(expected))
            return self._compare_text(expected)
        except Exception as e:  # the check diagnoses; it must not fail a finished trajectory
            return {"mode": self.sanity_check, "error": f"{type(e).__name__}: {e}"}

    async def acheck(self) -> dict[str, Any] | None:
        """`check` with the full render in a thread (inline when small)."""
        if not self.token_mode or self.sanity_check == "disable":
            return None
        if _light(self.messages, self.tools):
            return self.check()
        return await asyncio.to_thread(self.check)

    # -- internals --------------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self._renderer.render(messages, generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return encode(self._tokenizer, text)

    def _expected_ids(self, expected: str) -> list[int]:
        """`encode(expected)`, reusing the prompt's ids up to its last restart token when `expected` starts
        with them (the full render of a conversation usually does): same ids, a fraction of the work."""
        head = self._prompt_head
        if head is not None and expected.startswith(head[0]):
            return [*head[1], *self._encode(expected[len(head[0]):])]
        return self._encode(expected)

    def _append(self, ids: list[int] | tuple[int, ...], loss: int, log_probs: list[float] | None = None
                ) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([loss] * len(ids))
        self.log_probs.extend(log_probs if log_probs is not None else [0.0] * len(ids))

    def _truncate_to(self, n: int) -> None:
        del self.token_ids[n:], self.loss_mask[n:], self.log_probs[n:]

    def _render_prompt(self, messages: list[dict[str, Any]]) -> None:
        try:
            key: bytes | None = orjson.dumps(messages)
        except TypeError:  # not JSON (a caller's own objects): rendered without the cache
            key = None
        ids: tuple[int, ...] | list[int]
        head = None
        if key is not None and len(key) <= _PROMPT_CACHE_MAX_BYTES:
            prompt = _prompt(self._tokenizer, key, *self._template_key)
            text, ids, head = prompt.text, prompt.ids, prompt.head
        else:
            text = self._render(messages, True)
            ids = self._encode(text)
        if text == self._env_text:
            raise ValueError(f"chat template renders nothing for roles {[m.get('role') for m in messages]}")
        self.messages = messages
        self._truncate_to(0)
        self._append(ids, 0)
        self.prompt_length = len(ids)
        self._prompt_head = head
        self._env_text = text
        self._open = True

    def _append_environment(self, new: list[dict[str, Any]]) -> None:
        if self._assistant_turns == 0:
            # Still the prompt: render it again whole, so it matches the template exactly.
            self._render_prompt([*self.messages, *new])
            return
        run = [*self.messages[self._env_messages_start:], *new]
        rendered = self._render([*BASE_HISTORY, *run], False)
        if not rendered.startswith(self._frame.base_text):
            raise ValueError("chat template rewrites the base history when messages follow it")
        delta = rendered[len(self._frame.base_text):]
        if delta == self._env_text:
            raise ValueError(f"chat template renders nothing for roles {[m.get('role') for m in new]}")
        ids = self._encode(delta)
        self.messages.extend(new)
        self._truncate_to(self._env_tokens_start)
        self._append(ids, 0)
        self._env_text = delta
        self._open = False

    def _end_assistant_turn(self, text: str, finish_reason: str, tool_calls: list[dict[str, Any]] | None = None,
                            reasoning_content: str | None = None) -> None:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning_content:
            message["reasoning_content"] = reasoning_content
        if tool_calls:
            message["tool_calls"] = tool_calls
        self.messages.append(message)
        self.finish_reason = finish_reason
        self._assistant_turns += 1
        self._env_messages_start = len(self.messages)
        self._env_text = ""

    def _full_render(self) -> str:
        text = self._render(self.messages, self._open)
        if self.truncated and text.endswith(self._frame.closing_text):
            # The template closes the cut last turn; the sequence, rightly, does not.
            text = text[: -len(self._frame.closing_text)]
        return text

    def _compare_tokens(self, expected: list[int]) -> dict[str, Any] | None:
        actual = self.token_ids
        if actual == expected:
            return None
        pos = next((i for i, (a, b) in enumerate(zip(actual, expected, strict=False)) if a != b),
                   min(len(actual), len(expected)))
        before, after = _SNIPPET_TOKENS
        window = slice(max(0, pos - before), pos + after)
        decode = functools.partial(self._tokenizer.decode, skip_special_tokens=False)
        return {
            "mode": "strict", "unit": "token", "position": pos,
            "expected": decode(expected[window]), "actual": decode(actual[window]),
            "expected_length": len(expected), "actual_length": len(actual),
        }

    def _compare_text(self, expected: str) -> dict[str, Any] | None:
        actual = self._tokenizer.decode(self.token_ids, skip_special_tokens=False)
        if _significant(actual) == _significant(expected):
            return None
        a_chars, a_at = _significant_with_offsets(actual)
        e_chars, e_at = _significant_with_offsets(expected)
        k = next((i for i, (a, b) in enumerate(zip(a_chars, e_chars, strict=False)) if a != b),
                 min(len(a_chars), len(e_chars)))
        a_pos = a_at[k] if k < len(a_at) else len(actual)
        e_pos = e_at[k] if k < len(e_at) else len(expected)
        before, after = _SNIPPET_CHARS
        return {
            "mode": "ignore_strippable", "unit": "char", "position": a_pos,
            "expected": expected[max(0, e_pos - before): e_pos + after],
            "actual": actual[max(0, a_pos - before): a_pos + after],
            "expected_length": len(expected), "actual_length": len(actual),
        }

    def _require_tokens(self) -> None:
        if not self.token_mode:
            raise RuntimeError("chat mode has no token sequence: pass a tokenizer for token mode")

    def _require_not_truncated(self) -> None:
        if self.truncated:
            raise RuntimeError(f"conversation was cut ({self.finish_reason}); no further turns")


def _light(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> bool:
    """True when rendering and encoding `messages` is cheaper than handing the work to a thread."""
    size = len(orjson.dumps(tools)) if tools else 0
    for m in messages:
        content = m.get("content")
        size += _PER_MESSAGE_CHARS + (len(content) if isinstance(content, str) else len(orjson.dumps(content)))
        if m.get("tool_calls"):
            size += len(orjson.dumps(m["tool_calls"]))
        if size > INLINE_CHARS:
            return False
    return True


def _significant(text: str) -> str:
    """`text` without reasoning blocks and whitespace: what `ignore_strippable` compares."""
    return "".join(_REASONING.sub("", text).split())


def _significant_with_offsets(text: str) -> tuple[str, list[int]]:
    """Like `_significant`, with each kept character's offset in `text` (to point at a difference)."""
    offsets: list[int] = []
    start = 0
    for m in _REASONING.finditer(text):
        offsets.extend(i for i in range(start, m.start()) if not text[i].isspace())
        start = m.end()
    offsets.extend(i for i in range(start, len(text)) if not text[i].isspace())
    return "".join(text[i] for i in offsets), offsets
