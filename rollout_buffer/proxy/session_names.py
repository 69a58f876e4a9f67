"""How sessions are named: their ids (a session placed on a session worker names it: `s-w<index>-…`), the uid of a
harness session's records, the URL a session is reached at."""

from __future__ import annotations

import secrets


def new_session_id(worker: int | None = None) -> str:
    """A fresh session id; one placed on session worker `worker` says so, so that another worker refuses it at
    once instead of waiting for a placement that is not coming (`placed_on`)."""
    return f"s-{secrets.token_hex(12)}" if worker is None else f"s-w{worker}-{secrets.token_hex(12)}"


def placed_on(session_id: str) -> int | None:
    """The session worker a session id was placed on (`new_session_id(worker)`), None for other ids."""
    tag, _, rest = session_id.removeprefix("s-w").partition("-")
    return int(tag) if session_id.startswith("s-w") and rest and tag.isdigit() and tag.isascii() else None


def harness_uid(run_id: str, instance_id: str, session_id: str) -> str:
    """The uid of a harness session's records (one episode)."""
    return f"{run_id}:{instance_id}:{session_id}"


def session_root(public_url: str, session_id: str) -> str:
    """A session's root URL (its `anthropic_base_url`; `base_url` is `<root>/v1`) on the server at `public_url`."""
    return f"{public_url.rstrip('/')}/sessions/{session_id}"
