"""SGLang's incremental detokenization of one request (`detokenizer_manager`): the text each answer carries."""

from __future__ import annotations

from typing import Any, TypeVar

from rollout_sim.contract import SURROUNDING_PROMPT_TOKENS


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def find_printable_text(text: str) -> str:
    """`sglang.utils.find_printable_text`: what the detokenizer lets out of text ending in a partial character."""
    if text.endswith("\n"):
        return text
    if text and _is_cjk(ord(text[-1])):
        return text
    if len(text) > 1 and _is_cjk(ord(text[-2])):
        return text[:-1]
    return text[: text.rfind(" ") + 1]


_TextOrIds = TypeVar("_TextOrIds", str, list[int])  # a request's text, or its ids


def trim_matched_stop(output: _TextOrIds, finish: dict[str, Any] | None, no_stop_trim: bool) -> _TextOrIds:
    """`DetokenizerManager.trim_matched_stop`: cut a matched stop string from text, a matched stop token from ids."""
    matched = finish.get("matched") if finish else None
    if not matched:
        return output
    if isinstance(matched, str) and isinstance(output, str):
        pos = output.find(matched)
        if pos == -1:
            return output
        return output[: pos + len(matched)] if no_stop_trim else output[:pos]
    if isinstance(matched, int) and isinstance(output, list):
        return output if no_stop_trim else output[:-1]
    return output


class Detokenizer:
    """One request's incremental detokenization, as `DetokenizerManager._decode_batch_token_id_output` does it."""

    def __init__(self, tokenizer: Any, prompt: list[int], skip_special_tokens: bool, no_stop_trim: bool):
        surr = max(len(prompt) - SURROUNDING_PROMPT_TOKENS, 0)
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.no_stop_trim = no_stop_trim
        self.decode_ids = list(prompt[surr:])
        self.surr_offset = 0
        self.read_offset = len(prompt) - surr
        self.decoded_text = ""
        self.sent_offset = 0

    def step(self, new_ids: list[int], finish: dict[str, Any] | None) -> str:
        """The text a batch carrying `new_ids` sends to the tokenizer manager (`finish` on the last)."""
        self.decode_ids.extend(new_ids)
        read_ids = trim_matched_stop(self.decode_ids[self.surr_offset :], finish, self.no_stop_trim)
        surr_text: str = self.tokenizer.decode(self.decode_ids[self.surr_offset : self.read_offset],
                                               skip_special_tokens=self.skip)
        new_text: str = self.tokenizer.decode(read_ids, skip_special_tokens=self.skip)[len(surr_text) :]
        if finish is None:
            pending = self.sent_offset - len(self.decoded_text)
            if new_text and not new_text.endswith("\ufffd"):
                self.decoded_text += new_text
                self.surr_offset, self.read_offset = self.read_offset, len(self.decode_ids)
                self.sent_offset = len(self.decoded_text)
                return new_text[pending:] if pending else new_text
            printable = find_printable_text(new_text)
            self.sent_offset = len(self.decoded_text) + len(printable)
            return printable[pending:] if pending else printable
        output = trim_matched_stop(self.decoded_text + new_text, finish, self.no_stop_trim)
        out = output[self.sent_offset :]
        self.sent_offset = len(output)
        return out

