"""Images fetched from the hosts the operator allows (`serve --image-url-host`): an agent that names a screenshot by
URL instead of sending it. Nothing else is fetched: a URL on any other host, a redirect (it could lead anywhere),
an answer that is not 200, larger than the image limit or slower than the deadline is a ValueError saying why, which
the protocols answer as a 400 naming the content part.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from rollout_buffer.policy import host_allowed

FETCH_TIMEOUT_S = 10.0


def url_host_allowed(url: str, hosts: tuple[str, ...]) -> bool:
    """Whether `url` is http(s) on one of `hosts` (names, addresses or `fnmatch` patterns; empty: none)."""
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(hosts and parts.hostname) and host_allowed(
        parts.hostname or "", hosts)


async def fetch_image_bytes(url: str, hosts: tuple[str, ...], max_bytes: int) -> bytes:
    """The bytes at `url`, an allowed host's (module docstring); ValueError saying why they are not fetched."""
    if not url_host_allowed(url, hosts):
        raise ValueError(f"a remote image URL ({url[:80]}) on a host this server does not fetch images from "
                         "(serve --image-url-host); send the image itself, as a data URL or base64")
    try:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=False, trust_env=False) as client:
            async with client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise ValueError(f"fetching {url[:80]} answered {resp.status_code}; only a 200 with the "
                                     "image is taken (no redirects)")
                data = bytearray()
                async for chunk in resp.aiter_bytes():
                    data += chunk
                    if len(data) > max_bytes:
                        raise ValueError(f"the image at {url[:80]} is over {max_bytes} bytes (--max-image-bytes)")
    except httpx.HTTPError as e:
        raise ValueError(f"fetching {url[:80]} failed ({type(e).__name__}: {e})") from None
    return bytes(data)
