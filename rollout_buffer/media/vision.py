"""How many tokens an image takes in a Qwen-VL checkpoint's prompt, and their ids: the chat template writes one
`<|image_pad|>` between `<|vision_start|>` and `<|vision_end|>` for each image, and the checkpoint's processor
expands it to one pad per merged patch of the image as it resizes it (`VisionProcessor`).

The count is the processor's: its `smart_resize` (each side a multiple of patch × merge, the pixels between its
`min_pixels` and `max_pixels`, the aspect kept), then (height / patch) × (width / patch) / merge² (transformers'
`Qwen2VLImageProcessor.get_number_of_image_patches`, Qwen2-VL and Qwen2.5-VL: patch 14; Qwen3-VL: 16), read from
the checkpoint's `preprocessor_config.json`. It is computed here rather than by transformers' processor class,
whose import brings torch into the buffer; `tests/test_vision.py` holds the two equal.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


@dataclass(frozen=True)
class VisionProcessor:
    """A Qwen-VL checkpoint's image processing, as far as the prompt's tokens go."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    start_id: int
    pad_id: int
    end_id: int

    @classmethod
    def of(cls, checkpoint: str | Path, tokenizer: Any) -> VisionProcessor | None:
        """The processor of the checkpoint at `checkpoint` (a folder), None when it has no image processor.
        ValueError for one this does not read (not a Qwen-VL kind, or a tokenizer without the vision tokens)."""
        path = Path(checkpoint) / "preprocessor_config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        kind = str(config.get("image_processor_type", ""))
        if not kind.startswith("Qwen2VLImageProcessor"):
            raise ValueError(f"{path}: image processor {kind!r}: images are read for Qwen2-VL-style processors "
                             "(Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")
        size = config.get("size") or {}
        ids = [tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, IMAGE_PAD, VISION_END)]
        if any(not isinstance(i, int) or i == tokenizer.unk_token_id for i in ids):
            raise ValueError(f"{checkpoint}: its tokenizer has no {VISION_START} / {IMAGE_PAD} / {VISION_END}")
        return cls(int(config.get("patch_size", 14)), int(config.get("merge_size", 2)),
                   int(config.get("min_pixels", size.get("shortest_edge", 56 * 56))),
                   int(config.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280))), *ids)

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) the processor resizes an image to (its `smart_resize`)."""
        factor = self.patch_size * self.merge_size
        if max(height, width) / max(1, min(height, width)) > 200:
            raise ValueError(f"a {width}x{height} image: the processor takes aspect ratios up to 200")
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return w_bar, h_bar

    def tokens(self, width: int, height: int) -> int:
        """The pads an image of `width` × `height` pixels takes in the prompt."""
        w, h = self.resized(width, height)
        return (h // self.patch_size) * (w // self.patch_size) // (self.merge_size ** 2)

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The image's `image_grid_thw` (one frame, patches high, patches wide), as the processor gives it."""
        w, h = self.resized(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def expanded(self, ids: Sequence[int], sizes: Sequence[tuple[int, int]]) -> list[int]:
        """`ids` with the pad of each image (`sizes`: width, height, in order) expanded to the tokens it takes.
        ValueError when the pads are not one per image."""
        pads = [k for k, t in enumerate(ids) if t == self.pad_id]
        if len(pads) != len(sizes):
            raise ValueError(f"the prompt has {len(pads)} image placeholders for {len(sizes)} images")
        if not pads:
            return list(ids)
        out: list[int] = []
        start = 0
        for at, (width, height) in zip(pads, sizes, strict=True):
            out += ids[start:at]
            out += [self.pad_id] * self.tokens(width, height)
            start = at + 1
        out += ids[start:]
        return out
