"""Images in a `/generate` request, as SGLang takes them with `input_ids`: `image_data` lists one image (a data URL)
for each `<|vision_start|>…<|vision_end|>` block of the prompt, in order, and each block holds as many
`<|image_pad|>` tokens as the checkpoint's processor gives that image (`managers/multimodal_processor`,
`multimodal/processors/base_processor.py`); a count that differs is refused (400, SGLang's messages). The
simulated model then looks at the last image: its reply names the image's dominant colour, so a test sees that the
pixels reached the engine.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass

from PIL import Image as PILImage
from PIL import UnidentifiedImageError

from rollout_buffer.media.vision import VisionProcessor

# Named colours a reply may give (the nearest to the image's mean).
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (30, 60, 220), "yellow": (230, 220, 40),
           "white": (245, 245, 245), "black": (10, 10, 10), "gray": (128, 128, 128)}


@dataclass(frozen=True)
class SeenImage:
    width: int
    height: int
    colour: str


def seen(url: str) -> SeenImage:
    """What the model sees of one `image_data` item; ValueError (SGLang's wording) when it does not load."""
    head, _, body = url.partition(",")
    try:
        raw = base64.b64decode(body if head.startswith("data:") else url, validate=True)
        with PILImage.open(io.BytesIO(raw)) as img:
            rgb = img.convert("RGB")
            mean = rgb.resize((1, 1), PILImage.Resampling.BOX).getpixel((0, 0))
            width, height = img.size
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as e:
        raise ValueError(f"An exception occurred while loading multimodal data: {e}") from None
    assert isinstance(mean, tuple)
    colour = min(COLOURS, key=lambda c: sum((a - b) ** 2 for a, b in zip(COLOURS[c], mean, strict=False)))
    return SeenImage(width, height, colour)


def placeholder_refusal(ids: list[int], images: list[SeenImage], vision: VisionProcessor | None) -> str | None:
    """Why SGLang refuses these `input_ids` for these images, None when each block holds its image's tokens."""
    if vision is None:
        return "image_data was given, but the model has no image processor"
    blocks: list[int] = []
    inside = False
    for t in ids:
        if t == vision.start_id:
            blocks.append(0)
            inside = True
        elif t == vision.end_id:
            inside = False
        elif inside and t == vision.pad_id:
            blocks[-1] += 1
    if len(blocks) != len(images):
        return f"Prompt has {len(blocks)} image placeholders but {len(images)} image inputs were provided"
    for pads, image in zip(blocks, images, strict=True):
        want = vision.tokens(image.width, image.height)
        if pads != want:
            return f"processor image placeholder count mismatch: processor={pads}, resolved={want}"
    return None
