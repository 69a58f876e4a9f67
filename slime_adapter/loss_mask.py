"""Multi-turn loss masks for messages-only records, computed exactly as slime's `mask_utils` does.

slime turns an OpenAI conversation into `(token_ids, loss_mask)` by rendering each message through the
chat template on its own and concatenating the pieces: assistant tokens get loss 1 except the
`<|im_start|>assistant\\n` header, everything else gets 0. Inside slime's training process its own
`MultiTurnLossMaskGenerator` is used; elsewhere `LossMaskGenerator` below reproduces the same algorithm
token for token (qwen, qwen3 and distill_qwen), so a record gives the same sample with or without slime.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]

LOSS_MASK_TYPES = ("qwen", "qwen3", "distill_qwen")
ROLES = frozenset({"system", "user", "assistant", "tool"})
# Probe strings of slime's algorithm; the exact text matters only in that it tokenizes the same way.
_PROBE_TEXT = "FOR TESTING ONLY"
_PREFIX_MESSAGE: Message = {"role": "user", "content": "FOR CALCULATING LOSS MASK ONLY"}
# A token of the DeepSeek-R1-Distill template: its presence turns "qwen" into "distill_qwen", as in slime.
_DISTILL_MARKER = "<｜Assistant｜>"


def get_response_lengths(loss_masks: Sequence[Sequence[int]]) -> list[int]:
    """Length of each mask from its first 1 to its end (0 when the mask has no 1), as slime counts it."""
    return [len(mask) - list(mask).index(1) if 1 in mask else 0 for mask in loss_masks]


def unrenderable_reason(messages: Any) -> str | None:
    """Why a conversation cannot become `(token_ids, loss_mask)`, or None when it can.

    Chat templates skip what they do not know without a word (Qwen's renders nothing for an unknown role),
    so a bad record would silently train on a different conversation; these are refused instead: an empty
    conversation, a message that is not an object with a known role, and a tool message that answers no
    call (the assistant turn before it has neither `tool_calls` nor a `<tool_call>` in its text).
    """
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list"
    last_turn: Message | None = None  # the latest message that is not a tool message
    for k, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            return f"messages[{k}] has role {role!r}; the loss mask knows {sorted(ROLES)}"
        if role != "tool":
            last_turn = message
            continue
        content = last_turn.get("content") if last_turn is not None else None
        called = last_turn is not None and last_turn["role"] == "assistant" and (
            bool(last_turn.get("tool_calls")) or (isinstance(content, str) and "<tool_call>" in content))
        if not called:
            return f"messages[{k}] is a tool message without a tool call before it"
    return None


def _ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list.
    if isinstance(encoded, list):
        return encoded
    return list(encoded["input_ids"])


def _find_all(haystack: list[int], needle: list[int]) -> list[int]:
    n = len(needle)
    return [i for i in range(len(haystack) - n + 1) if haystack[i : i + n] == needle]


class LossMaskGenerator:
    """slime's `MultiTurnLossMaskGenerator` algorithm, standalone; same constructor and methods."""

    def __init__(self, tokenizer: Any, tokenizer_type: str = "qwen"):
        if tokenizer_type not in LOSS_MASK_TYPES:
            raise ValueError(f"unsupported loss mask type {tokenizer_type!r}; use one of {LOSS_MASK_TYPES}")
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type
        # As slime: only the per-message algorithms need the probe (a distill template may not render it).
        self.system_message_length, self.gen_token_length = 0, 0
        if tokenizer_type in ("qwen", "qwen3"):
            self.system_message_length, self.gen_token_length = self.get_system_message_length()

    def get_response_lengths(self, loss_masks: Sequence[Sequence[int]]) -> list[int]:
        """See the module function `get_response_lengths`."""
        return get_response_lengths(loss_masks)

    def _template_ids(self, messages: list[Message], **kwargs: Any) -> list[int]:
        return _ids(self.tokenizer.apply_chat_template(messages, tokenize=True, **kwargs))

    def get_system_message_length(self) -> tuple[int, int]:
        """(tokens of the default system prompt the template injects, tokens of the generation header).

        Both are measured on a probe conversation of two identical user turns: the gap between the two
        occurrences of the probe text is one turn's framing, so whatever precedes the first turn's framing
        is the injected system prompt.
        """
        probe = [{"role": "user", "content": _PROBE_TEXT}, {"role": "user", "content": _PROBE_TEXT}]
        text_ids = self.tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
        rendered = self.tokenizer.apply_chat_template(probe, add_special_tokens=False, tokenize=False)
        rendered_ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        first, second = _find_all(rendered_ids, text_ids)[:2]
        tail = len(rendered_ids) - len(text_ids) - second
        turn_header = (second - first) - tail - len(text_ids)
        with_header = self._template_ids(probe, add_special_tokens=False, add_generation_prompt=True)
        return first - turn_header, len(with_header) - len(rendered_ids)

    def _mask_for(self, message: Message, ids: list[int]) -> list[int]:
        if message.get("step_loss_mask", 1) != 1 or message["role"] != "assistant":
            return [0] * len(ids)
        return [0] * self.gen_token_length + [1] * (len(ids) - self.gen_token_length)

    def gen_multi_turn_loss_mask_qwen(
        self, messages: list[Message], tools: list[dict] | None = None
    ) -> tuple[list[int], list[int]]:
        """Each message rendered alone (tools only with the first), injected system prompt cut off."""
        token_ids: list[int] = []
        loss_mask: list[int] = []
        for i, message in enumerate(messages):
            ids = self._template_ids([message], tools=tools) if i == 0 else self._template_ids([message])
            if i > 0 and message["role"] != "system":
                ids = ids[self.system_message_length :]
            token_ids += ids
            loss_mask += self._mask_for(message, ids)
        return token_ids, loss_mask

    def gen_multi_turn_loss_mask_qwen3(
        self, messages: list[Message], tools: list[dict] | None = None
    ) -> tuple[list[int], list[int]]:
        """Each message rendered after (or, for the first, before) a fixed user turn that is then cut off.

        The neighbouring user turn makes Qwen3's template treat each assistant message as the answer to
        the latest query, so its `<think>` block is kept. A run of consecutive tool messages is rendered
        as one piece, because Qwen's templates put all of them into one user turn.
        """
        prefix_ids = self._template_ids([_PREFIX_MESSAGE])
        token_ids: list[int] = []
        loss_mask: list[int] = []
        i = 0
        while i < len(messages):
            end = i + 1
            if messages[i]["role"] == "tool":
                while end < len(messages) and messages[end]["role"] == "tool":
                    end += 1
            piece, first = messages[i:end], messages[i]
            if i == 0:
                ids = self._template_ids([*piece, _PREFIX_MESSAGE], tools=tools)[: -len(prefix_ids)]
            else:
                ids = self._template_ids([_PREFIX_MESSAGE, *piece])[len(prefix_ids) :]
                if first["role"] != "system":
                    ids = ids[self.system_message_length :]
            token_ids += ids
            loss_mask += self._mask_for(first, ids)
            i = end
        return token_ids, loss_mask

    def gen_multi_turn_loss_mask_distill_qwen(
        self, messages: list[Message], tools: list[dict] | None = None
    ) -> tuple[list[int], list[int]]:
        """First message as the prompt (with generation header), last message's text as the response."""
        prompt = self.tokenizer.apply_chat_template(
            messages[:1], tokenize=False, add_generation_prompt=True, tools=tools
        )
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_ids = self.tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        token_ids = prompt_ids + response_ids
        if messages[-1].get("step_loss_mask", 1) != 1:
            return token_ids, [0] * len(token_ids)
        return token_ids, [0] * len(prompt_ids) + [1] * len(response_ids)

    def get_loss_mask(
        self, messages: list[Message], tools: list[dict] | None = None
    ) -> tuple[list[int], list[int]]:
        """`(token_ids, loss_mask)` of a conversation, both of the same length."""
        if self.tokenizer_type == "distill_qwen" or (
            self.tokenizer_type == "qwen" and _DISTILL_MARKER in self.tokenizer.get_added_vocab()
        ):
            return self.gen_multi_turn_loss_mask_distill_qwen(messages, tools)
        if self.tokenizer_type == "qwen3":
            return self.gen_multi_turn_loss_mask_qwen3(messages, tools)
        return self.gen_multi_turn_loss_mask_qwen(messages, tools)


def _slime_generator() -> type | None:
    try:
        from slime.utils.mask_utils import MultiTurnLossMaskGenerator as SlimeGenerator
    except ImportError:
        return None
    return SlimeGenerator


SLIME_GENERATOR: type | None = _slime_generator()
# What the adapter uses: slime's own class inside slime, the identical standalone one elsewhere.
MultiTurnLossMaskGenerator: type = SLIME_GENERATOR or LossMaskGenerator
