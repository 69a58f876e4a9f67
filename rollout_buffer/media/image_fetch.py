"""Images fetched from the hosts the operator allows (`serve --image-url-host`): an agent that names a screenshot by
URL instead of sending it. Nothing else is fetched: a URL on any other host, a redirect (it could lead anywhere),
an answer that is not 200, larger than the image limit or slower than the deadline is a ValueError saying why, which
the protocols answer as a 400 naming the content part.

An allowed name is resolved once, here, and the request goes to the address it gave (the name kept for `Host` and
TLS): a name may not resolve to a loopback, private or link-local address unless that address is allowed too, so a
public name pointed at the buffer's own machine or network (DNS rebinding) fetches nothing there.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
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
    target = httpx.URL(url)
    address = await _checked_address(target.host, target.port or (443 if target.scheme == "https" else 80), hosts)
    pinned = target.copy_with(host=address)
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    try:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=False, trust_env=False) as client:
            async with client.stream("GET", pinned, headers={"host": target.netloc.decode()},
                                     extensions=extensions) as resp:
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


async def _checked_address(host: str, port: int, hosts: tuple[str, ...]) -> str:
    """The address to fetch from `host` at (module docstring); ValueError saying why there is none."""
    try:
        ipaddress.ip_address(host)
        return host  # an address the operator allowed
    except ValueError:
        pass
    try:
        found = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM),
                                       FETCH_TIMEOUT_S)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"the image host {host} does not resolve ({e})") from None
    except TimeoutError:
        raise ValueError(f"the image host {host} did not resolve within {FETCH_TIMEOUT_S:g} s") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
    for address in addresses:
        if not ipaddress.ip_address(address).is_global and not host_allowed(address, hosts):
            raise ValueError(f"the image host {host} resolves to {address}, a loopback, private or link-local "
                             f"address this server does not fetch from (allow it too: --image-url-host {address})")
    if not addresses:
        raise ValueError(f"the image host {host} does not resolve")
    return addresses[0]
