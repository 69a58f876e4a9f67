"""Container health probe: exit 0 when the URL answers 2xx in time, 1 otherwise.

Standard library only, so the same file serves the buffer image and the router image (whose Python has
nothing but sglang-router). Usage: `python healthcheck.py URL [TIMEOUT_S]`.
"""

from __future__ import annotations

import sys
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8889/healthz"


def healthy(url: str, timeout_s: float) -> bool:
    """True when `url` answers with a 2xx status within `timeout_s` (proxies ignored: the probe is local)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as resp:
            return 200 <= resp.status < 300
    except (OSError, ValueError) as e:  # URLError, HTTPError (4xx/5xx), timeouts, refused connections
        sys.stderr.write(f"unhealthy: {url}: {e}\n")
        return False


def main(argv: list[str]) -> int:
    """Probe argv[0] (default: the buffer's /healthz) with timeout argv[1] seconds (default 3)."""
    url = argv[0] if argv else DEFAULT_URL
    timeout_s = float(argv[1]) if len(argv) > 1 else 3.0
    return 0 if healthy(url, timeout_s) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
