"""How sessions are named: their ids, the uid of a harness session's records, the URL a session is reached at."""

from __future__ import annotations

import secrets


def new_session_id() -> str:
    """A fresh session id."""
    return f"s-{secrets.token_hex(12)}"


def harness_uid(run_id: str, instance_id: str, session_id: str) -> str:
    """The uid of a harness session's records (one episode)."""
    return f"{run_id}:{instance_id}:{session_id}"


def session_root(public_url: str, session_id: str) -> str:
    """A session's root URL (its `anthropic_base_url`; `base_url` is `<root>/v1`) on the server at `public_url`."""
    return f"{public_url.rstrip('/')}/sessions/{session_id}"
