"""A conversation's images in its tokens: the chat template writes one placeholder for each image part of a
message, and it is expanded to the tokens the checkpoint's processor gives that image (`media.vision`), so the
sequence holds the very ids the engine and the trainer see for it.

The engine is sent each image's placeholder as one pad token (`engine_ids`): SGLang expands every pad of the
`input_ids` it gets with `image_data` to that image's count itself (keeping the other ids as they are), and a
prompt holding the expanded pads is never answered (SGLang 0.5.23)."""

from __future__ import annotations

from typing import Any

import orjson

from rollout_buffer.engine.sglang_wire import EnginePrompt
from rollout_buffer.media.images import images_in
from rollout_buffer.media.run_images import RunImages


def with_images(images: RunImages | None, ids: list[int] | tuple[int, ...], messages: list[dict[str, Any]]
                ) -> tuple[list[int] | tuple[int, ...], list[tuple[int, str]]]:
    """`ids` rendered from `messages` with each image's placeholder expanded, and where each image's first token
    is in them (with its SHA-256); ValueError when the messages hold images the run's checkpoint cannot read, or
    placeholders that are not one per image."""
    shas = images_in(messages)
    if not shas:
        return ids, []
    if images is None or images.vision is None:
        raise ValueError("the messages hold images, but the run's checkpoint has no image processor (its "
                         "tokenizer_path has no preprocessor_config.json)")
    vision = images.vision
    infos = [images.info(s) for s in shas]
    expanded = vision.expanded(ids, [(i.width, i.height) for i in infos])
    starts = [k for k, t in enumerate(expanded) if t == vision.pad_id and (k == 0 or expanded[k - 1] != t)]
    return expanded, list(zip(starts, shas, strict=True))


def image_prompt(ids: list[int], images: list[tuple[int, str]], tail: tuple[int, ...] | list[int] = ()
                 ) -> EnginePrompt:
    """The engine's prompt of `ids` then `tail`: as long as they are, sent with the run of pads at each image's
    position (`images`: position, SHA-256) as one pad, as SGLang takes them with `image_data`."""
    body = orjson.dumps(engine_ids(ids, images, tail))
    return EnginePrompt(len(ids) + len(tail), [body[:-1], b"]"])


def engine_ids(ids: list[int], images: list[tuple[int, str]], tail: tuple[int, ...] | list[int] = ()) -> list[int]:
    """`ids` (then `tail`) with the run of pads at each image's position (`images`: position, SHA-256) as one pad."""
    out: list[int] = []
    at = 0
    for start, _ in images:
        pad = ids[start]
        end = start + 1
        while end < len(ids) and ids[end] == pad:
            end += 1
        out += ids[at:start + 1]
        at = end
    out += ids[at:]
    out += tail
    return out
