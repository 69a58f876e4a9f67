"""Planning a turn: the scripted reply for a prompt (or the rest of one an abort cut), and where SGLang's finish
rules end it. Runs in a worker thread; remembers recent turns so a resent prompt + partial output continues them."""

from __future__ import annotations

import hashlib
import random
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from rollout_sim.contract import Sampling, SimConfig
from rollout_sim.policy import make_draw, scripted_reply
from rollout_sim.prefix_memo import Hit, PrefixMemo

_TURN_MEMORY = 8192
_TEXT_CUT_WITHIN = 64  # tokens from a prompt's end a special token is looked for, to remember its text up to it


@dataclass(frozen=True)
class Prefix:
    """A prompt's ids to right after a special token, remembered for the conversation's next request: their
    text, and their blake2b state (`TurnPlanner._digest`), both to be continued."""

    text: str
    hashed: hashlib.blake2b


@dataclass
class Turn:
    """The planned outcome of one generation request (before aborts cut it)."""

    policy: str
    output_ids: list[int]
    finish: dict[str, Any]
    first_position: int  # position of the first output token inside the assistant turn



def end_of_turn_id(tokenizer: Any) -> int:
    """The id that closes an assistant turn: ChatML's `<|im_end|>` when the vocabulary has it, else EOS."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return im_end if isinstance(im_end, int) and im_end != tokenizer.unk_token_id else tokenizer.eos_token_id



class TurnPlanner:
    """Scripted replies for one engine: the tokenizer, the policy RNG, recent turns and conversations' prefixes."""

    def __init__(self, config: SimConfig, tokenizer: Any):
        self.config = config
        self.tokenizer = tokenizer
        self.eos_id = end_of_turn_id(tokenizer)
        self.header_ids: list[int] = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self._policy_rng = random.Random(f"{config.seed}:policy")
        self._turns: OrderedDict[bytes, list[list[int]]] = OrderedDict()
        self._turns_lock = threading.Lock()
        self.prefixes: PrefixMemo[list[int], Prefix] = PrefixMemo()  # prompts to right after a special token
        self._special_ids = frozenset(tokenizer.all_special_ids)

    def _split_turn(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """(context up to the last assistant header, partial assistant output after it)."""
        h = self.header_ids
        for start in range(len(ids) - len(h), -1, -1):
            if ids[start : start + len(h)] == h:
                return ids[: start + len(h)], ids[start + len(h) :]
        return ids, []

    @staticmethod
    def _digest(context: list[int], prefix: Hit[Prefix] | None) -> bytes:
        """A key of `context` (a prompt up to its assistant header); continued from the remembered `prefix`'s."""
        if prefix is not None and prefix.length <= len(context):
            hashed = prefix.value.hashed.copy()
            hashed.update(array("q", context[prefix.length :]).tobytes())
            return hashed.digest()
        return hashlib.blake2b(array("q", context).tobytes(), digest_size=16).digest()

    def _recall(self, key: bytes, partial: list[int]) -> list[int] | None:
        with self._turns_lock:
            for full in reversed(self._turns.get(key, ())):
                if len(full) > len(partial) and full[: len(partial)] == partial:
                    return full
        return None

    def _remember(self, key: bytes, full: list[int]) -> None:
        with self._turns_lock:
            self._turns.setdefault(key, []).append(full)
            self._turns.move_to_end(key)
            del self._turns[key][:-8]
            while len(self._turns) > _TURN_MEMORY:
                self._turns.popitem(last=False)

    def prompt_text(self, ids: list[int], prefix: Hit[Prefix] | None) -> str:
        """`ids` decoded (special tokens kept), from the remembered `prefix` of them on (`self.prefixes.find`,
        a conversation's previous request); remembers them, to right after their last special token, for the next.
        A text cut right after a special token decodes as its two parts do (an added token is decoded on its own)."""
        start = prefix.length if prefix is not None else 0
        decoded: str = self.tokenizer.decode(ids[start:], skip_special_tokens=False)
        text = (prefix.value.text if prefix is not None else "") + decoded
        cut = len(ids)
        while cut > max(start, len(ids) - _TEXT_CUT_WITHIN) and ids[cut - 1] not in self._special_ids:
            cut -= 1
        if cut > start and ids[cut - 1] in self._special_ids:
            tail: str = self.tokenizer.decode(ids[cut:], skip_special_tokens=False) if cut < len(ids) else ""
            hashed = prefix.value.hashed.copy() if prefix is not None else hashlib.blake2b(digest_size=16)
            hashed.update(array("q", ids[start:cut]).tobytes())
            self.prefixes.put(ids[:cut], Prefix(text[: len(text) - len(tail)], hashed), replacing=prefix)
        return text

    def _stop_at_string(self, out: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
        """(tokens up to and including the one completing a stop string, that string), or None."""
        text = self.tokenizer.decode(out, skip_special_tokens=False)
        if not any(s in text for s in stops):
            return None
        for k in range(1, len(out) + 1):
            prefix = self.tokenizer.decode(out[:k], skip_special_tokens=False)
            for s in stops:
                if s in prefix:
                    return k, s
        return None

    def plan_turn(self, ids: list[int], sampling: Sampling, max_new: int, prefix: Hit[Prefix] | None,
                  note: str | None = None) -> Turn:
        """Choose (or continue) the scripted reply for `ids` and apply the finish rules in the scheduler's order
        (`Req.update_finish_state`): at each token, length, then stop strings, then stop ids and end of turn.
        `prefix`: the remembered prefix of `ids` (`self.prefixes.find`, looked up at admission); `note`: the colour
        of the request's last image, which the reply names."""
        context, partial = self._split_turn(ids)
        key = self._digest(context, prefix)
        full = self._recall(key, partial) if partial else None
        policy = "continue"
        if full is None:
            draw = make_draw(self._policy_rng, self.config.correct_rate, self.config.invalid_rate)
            policy, reply = (("vision", f"The image is {note}.") if note is not None
                             else scripted_reply(self.prompt_text(ids, prefix), draw))
            full = partial + self.tokenizer.encode(reply, add_special_tokens=False) + [self.eos_id]
            self._remember(key, full)
        out = full[len(partial) :]
        candidates: list[tuple[int, int, dict[str, Any]]] = []  # (tokens, priority, finish)
        if max_new < len(out) or max_new == 0:
            candidates.append((max(max_new, 1), 0, {"type": "length", "length": max_new}))
        if sampling.stop:
            hit = self._stop_at_string(out, sampling.stop)
            if hit is not None:
                candidates.append((hit[0], 1, {"type": "stop", "matched": hit[1]}))
        for i, token in enumerate(out):
            if token in sampling.stop_token_ids or token == self.eos_id:
                candidates.append((i + 1, 2, {"type": "stop", "matched": token}))
                break
        end, _, finish = min(candidates, key=lambda c: (c[0], c[1]))
        if finish["type"] == "length":
            end = max_new  # `finished_len`: max_new_tokens, also 0
        return Turn(policy=policy, output_ids=out[:end], finish=finish, first_position=len(partial))
