"""Image parts naming a remote URL, fetched before the request is read when the operator allows their host (`serve
--image-url-host`): the URL is replaced with the image as a data URL, so each protocol then takes it as one the
client sent (OpenAI chat `image_url.url`, the Responses API's `input_image.image_url`, Anthropic's `image` with a
`url` source, wherever in the body they are: a tool result's content too). A URL on any other host stays, for the
protocol to refuse; a fetch that fails is the 400 naming its part.
"""

from __future__ import annotations

from typing import Any

from rollout_buffer.media.run_images import RunImages
from rollout_buffer.proxy.messages import WireError


async def fetch_image_urls(body: Any, images: RunImages) -> None:
    """Replace, in place, each remote image URL of `body` on an allowed host with its image (module docstring)."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack += [(v, f"{where}[{i}]") for i, v in enumerate(node)]
            continue
        if not isinstance(node, dict):
            continue
        holder, key = _url_of(node)
        if holder is not None and _remote(holder.get(key)):
            try:
                holder[key] = await images.fetched(holder[key])
            except ValueError as e:
                raise WireError("invalid_request", f"{where}: {e}", where) from None
            continue
        stack += [(v, f"{where}.{k}" if where else str(k)) for k, v in node.items() if isinstance(v, list | dict)]


def _url_of(part: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """Where an image part keeps its URL: the dict holding it and its key (None when `part` is no image part)."""
    kind = part.get("type")
    if kind == "image_url" and isinstance(part.get("image_url"), dict):
        return part["image_url"], "url"
    if kind in ("image_url", "input_image"):
        return part, "image_url"
    if kind == "image" and isinstance(part.get("source"), dict) and part["source"].get("type") == "url":
        return part["source"], "url"
    return None, ""


def _remote(url: Any) -> bool:
    return isinstance(url, str) and url.startswith(("http://", "https://"))
