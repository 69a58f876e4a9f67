"""The images a session's request brought, taken before its turn: each image part's bytes (held by the part since
its protocol's adapter read it: `messages.PENDING_IMAGE`) checked and stored once by the run, the part left naming
the image by its hash. A request resending an image the session already took costs nothing more: its converted
history is reused with the parts already taken.

A run whose checkpoint reads no images (no image processor) gets a placeholder text for each, counted, as the
model can see none of them; the record says how many (`extra_info.images_omitted`).
"""

from __future__ import annotations

from typing import Any

from rollout_buffer.media.run_images import RunImages
from rollout_buffer.proxy.messages import IMAGE_PLACEHOLDER, PENDING_IMAGE, WireError


async def take_images(messages: list[dict[str, Any]], images: RunImages | None) -> int:
    """Take the images `messages` bring (module docstring); the number left out for a checkpoint that reads none.
    WireError (400) naming the content part of one that is not an image the run takes."""
    omitted = 0
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            continue
        if images is None or images.vision is None:
            m["content"] = "\n".join(p["text"] if p["type"] == "text" else IMAGE_PLACEHOLDER for p in content)
            omitted += sum(p["type"] == "image" for p in content)
            continue
        for part in content:
            pending = part.pop(PENDING_IMAGE, None)
            if pending is None:
                continue
            data, where = pending
            try:
                await images.take(data)
            except ValueError as e:
                raise WireError("invalid_request", f"{where}: {e}", where) from None
    return omitted
