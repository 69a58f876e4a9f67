"""The exact-token record a conversation keeps beside its messages: the token ids with, per token, a loss mask
and a log-prob; the weight versions seen and which version generated which span of output; what a trainer
replays beside them, once an engine answer brought it (routed experts, top-p kept ids: `engine.replay`); and what
a trajectory record carries of them (`record_fields`).

The base of `conversation.Conversation`, which decides what is appended and where a branch cuts back (chat
template renders, engine turns, marks and forks); this holds the arrays and keeps them in step.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
import orjson

from rollout_buffer.delivery.versions import mask_older_versions
from rollout_buffer.engine.replay import INT32, ReplayParts
from rollout_buffer.media.run_images import RunImages

_JSON_PIECES = 32  # the ids' JSON is joined into one piece when it has more (a request writes each piece)
MID_REQUEST = "mid_request"  # marks a version span generated after an in-place weight change (see version_spans)


class TokenSequence:
    """Token ids, loss mask and log-probs (one each per token), weight versions and their spans; set up by the
    conversation (`Conversation._setup`). In chat mode (`token_mode` false) only weight versions are kept."""

    token_mode: bool
    token_ids: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    weight_versions: list[str]
    # [start, end, weight_version] over token positions: which weights generated each stretch of output; a fourth
    # item, MID_REQUEST, on a stretch generated after the weights changed within its engine request.
    version_spans: list[list[Any]]
    prompt_length: int
    # Routed-expert rows (little-endian int32, `routed_width` values a row) of positions [0, routed_rows), or
    # None; they lag the tokens: a turn's engine answer brings the rows of the tokens before it.
    routed: bytearray | None
    routed_width: int | None
    # Where each token's top-p kept ids start in `top_p_ids` (int32), one entry more than the tokens (tokens the
    # engine did not sample keep none), or None.
    top_p_offsets: list[int] | None
    top_p_ids: bytearray | None
    # The images the tokens hold, in order: (position of the image's first placeholder token, its SHA-256), and
    # the run's images, which know each one.
    images: list[tuple[int, str]]
    _run_images: RunImages | None
    _log_probs_complete: bool  # every generated token came with its log-prob
    # token_ids[:_json_count] as JSON numbers joined by commas, in pieces (each after the first starts with a
    # comma), extended as tokens are appended (`ids_json`).
    _json: list[bytes]
    _json_count: int

    def ids_json(self, tail: list[int] | tuple[int, ...] = ()) -> list[bytes]:
        """`token_ids + tail` as a JSON array, in pieces to be written one after the other: only the tokens
        appended since the last call are serialized, and nothing serialized before is copied (but when the
        pieces are joined, once every `_JSON_PIECES` appends)."""
        if self._json_count < len(self.token_ids):
            new = orjson.dumps(self.token_ids[self._json_count:])[1:-1]
            self._json.append(b"," + new if self._json else new)
            self._json_count = len(self.token_ids)
            if len(self._json) > _JSON_PIECES:
                self._json = [b"".join(self._json)]
        more = [(b"," if self._json else b"") + orjson.dumps(list(tail))[1:-1]] if tail else []
        return [b"[", *self._json, *more, b"]"]

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
            mask_older_versions(loss_mask, ((start, end, v) for start, end, v, *_ in self.version_spans))
        fields: dict[str, Any] = {
            "tokens": list(self.token_ids),
            "loss_mask": loss_mask,
            "response_length": len(self.token_ids) - self.prompt_length,
            "weight_versions": list(self.weight_versions),
        }
        if self._log_probs_complete:
            fields["rollout_log_probs"] = self.log_probs[self.prompt_length:]
        if self.images and self._run_images is not None:  # in order: each one's sha256, media type, width, height
            fields["images"] = [self._run_images.info(s).ref() for s in self.image_shas]
        if self.routed is not None and self.routed_width:
            rows = max(0, len(self.token_ids) - 1)
            fields["rollout_routed_experts"] = bytes(memoryview(self.routed)[:rows * self.routed_width * 4])
        if self.top_p_offsets is not None and self.top_p_ids is not None:
            offsets = self.top_p_offsets[self.prompt_length:]
            fields["rollout_top_p_token_ids"] = bytes(self.top_p_ids[offsets[0] * 4:offsets[-1] * 4])
            fields["rollout_top_p_token_offsets"] = (np.asarray(offsets, dtype=np.int64) - offsets[0]).astype(INT32
                                                                                                     ).tobytes()
        return fields

    @property
    def routed_rows(self) -> int:
        """Routed-expert rows held: of positions [0, routed_rows)."""
        return len(self.routed) // (4 * self.routed_width) if self.routed is not None and self.routed_width else 0

    def extend_routed(self, replay: ReplayParts) -> None:
        """Keep the routed-expert rows an engine answer brought, following those held (it asked from there).
        ValueError when its rows are not as wide as those held."""
        if replay.routed_width is None:
            return
        if self.routed_width is not None and self.routed_width != replay.routed_width:
            raise ValueError(f"routed_experts: {replay.routed_width} values a row after {self.routed_width}")
        self.routed_width = replay.routed_width
        if self.routed is None:
            self.routed = bytearray()
        self.routed += replay.routed

    def _add_replay(self, replay: ReplayParts, output_tokens: int) -> None:
        """Keep the replay data of the engine turn whose `output_tokens` ids were just appended: its routed-expert
        rows follow those held, its top-p kept ids go to its output tokens. ValueError when they do not fit."""
        self.extend_routed(replay)
        if not replay.top_p:
            return
        added = np.frombuffer(replay.top_p_offsets, dtype=INT32).tolist()
        if len(added) != output_tokens + 1:
            raise ValueError(f"top-p kept ids of {len(added) - 1} tokens for {output_tokens} output tokens")
        if self.top_p_offsets is None or self.top_p_ids is None:
            self.top_p_offsets, self.top_p_ids = [0] * (len(self.token_ids) + 1), bytearray()
        base = self.top_p_offsets[-1 - output_tokens]
        self.top_p_offsets[len(self.top_p_offsets) - output_tokens:] = [base + o for o in added[1:]]
        self.top_p_ids += replay.top_p_ids

    def _copy_replay(self, other: TokenSequence, tokens: int) -> None:
        """Hold copies of what `other` keeps beside its first `tokens` tokens (replay data, images)."""
        self.images = [(at, sha) for at, sha in other.images if at < tokens]
        self.routed = None if other.routed is None else other.routed[:tokens * (other.routed_width or 0) * 4]
        if other.top_p_offsets is not None and other.top_p_ids is not None:
            self.top_p_offsets = other.top_p_offsets[:tokens + 1]
            self.top_p_ids = other.top_p_ids[:other.top_p_offsets[tokens] * 4]

    def _top_p_past(self, tokens: int) -> tuple[list[int], bytes] | None:
        """The top-p kept ids of the tokens past the first `tokens`: per token where its ids end (counted from
        theirs), and the ids; None when none are kept."""
        if self.top_p_offsets is None or self.top_p_ids is None:
            return None
        base = self.top_p_offsets[tokens]
        return [o - base for o in self.top_p_offsets[tokens + 1:]], bytes(self.top_p_ids[base * 4:])

    def _extend_top_p(self, top_p: tuple[list[int], bytes] | None, new_tokens: int) -> None:
        """Take the top-p kept ids of `new_tokens` about to be appended (`_top_p_past` of a copy)."""
        if top_p is not None:
            ends, ids = top_p
            if self.top_p_offsets is None or self.top_p_ids is None:
                self.top_p_offsets, self.top_p_ids = [0] * (len(self.token_ids) + 1), bytearray()
            base = self.top_p_offsets[-1]
            self.top_p_offsets.extend(base + e for e in ends)
            self.top_p_ids += ids
        elif self.top_p_offsets is not None:
            self.top_p_offsets.extend([self.top_p_offsets[-1]] * new_tokens)

    def _append(self, ids: list[int] | tuple[int, ...], loss: int, log_probs: list[float] | None = None
                ) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([loss] * len(ids))
        self.log_probs.extend(log_probs if log_probs is not None else [0.0] * len(ids))
        if self.top_p_offsets is not None:  # kept ids of their own come with an engine turn (`_add_replay`)
            self.top_p_offsets.extend([self.top_p_offsets[-1]] * len(ids))

    @property
    def image_shas(self) -> list[str]:
        """The images the tokens hold, in the order of their placeholders (what the engine's `image_data` lists)."""
        return [sha for _, sha in self.images]

    def _truncate_to(self, n: int) -> None:
        del self.token_ids[n:], self.loss_mask[n:], self.log_probs[n:]
        if self.images and self.images[-1][0] >= n:
            self.images = [(at, sha) for at, sha in self.images if at < n]
        if self.routed is not None and self.routed_width:
            del self.routed[n * self.routed_width * 4:]
        if self.top_p_offsets is not None and self.top_p_ids is not None:
            del self.top_p_ids[self.top_p_offsets[n] * 4:], self.top_p_offsets[n + 1:]
        if n < self._json_count:  # rare (a turn taken back): written again from the start when next asked
            self._json, self._json_count = [], 0

    def _add_version_spans(self, start: int, count: int, version: str | None,
                           segments: list[tuple[int, str | None]] | None, mid_request: Collection[int] = ()) -> None:
        if not segments or sum(n for n, _ in segments) != count:
            segments, mid_request = [(count, version)], ()
        for k, (n, v) in enumerate(segments):
            if n <= 0 and len(segments) > 1:
                continue  # an answer without tokens (aborted at once) generated nothing with its weights
            self._note_version(v)
            if n <= 0:
                continue
            last = self.version_spans[-1] if self.version_spans else None
            if k in mid_request:
                self.version_spans.append([start, start + n, v, MID_REQUEST])
            elif last is not None and last[1] == start and last[2] == v and len(last) == 3:
                last[1] = start + n
            else:
                self.version_spans.append([start, start + n, v])
            start += n

    def mid_request_spans(self) -> list[list[Any]]:
        """`[start, end, version]` of the stretches generated after the weights changed within their engine
        request: the KV cache of the tokens before them came from older weights."""
        return [span[:3] for span in self.version_spans if span[3:] == [MID_REQUEST]]

    def _note_version(self, version: str | None) -> None:
        if version is not None and version not in self.weight_versions:
            self.weight_versions.append(version)

    def _spans_past(self, tokens: int) -> list[list[Any]]:
        """Copies of the version spans that end past `tokens` (the last few: spans are in token order)."""
        k = len(self.version_spans)
        while k and self.version_spans[k - 1][1] > tokens:
            k -= 1
        return [list(s) for s in self.version_spans[k:]]
