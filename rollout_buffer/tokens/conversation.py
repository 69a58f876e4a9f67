"""One trajectory's conversation: OpenAI messages and, in token mode, the exact token sequence beside them.

Token mode (a tokenizer is given) keeps what the model really saw and produced:

- the prompt is the chat template's rendering of the first messages with the generation prompt (loss 0);
- an assistant turn appends the engine's own output ids (loss 1, with their log-probs) and is never
  re-tokenized; what the template writes after the end-of-turn token (Qwen's "\\n" after `<|im_end|>`)
  follows at loss 0, and the whole closing when the engine stopped on a stop string instead;
- user and tool messages append only the template's text for them (loss 0), rendered after a fixed base
  history, so templates that rewrite earlier turns (Qwen3 drops old reasoning) cannot shift the delta;
- a turn cut by the length limit (or aborted) ends the conversation: there is no clean place to go on.

The sanity check compares the sequence with the template applied to the final messages at once, `strict`
(token for token) or `ignore_strippable` (decoded text, whitespace and `<think>` blocks aside), or not at all
(`disable`); see `token_check`.

Branches (the agent proxy): `mark()` after an assistant turn remembers where the conversation stood;
`restore(mark)` undoes what came after it (a turn the client never received), and `fork(mark)` starts a new
conversation from that point whose earlier tokens are context (loss 0, part of its prompt), for an agent that
rewrote its history. `add_context` appends messages of any role at loss 0, assistant ones too (turns the
engine did not generate for this conversation). `tail(...)` is what a conversation gained since a point, and
`extend_tail` / `restored` rebuild an exact copy from tails (a persisted agent session after a restart).

Chat mode (no tokenizer) keeps the messages only.

The token arrays, and what a record carries of them, are kept by the base `sequence.TokenSequence`; every render
and encode goes through the conversation's one `renderer.Renderer` (its tokenizer, tools and template options).
"""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Collection
from typing import Any, Literal

from rollout_buffer.engine.replay import ReplayParts
from rollout_buffer.engine.sglang_wire import EnginePrompt
from rollout_buffer.media.run_images import RunImages
from rollout_buffer.tokens.check import compare_text, compare_tokens
from rollout_buffer.tokens.image_tokens import image_prompt, with_images
from rollout_buffer.tokens.marks import ConversationTail, TurnMark
from rollout_buffer.tokens.renderer import BASE_HISTORY, light, renderer
from rollout_buffer.tokens.sequence import TokenSequence

SanityCheckMode = Literal["strict", "ignore_strippable", "disable"]

# Finish reasons that leave the assistant turn unfinished.
_CUT = frozenset({"length", "abort"})


class Conversation(TokenSequence):
    """Messages of one trajectory (one per role in multi-agent runs) and, with a tokenizer, its exact tokens.

    Build it with the opening messages; then alternate `generation_ids()` → engine → `add_assistant(...)`
    and `add_messages([...])` for tool results or user turns; finish with `check()` and `record_fields()`.
    The `a`-prefixed variants run template renders and tokenization in a thread, off the event loop, unless
    the conversation is small enough (`renderer.INLINE_CHARS`) that the hop would cost more than the work.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sanity_check: SanityCheckMode
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
        images: RunImages | None = None,
    ) -> None:
        if not messages:
            raise ValueError("a conversation starts with at least one message")
        self._setup(tokenizer, tools, sanity_check, chat_template_kwargs, images)
        self.messages = list(messages)
        if self.token_mode:
            self._render_prompt(self.messages)

    def _setup(self, tokenizer: Any, tools: list[dict[str, Any]] | None, sanity_check: SanityCheckMode,
               chat_template_kwargs: dict[str, Any] | None, images: RunImages | None = None) -> None:
        if sanity_check not in ("strict", "ignore_strippable", "disable"):
            raise ValueError(f"sanity_check must be strict, ignore_strippable or disable: {sanity_check!r}")
        self.messages = []
        self.tools = tools
        self.sanity_check = sanity_check
        self.token_mode = tokenizer is not None
        self.token_ids, self.loss_mask, self.log_probs, self.weight_versions = [], [], [], []
        self._json, self._json_count = [], 0
        self.version_spans = []
        self.prompt_length = 0
        self.truncated = False
        self.finish_reason = None
        self._options = dict(chat_template_kwargs or {})
        self._log_probs_complete = True
        self.routed, self.routed_width, self.top_p_offsets, self.top_p_ids = None, None, None, None
        self.images, self._run_images = [], images
        self.abort_resumes = 0  # over its turns: a record's own count, whatever other branches did
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
            self._renderer = renderer(tokenizer, tools, self._options)
            self._frame = self._renderer.frame

    @classmethod
    def restored(cls, tail: ConversationTail, tokenizer: Any, *, tools: list[dict[str, Any]] | None = None,
                 sanity_check: SanityCheckMode = "strict", chat_template_kwargs: dict[str, Any] | None = None,
                 images: RunImages | None = None) -> Conversation:
        """A token-mode conversation rebuilt from the `tail` of one taken from its start (a persisted agent
        session after a restart): the same tokens, masks, log-probs, images and messages; nothing is rendered
        again."""
        conv = cls.__new__(cls)
        conv._setup(tokenizer, tools, sanity_check, chat_template_kwargs, images)
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
        images: RunImages | None = None,
    ) -> Conversation:
        """`Conversation(...)` with the prompt rendered and tokenized in a thread (inline when small)."""
        kwargs: dict[str, Any] = {
            "tools": tools, "sanity_check": sanity_check, "chat_template_kwargs": chat_template_kwargs,
            "images": images,
        }
        if tokenizer is None or light(messages, tools):
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

    def engine_prompt(self) -> EnginePrompt:
        """`generation_ids` as the engine client sends them, without copying them: their count and their JSON,
        written as the conversation grew (with images: one pad each, `image_tokens.image_prompt`)."""
        self._require_tokens()
        self._require_not_truncated()
        tail = () if self._open else self._frame.generation_prompt_ids
        return (image_prompt(self.token_ids, self.images, tail) if self.images
                else EnginePrompt(len(self.token_ids) + len(tail), self.ids_json(tail)))

    def generation_length(self) -> int:
        """How many tokens `generation_ids` would send."""
        return len(self.token_ids) + (0 if self._open else len(self._frame.generation_prompt_ids))

    def add_assistant(
        self,
        output_ids: list[int],
        log_probs: list[float] | None,
        text: str,
        *,
        weight_version: str | None = None,
        finish_reason: str = "stop",
        version_segments: list[tuple[int, str | None]] | None = None,
        mid_request: Collection[int] = (),
        replay: ReplayParts | None = None,
        resumed: int = 0,
    ) -> None:
        """Append one engine turn: its own output ids (loss 1) and log-probs, and `text` as the message.

        `text` should be what the ids decode to; it is kept in `messages` and never re-tokenized.
        `finish_reason` is the engine's ("stop", "length", "abort"): an output that neither ends with an
        end-of-turn token nor stopped cleanly truncates the conversation. `version_segments` lists
        (tokens, weight_version) of the answers the turn was generated in (abort resumes may cross a weight
        update); without it the whole turn has `weight_version`. `mid_request` indexes the segments generated
        after the weights changed within their engine request (`GenerateResult.mid_request`). `replay`: what the
        turn's answers brought beside the tokens (routed experts, top-p kept ids); `resumed`: its abort resumes.
        """
        self._require_tokens()
        self._require_not_truncated()
        if log_probs is not None and len(log_probs) != len(output_ids):
            raise ValueError(f"{len(log_probs)} log-probs for {len(output_ids)} output ids")
        if not self._open:
            self._append(self._frame.generation_prompt_ids, 0)
        self._add_version_spans(len(self.token_ids), len(output_ids), weight_version, version_segments, mid_request)
        if self._forked:
            self.prompt_length, self._forked = len(self.token_ids), False
        self._append(output_ids, 1, log_probs)
        if replay is not None:
            self._add_replay(replay, len(output_ids))
        self.abort_resumes += resumed
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
        mid_request: Collection[int] = (),
        replay: ReplayParts | None = None,
        resumed: int = 0,
    ) -> None:
        """`add_assistant` for async callers; it renders nothing, so it runs inline."""
        self.add_assistant(output_ids, log_probs, text, weight_version=weight_version, finish_reason=finish_reason,
                           version_segments=version_segments, mid_request=mid_request, replay=replay,
                           resumed=resumed)

    def response_tokens_used(self) -> int:
        """Tokens the response will hold once the next assistant turn starts (generation prompt counted)."""
        self._require_tokens()
        if self._forked:
            return 0
        pending = 0 if self._open or self.truncated else len(self._frame.generation_prompt_ids)
        return len(self.token_ids) + pending - self.prompt_length

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
        if self.token_mode and not light([*rendered, *new], self.tools):
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
                        self.finish_reason, self.truncated, self._log_probs_complete, self.abort_resumes)

    @property
    def assistant_turns(self) -> int:
        """The conversation's assistant turns (those before a fork included)."""
        return self._assistant_turns

    def restore(self, mark: TurnMark) -> None:
        """Undo everything appended after `mark` (taken on this conversation)."""
        self._require_tokens()
        if mark.messages > len(self.messages) or mark.tokens > len(self.token_ids):
            raise ValueError("the mark is past the end of this conversation")
        del self.messages[mark.messages:], self.weight_versions[mark.weight_versions:]
        self._truncate_to(mark.tokens)
        self.version_spans = [[start, min(end, mark.tokens), *rest] for start, end, *rest in self.version_spans
                              if start < mark.tokens]
        self._assistant_turns, self.abort_resumes = mark.assistant_turns, mark.abort_resumes
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
        other._json, other._json_count = [], 0
        other.loss_mask = [0] * mark.tokens
        other.log_probs = [0.0] * mark.tokens
        other.weight_versions = []
        other.version_spans = []  # like its weight versions: its own output's (copy.copy would share the list)
        other.prompt_length = mark.tokens
        other.finish_reason, other.truncated, other._log_probs_complete = mark.finish_reason, False, True
        other._assistant_turns, other.abort_resumes = mark.assistant_turns, mark.abort_resumes
        other._copy_replay(self, mark.tokens)  # its own copies (`copy.copy` would share them)
        other._open, other._forked = False, True
        other._env_messages_start, other._env_tokens_start, other._env_text = mark.messages, mark.tokens, ""
        return other

    def tail(self, messages: int, tokens: int, versions: int) -> ConversationTail:
        """What the conversation holds past its first `messages` messages, `tokens` tokens and `versions` weight
        versions, taken right after an assistant turn: what `extend_tail` appends to a copy standing there."""
        return ConversationTail(
            messages, tokens, versions, self.messages[messages:], self.token_ids[tokens:], self.loss_mask[tokens:],
            self.log_probs[tokens:], self.weight_versions[versions:], self._spans_past(tokens), self.prompt_length,
            self.mark(), self._top_p_past(tokens), [(at, sha) for at, sha in self.images if at >= tokens])

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
        self._extend_top_p(tail.top_p, len(tail.token_ids))
        self.images += [(at, sha) for at, sha in tail.images]
        self.messages.extend(tail.new_messages)
        self.token_ids.extend(tail.token_ids)
        self.loss_mask.extend(tail.loss_mask)
        self.log_probs.extend(tail.log_probs)
        self.weight_versions.extend(tail.weight_versions)
        self.version_spans = [*(s for s in self.version_spans if s[1] <= tail.tokens),
                              *(list(s) for s in tail.version_spans)]
        self.prompt_length = tail.prompt_length
        self._assistant_turns, self.abort_resumes = mark.assistant_turns, mark.abort_resumes
        self.finish_reason, self.truncated = mark.finish_reason, mark.truncated
        self._log_probs_complete = mark.log_probs_complete
        self._open = self._forked = False
        self._env_messages_start, self._env_tokens_start, self._env_text = mark.messages, mark.tokens, ""

    def check(self) -> dict[str, Any] | None:
        """Compare the sequence with the template's rendering of the final messages (see `token_check`).

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
                return compare_tokens(self._renderer.tokenizer, self.token_ids, self._expected_ids(expected))
            return compare_text(self._renderer.tokenizer, self.token_ids, expected)
        except Exception as e:  # the check diagnoses; it must not fail a finished trajectory
            return {"mode": self.sanity_check, "error": f"{type(e).__name__}: {e}"}

    async def acheck(self) -> dict[str, Any] | None:
        """`check` with the full render in a thread (inline when small)."""
        if not self.token_mode or self.sanity_check == "disable":
            return None
        if light(self.messages, self.tools):
            return self.check()
        return await asyncio.to_thread(self.check)

    # -- internals --------------------------------------------------------------------------------

    def _expected_ids(self, expected: str) -> list[int]:
        """`encode(expected)`, reusing the prompt's ids up to its last restart token when `expected` starts
        with them (the full render of a conversation usually does): same ids, a fraction of the work; each image's
        placeholder expanded as in the sequence."""
        head = self._prompt_head
        if head is not None and expected.startswith(head[0]):
            ids = [*head[1], *self._renderer.encode(expected[len(head[0]):])]
        else:
            ids = self._renderer.encode(expected)
        return list(with_images(self._run_images, ids, self.messages)[0])

    def _with_images(self, ids: list[int] | tuple[int, ...], messages: list[dict[str, Any]], at: int
                     ) -> list[int] | tuple[int, ...]:
        """`ids`, rendered from `messages` to be appended at position `at`, with their images' placeholders
        expanded (`image_tokens`); the images are noted at their positions."""
        ids, found = with_images(self._run_images, ids, messages)
        self.images += [(at + k, sha) for k, sha in found]
        return ids


    def _render_prompt(self, messages: list[dict[str, Any]]) -> None:
        rendered = self._renderer.prompt(messages)
        text, ids = rendered.text, rendered.ids
        if text == self._env_text:
            raise ValueError(f"chat template renders nothing for roles {[m.get('role') for m in messages]}")
        self.messages = messages
        self._truncate_to(0)
        self._append(self._with_images(ids, messages, 0), 0)
        self.prompt_length = len(self.token_ids)
        self._prompt_head = rendered.head
        self._env_text = text
        self._open = True

    def _append_environment(self, new: list[dict[str, Any]]) -> None:
        if self._assistant_turns == 0:
            # Still the prompt: render it again whole, so it matches the template exactly.
            self._render_prompt([*self.messages, *new])
            return
        run = [*self.messages[self._env_messages_start:], *new]
        rendered = self._renderer.render([*BASE_HISTORY, *run], False)
        if not rendered.startswith(self._frame.base_text):
            raise ValueError("chat template rewrites the base history when messages follow it")
        delta = rendered[len(self._frame.base_text):]
        if delta == self._env_text:
            raise ValueError(f"chat template renders nothing for roles {[m.get('role') for m in new]}")
        self._truncate_to(self._env_tokens_start)
        ids = self._with_images(self._renderer.encode(delta), run, self._env_tokens_start)
        self.messages.extend(new)
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
        text = self._renderer.render(self.messages, self._open)
        if self.truncated and text.endswith(self._frame.closing_text):
            # The template closes the cut last turn; the sequence, rightly, does not.
            text = text[: -len(self._frame.closing_text)]
        return text

    def _require_tokens(self) -> None:
        if not self.token_mode:
            raise RuntimeError("chat mode has no token sequence: pass a tokenizer for token mode")

    def _require_not_truncated(self) -> None:
        if self.truncated:
            raise RuntimeError(f"conversation was cut ({self.finish_reason}); no further turns")

