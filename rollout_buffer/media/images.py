"""An image as it arrives in a message (a data URL, base64, raw bytes), decoded and checked once: its bytes, media
type, size and content hash (`Image`). Records name images by hash; the bytes go to the image store.

What a client sends is untrusted: the bytes must decode as an image of a kind SGLang's processors read (PNG, JPEG,
WebP, GIF, BMP), within the operator's size limit in bytes and in pixels; anything else is a ValueError saying what
is wrong, which the protocols answer as a 400 naming the content part. A remote URL is fetched only from the hosts
the operator allows (`fetch_allowed`).
"""

from __future__ import annotations

import binascii
import hashlib
import io
from dataclasses import dataclass
from typing import Any

import pybase64
from PIL import Image as PILImage
from PIL import UnidentifiedImageError

# What the buffer accepts (Pillow's format name → the media type records give).
MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif", "BMP": "image/bmp"}
DEFAULT_MAX_IMAGE_BYTES = 16 * 1024 * 1024
_MAX_PIXELS = 64 * 1024 * 1024  # beyond this a decoder allocates gigabytes (Pillow's own bomb limit is higher)


@dataclass(frozen=True)
class ImageInfo:
    """What a record says of an image it names: its SHA-256 (hex), media type and pixel size."""

    sha256: str
    media_type: str
    width: int
    height: int

    def ref(self) -> dict[str, Any]:
        """How a record lists it."""
        return {"sha256": self.sha256, "media_type": self.media_type, "width": self.width, "height": self.height}


@dataclass(frozen=True)
class Image(ImageInfo):
    """One image: what a record says of it, and its bytes as they came."""

    data: bytes

    def data_url(self) -> str:
        """The image as SGLang's `image_data` takes it."""
        return f"data:{self.media_type};base64,{pybase64.b64encode(self.data).decode()}"


def image_of(data: bytes, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> Image:
    """`data` checked as an image; ValueError saying why it is not one the buffer takes."""
    if len(data) > max_bytes:
        raise ValueError(f"the image is {len(data)} bytes; the server takes at most {max_bytes} (--max-image-bytes)")
    try:
        with PILImage.open(io.BytesIO(data)) as img:
            kind, (width, height) = img.format, img.size
            if width * height > _MAX_PIXELS:
                raise ValueError(f"the image is {width}x{height} pixels; at most {_MAX_PIXELS} pixels are taken")
            img.verify()  # the whole stream decodes: a truncated or corrupted file fails here
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"not an image that decodes ({type(e).__name__}: {e})") from None
    if kind not in MEDIA_TYPES:
        raise ValueError(f"a {kind} image; the engine's processors take {', '.join(MEDIA_TYPES)}")
    return Image(hashlib.sha256(data).hexdigest(), MEDIA_TYPES[kind], width, height, data)


def decoded_base64(text: str) -> bytes:
    """The bytes of base64 `text` (whitespace allowed, as clients wrap it); ValueError when it is not base64."""
    try:
        return pybase64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"not base64 ({e})") from None


def data_url_bytes(url: str) -> bytes | None:
    """The bytes of a `data:` URL (base64), None for any other URL; ValueError for a malformed data URL."""
    if not url.startswith("data:"):
        return None
    head, sep, body = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ValueError("a data URL must be base64: data:<media type>;base64,<data>")
    return decoded_base64(body)


# How a canonical message names an image it holds: a content part `{"type": "image", "image": "sha256:<hex>"}`
# (what the chat template renders as the image's placeholder, and what a record's messages keep).
IMAGE_REF = "sha256:"


def image_part(sha256: str) -> dict[str, Any]:
    """The canonical content part of an image."""
    return {"type": "image", "image": IMAGE_REF + sha256}


def has_image_parts(messages: list[dict[str, Any]]) -> bool:
    """Whether any message holds an image part (`{"type": "image", ...}`), named or not yet taken."""
    return any(isinstance(p, dict) and p.get("type") == "image" for m in messages
               if isinstance(m.get("content"), list) for p in m["content"])


def images_in(messages: list[dict[str, Any]]) -> list[str]:
    """The images `messages` hold, in the order the chat template writes their placeholders."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            out += [p["image"][len(IMAGE_REF):] for p in content
                    if isinstance(p, dict) and p.get("type") == "image" and str(p.get("image", "")).startswith(
                        IMAGE_REF)]
    return out
