"""How sessions are named and numbered: their ids (a session placed on a session worker names it: `s-w<index>-…`),
the uid of a harness session's records, the URL a session is reached at, the repeat numbers of an instance."""

from __future__ import annotations

import hashlib
import secrets

_CHECK_CHARS = 8


def new_session_id(worker: int | None = None) -> str:
    """A fresh session id. One placed on session worker `worker` says so, so that another worker refuses it at
    once instead of waiting for a placement that is not coming (`placed_on`), and ends with a checksum, so that
    its worker refuses at once an id mistyped or made up (`well_formed`)."""
    if worker is None:
        return f"s-{secrets.token_hex(12)}"
    name = f"s-w{worker}-{secrets.token_hex(12)}"
    return name + _checksum(name)


def well_formed(session_id: str) -> bool:
    """Whether a session id naming a worker ends with its checksum (`new_session_id`). Not a secret: an id that
    passes still needs its session's key."""
    name, check = session_id[:-_CHECK_CHARS], session_id[-_CHECK_CHARS:]
    return len(session_id) > _CHECK_CHARS and _checksum(name) == check


def _checksum(name: str) -> str:
    return hashlib.blake2b(name.encode(), digest_size=_CHECK_CHARS // 2).hexdigest()


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


class RepeatNumbers:
    """The repeat number of each harness session of an instance in a run: 0, 1, 2, … in the order they open."""

    def __init__(self) -> None:
        self._next: dict[tuple[str, str], int] = {}

    def take(self, run_id: str, instance_id: str) -> int:
        """The next repeat number of `instance_id` in `run_id`."""
        repeat = self._next.get((run_id, instance_id), 0)
        self._next[(run_id, instance_id)] = repeat + 1
        return repeat

    def taken(self, run_id: str, instance_id: str, repeat: int) -> None:
        """`repeat` is in use (a session restored after a restart): the next one is above it."""
        key = (run_id, instance_id)
        self._next[key] = max(self._next.get(key, 0), repeat + 1)

    def end_run(self, run_id: str) -> None:
        """Forget the numbers of a run that ended."""
        self._next = {k: v for k, v in self._next.items() if k[0] != run_id}
