"""Which images each stored record holds whole (`record_images`: uid, sha256), so retention knows which image
files are still needed: a row per image a record names, written with the record, deleted when retention cuts the
record down to its facts.

The names are read from the record's JSON as written (its `images` list and its messages' `sha256:` image parts)
without parsing it: a long trajectory's JSON is megabytes, and a text that merely looks like an image name only
keeps a file longer.
"""

from __future__ import annotations

import re
import sqlite3

_NAMED = re.compile(rb'"(?:sha256|image)":"(?:sha256:)?([0-9a-f]{64})"')


def image_names(blob: bytes) -> tuple[str, ...]:
    """The images a record's JSON names, each once, in order of appearance."""
    if b'"sha256' not in blob and b"sha256:" not in blob:
        return ()
    return tuple(dict.fromkeys(m.decode() for m in _NAMED.findall(blob)))


def hold(conn: sqlite3.Connection, uid: str, names: tuple[str, ...]) -> None:
    """The record `uid` holds the images `names`."""
    if names:
        conn.executemany("INSERT OR IGNORE INTO record_images(uid, sha256) VALUES (?, ?)",
                         [(uid, n) for n in names])


def let_go(conn: sqlite3.Connection, uid: str) -> None:
    """The record `uid` holds no image any more (cut down to its facts)."""
    conn.execute("DELETE FROM record_images WHERE uid=?", (uid,))


def held(conn: sqlite3.Connection, shas: list[str]) -> set[str]:
    """Those of `shas` a stored record holds."""
    out: set[str] = set()
    for at in range(0, len(shas), 500):  # SQLite's bound on parameters
        chunk = shas[at:at + 500]
        out.update(row[0] for row in conn.execute(
            f"SELECT DISTINCT sha256 FROM record_images WHERE sha256 IN ({','.join('?' * len(chunk))})", chunk))
    return out


def backfill(conn: sqlite3.Connection) -> None:
    """Rows for the records a store held before it had the table."""
    for uid, blob in conn.execute("SELECT uid, record FROM trajectories WHERE pruned_at IS NULL AND "
                                  "instr(record, 'sha256') > 0"):
        hold(conn, uid, image_names(bytes(blob)))
