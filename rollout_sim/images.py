"""Images in a `/generate` request, as SGLang 0.5.23 takes them with `input_ids`: `image_data` lists one image (a data
URL) for each `<|image_pad|>` token of the prompt, in order, and SGLang expands each pad to the tokens the
checkpoint's processor gives that image, keeping the other ids as sent (`SGLANG_MM_AVOID_RETOKENIZE`, on by
default; `multimodal/processors/base_processor.py`). More pads than images is refused (400, SGLang's message);
images beyond the pads are left out. Real SGLang never answers a prompt whose pads are already expanded (several
pads for one image): the simulator refuses it with the same 400 so that a test sees it. The prompt the model reads,
and counts (`prompt_tokens`, the context), is the expanded one. The simulated model looks at the last image: its
reply names the image's dominant colour, so a test sees that the pixels reached the engine.
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


def with_images(ids: list[int], images: list[SeenImage], vision: VisionProcessor | None) -> list[int]:
    """`ids` with each image's pad expanded as SGLang expands it (module docstring); ValueError (SGLang's wording)
    when it refuses them."""
    if vision is None:
        raise ValueError("image_data was given, but the model has no image processor")
    pads = sum(1 for t in ids if t == vision.pad_id)
    if pads > len(images):
        raise ValueError(f"Prompt has {pads} image placeholders but {len(images)} image inputs were provided")
    return vision.expanded(ids, [(i.width, i.height) for i in images[:pads]])
