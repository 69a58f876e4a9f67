"""A forwarding front for session workers: what the buffer would pay if agents reached their sessions through it.

The buffer hands out base URLs that point at the session's worker (docs/session-workers.md says why). The other
design is one address for every agent and a front that forwards each turn to the worker holding the session, as
AReaL's gateway does. This is such a front, kept lean: uvicorn (with httptools, as the buffer serves) and a bare
ASGI app, no framework, that reads the worker from the session's id (`s-w<n>-…`) and passes the request and the
reply through with one pooled aiohttp connection set, the reply streamed as it comes. `bench.proxy --front`
measures its CPU per turn beside the buffer's and the workers'.

    python -m bench.forwarding_front --port 9000 --worker http://127.0.0.1:9101 --worker http://127.0.0.1:9102
"""

from __future__ import annotations

import argparse
import urllib.parse
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import uvicorn

from bench.harness import REPO, Service, free_port

# Hop-by-hop headers (RFC 9110 §7.6.1), and the request's own framing, which the front's client sets again (a
# reply passes through unchanged: its length stands).
_HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"upgrade"}
_NOT_FORWARDED = _HOP_BY_HOP | {b"host", b"content-length"}


class Front:
    """The ASGI app: `/sessions/s-w<n>-…/…` goes to worker n; `/healthz` answers here."""

    def __init__(self, workers: list[str]):
        self.workers = workers
        self.http: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        path: str = scope["path"]
        if path == "/healthz":
            await _answer(send, 200, b"ok")
            return
        worker = _worker_of(path)
        if worker is None or worker >= len(self.workers) or self.http is None:
            await _answer(send, 404, b'{"error": {"message": "no session worker for this path"}}')
            return
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        query = scope.get("query_string", b"")
        url = self.workers[worker] + path + (f"?{query.decode()}" if query else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k not in _NOT_FORWARDED]
        async with self.http.request(scope["method"], url, data=bytes(body), headers=headers) as reply:
            await send({"type": "http.response.start", "status": reply.status, "headers": [
                (k.lower(), v) for k, v in reply.raw_headers if k.lower() not in _HOP_BY_HOP]})
            async for chunk in reply.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                                                  timeout=aiohttp.ClientTimeout(total=None))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.http is not None:
                    await self.http.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _worker_of(path: str) -> int | None:
    """The worker a session path names (`/sessions/s-w3-…` → 3), or None."""
    parts = path.split("/", 3)
    if len(parts) < 3 or parts[1] != "sessions" or not parts[2].startswith("s-w"):
        return None
    number = parts[2][3:].split("-", 1)[0]
    return int(number) if number.isdigit() else None


async def _answer(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def forwarding_front(workdir: Path, buffer_url: str) -> Service:
    """This front as a subprocess on a free port, forwarding to the session workers of the buffer at `buffer_url`."""
    listed = httpx.get(f"{buffer_url}/status", timeout=10).raise_for_status().json()["session_workers"]
    workers = [w["url"] for w in sorted(listed, key=lambda w: w["worker"])]
    port = free_port()
    args = ["--port", str(port), *(a for url in workers for a in ("--worker", url))]
    return Service("bench.forwarding_front", args, port, "/healthz", workdir / f"front-{port}.log", REPO)


def through(front_url: str | None, url: str) -> str:
    """A session's `url` (at its worker) as reached through the front at `front_url`; `url` itself without one."""
    if front_url is None:
        return url
    parts = urllib.parse.urlsplit(url)
    return front_url + parts.path + (f"?{parts.query}" if parts.query else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker", action="append", default=[], help="a session worker's URL, worker 0 first")
    args = parser.parse_args()
    uvicorn.run(Front(args.worker), host="127.0.0.1", port=args.port, http="httptools", log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
