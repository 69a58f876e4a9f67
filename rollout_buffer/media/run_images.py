"""The images of one run's trajectories: each taken once (checked, stored by hash), known by its hash from then on
(`info`), and handed to the engine as data URLs (`data_urls`, the recent ones kept encoded: an agent resends its
screenshots every turn). With the checkpoint's image processor (`vision`) the conversation counts each image's
placeholder tokens; without one the run's checkpoint reads no images.

Every image a conversation takes or sends to the engine has its file's time kept recent (`ImageStore.touch`, at
most once per `TOUCH_EVERY_S` an image): retention deletes only images no record holds and nothing used for a day.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from rollout_buffer.media.image_fetch import fetch_image_bytes
from rollout_buffer.media.image_store import ImageStore
from rollout_buffer.media.images import (
    DEFAULT_MAX_IMAGE_BYTES,
    IMAGE_REF,
    Image,
    ImageInfo,
    data_url_bytes,
    decoded_base64,
    image_of,
    image_part,
)
from rollout_buffer.media.vision import VisionProcessor

_ENCODED_KEPT_BYTES = 256 * 1024 * 1024  # data URLs kept for the next turns' requests
TOUCH_EVERY_S = 600.0  # far below retention's grace (`delivery.retention.IMAGE_GRACE_S`)


class RunImages:
    """One run's images (module docstring)."""

    def __init__(self, store: ImageStore, vision: VisionProcessor | None, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
                 url_hosts: tuple[str, ...] = ()):
        self.store = store
        self.vision = vision
        self.max_bytes = max_bytes
        self.url_hosts = url_hosts  # the hosts images are fetched from by URL (`image_fetch`); empty: none
        self._infos: dict[str, ImageInfo] = {}
        self._fetched: dict[str, str] = {}  # URL → the hash of what it gave
        self._urls: OrderedDict[str, str] = OrderedDict()
        self._url_bytes = 0
        self._touched: dict[str, float] = {}  # hash → when its file's time was last set (monotonic)

    async def take(self, data: bytes) -> ImageInfo:
        """`data` checked as an image and stored (ValueError saying why it is not one the run takes)."""
        image = await asyncio.to_thread(image_of, data, self.max_bytes)
        if image.sha256 not in self._infos or self._due([image.sha256]):
            await asyncio.to_thread(self.store.put, image)
            self._touched[image.sha256] = time.monotonic()
        return self._remember(image)

    async def _keep(self, shas: Iterable[str]) -> None:
        """A conversation still uses the images `shas` (sent to the engine)."""
        due = self._due(shas)
        if due:
            await asyncio.to_thread(self.store.touch, due)
            now = time.monotonic()
            self._touched.update((s, now) for s in due)

    def _due(self, shas: Iterable[str]) -> list[str]:
        since = time.monotonic() - TOUCH_EVERY_S
        return [s for s in dict.fromkeys(shas) if self._touched.get(s, since - 1) < since]

    async def fetched(self, url: str) -> str:
        """The image at `url` as a data URL: fetched from an allowed host once, then known by its hash (ValueError
        saying why it is not taken)."""
        sha = self._fetched.get(url)
        if sha is None:
            sha = (await self.take(await fetch_image_bytes(url, self.url_hosts, self.max_bytes))).sha256
            self._fetched[url] = sha
        return (await self.data_urls([sha]))[0]

    async def canonical(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` with each image part a generator gave (`{"type": "image", "image": ...}` holding bytes, a
        data URL or base64) taken and named by its hash (`images.image_part`); ValueError naming the part for one
        that is not an image the run takes."""
        out = []
        for i, m in enumerate(messages):
            content = m.get("content")
            if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "image"
                                                          for p in content):
                out.append(m)
                continue
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image":
                    try:
                        part = image_part((await self._named(part.get("image"))).sha256)
                    except ValueError as e:
                        raise ValueError(f"messages[{i}].content[{j}]: {e}") from None
                parts.append(part)
            out.append({**m, "content": parts})
        return out

    async def _named(self, value: Any) -> ImageInfo:
        if isinstance(value, str) and value.startswith(IMAGE_REF):
            return self.info(value[len(IMAGE_REF):])
        if isinstance(value, bytes | bytearray):
            return await self.take(bytes(value))
        if isinstance(value, str):
            data = data_url_bytes(value)
            return await self.take(data if data is not None else decoded_base64(value))
        raise ValueError(f"an image part holds bytes, a data URL or base64, not {type(value).__name__}")

    def info(self, sha256: str) -> ImageInfo:
        """The image `sha256` the run took (or the store holds: a session restored after a restart); ValueError
        when it is unknown."""
        known = self._infos.get(sha256)
        if known is not None:
            return known
        image = self.store.get(sha256)  # small and rare: a restored session's images, read once each
        if image is None:
            raise ValueError(f"image {sha256} is not stored")
        return self._remember(image)

    async def data_urls(self, shas: list[str]) -> list[str]:
        """The images as SGLang's `image_data` takes them, in order."""
        await self._keep(shas)
        missing = [s for s in dict.fromkeys(shas) if s not in self._urls]
        if missing:
            for sha, url in zip(missing, await asyncio.to_thread(self._encoded, missing), strict=True):
                self._urls[sha] = url
                self._url_bytes += len(url)
        for sha in shas:
            self._urls.move_to_end(sha)
        urls = [self._urls[s] for s in shas]
        while self._url_bytes > _ENCODED_KEPT_BYTES:  # the least recently sent go first
            _, dropped = self._urls.popitem(last=False)
            self._url_bytes -= len(dropped)
        return urls

    def _encoded(self, shas: list[str]) -> list[str]:
        out = []
        for sha in shas:
            image = self.store.get(sha)
            if image is None:
                raise ValueError(f"image {sha} is not stored")
            out.append(image.data_url())
        return out

    def _remember(self, image: Image) -> ImageInfo:
        info = ImageInfo(image.sha256, image.media_type, image.width, image.height)
        self._infos[image.sha256] = info
        return info
