"""Keeping the store's size bounded (`serve --prune-delivered-after-h H`): a long record (`FACTS_FROM_BYTES` of JSON or
more: a coding agent's trajectory is megabytes), one with side data (routed experts) or one holding images, whose
group every stream
has delivered (or dropped) is cut down to its facts (`record_layout`) once it is older than H hours: its token
lists, log-probs and all but its last message go, and its row stays, with its reward, status and summary (so a
resumed run still knows it, and the dashboard's lists, charts and group views are unchanged). Reading it answers
what is left, with `pruned_at`; `rollout-buffer export` leaves it out and counts it. A long record carries its
facts; one a group hook rewrote whole does not, and is parsed for them here.

An image file goes once no record holds it whole (`record_images`) and nothing has used it for `IMAGE_GRACE_S` or H,
whichever is longer: a conversation in progress uses its images at every engine call, and its record names them
only when it ends (`media.image_store`). Finding them lists the whole image folder, so it runs once an hour
(`IMAGE_SWEEP_EVERY_S`), not at every pass.

Without the option nothing is ever pruned. Short records are kept whole: a few KB each, they are not what fills a
disk. SQLite reuses the pages pruning frees; the file itself does not shrink (`VACUUM` it offline for that).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable

import orjson

from rollout_buffer.delivery.encoded import FACTS_FROM_BYTES
from rollout_buffer.delivery.record_images import held, let_go
from rollout_buffer.delivery.record_layout import record_facts, rewards_first
from rollout_buffer.delivery.store import Store, StoreError
from rollout_buffer.media.image_store import ImageStore

log = logging.getLogger(__name__)

PRUNE_EVERY_S = 60.0
IMAGE_GRACE_S = 24 * 3600.0  # far beyond an idle session's default life (`session_ttl_s`)
IMAGE_SWEEP_EVERY_S = 3600.0
_BATCH = 8  # records per transaction: each frees megabytes of pages, and the store thread serves delivery too

# A long record, or one with side data (`side_data`), of a group no stream is still to deliver (every stream's
# row delivered or filtered; a group filtered before it was ready has none). The conditions are the partial
# indexes', as the planner needs them.
_DELIVERED = """
JOIN groups g ON g.run_id=t.run_id AND g.instance_id=t.instance_id AND g.epoch=t.epoch AND g.part=t.part
WHERE t.pruned_at IS NULL AND {long} AND t.created_at < ?
AND g.state IN ('ready', 'filtered')
AND NOT EXISTS (SELECT 1 FROM stream_groups s WHERE s.run_id=t.run_id AND s.instance_id=t.instance_id
                AND s.epoch=t.epoch AND s.part=t.part AND s.state IN ('ready', 'leased'))
LIMIT ?
"""
_PRUNABLE = (f"SELECT t.rowid, t.facts IS NULL, t.uid FROM trajectories t INDEXED BY trajectories_prunable "
             f"{_DELIVERED.format(long=f'length(t.record) >= {FACTS_FROM_BYTES}')}")
_PRUNABLE_SIDE = (f"SELECT t.rowid, t.facts IS NULL, t.uid FROM trajectories t INDEXED BY trajectories_prunable_side "
                  f"{_DELIVERED.format(long='t.side IS NOT NULL')}")
_PRUNABLE_IMAGES = (f"SELECT DISTINCT t.rowid, t.facts IS NULL, t.uid FROM record_images i "
                    f"JOIN trajectories t ON t.uid = i.uid {_DELIVERED.format(long='1')}")


def prune_delivered(conn: sqlite3.Connection, before: float, limit: int = _BATCH) -> int:
    """Cut down to their facts up to `limit` long records of delivered groups stored before `before` (a time);
    how many were."""
    now, rows = time.time(), conn.execute(_PRUNABLE, (before, limit)).fetchall()
    for query in (_PRUNABLE_SIDE, _PRUNABLE_IMAGES):
        if len(rows) < limit:
            rows += [r for r in conn.execute(query, (before, limit)) if r not in rows][:limit - len(rows)]
    for rowid, rewritten, uid in rows:
        if rewritten:  # written whole by a group hook: its facts are made from it (it holds its rewards)
            (whole,) = conn.execute("SELECT record FROM trajectories WHERE rowid=?", (rowid,)).fetchone()
            facts = orjson.dumps(record_facts(rewards_first(orjson.loads(whole))))
            conn.execute("UPDATE trajectories SET facts=? WHERE rowid=?", (facts, rowid))
        conn.execute("UPDATE trajectories SET record=facts, facts=NULL, side=NULL, pruned_at=? WHERE rowid=?",
                     (now, rowid))
        let_go(conn, uid)
    return len(rows)


async def sweep_images(store: Store, images: ImageStore, before: float) -> tuple[int, int]:
    """Delete the image files no record holds whose time is before `before`; how many, and their bytes."""
    unused = await asyncio.to_thread(images.unused_since, before)
    count = size = 0
    for at in range(0, len(unused), 4096):
        chunk = unused[at:at + 4096]
        kept = await store.call(lambda conn, chunk=chunk: held(conn, chunk))  # type: ignore[misc]
        n, b = await asyncio.to_thread(images.remove, [s for s in chunk if s not in kept], before)
        count, size = count + n, size + b
    return count, size


class Retention:
    """The pruning loop: every `PRUNE_EVERY_S`, the records past `after_s`, a batch per transaction; then, at most
    every `IMAGE_SWEEP_EVERY_S`, the image files of `images` no record holds and nothing used for `image_grace_s`
    (default: `IMAGE_GRACE_S` or `after_s`, the longer). `clock` tells the time (wall-clock seconds)."""

    def __init__(self, store: Store, after_s: float, images: ImageStore | None = None, every_s: float = PRUNE_EVERY_S,
                 image_grace_s: float | None = None, clock: Callable[[], float] = time.time):
        self.store = store
        self.clock = clock
        self._swept_at: float | None = None
        self.after_s = after_s
        self.images = images
        self.every_s = every_s
        self.image_grace_s = max(after_s, IMAGE_GRACE_S) if image_grace_s is None else image_grace_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the loop (from the running event loop)."""
        log.info("retention: long records of delivered groups are cut down to their facts after %g h",
                 self.after_s / 3600)
        self._task = asyncio.create_task(self._loop(), name="retention")

    async def stop(self) -> None:
        """Stop the loop."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def prune(self) -> int:
        """Prune every record due now; how many were."""
        before, total = self.clock() - self.after_s, 0
        while (n := await self.store.call(lambda conn: prune_delivered(conn, before))) > 0:
            total += n
        if total:
            log.info("pruned %d long records of delivered groups (older than %g h): their facts are kept",
                     total, self.after_s / 3600)
        now = self.clock()
        if self.images is not None and (self._swept_at is None or now - self._swept_at >= IMAGE_SWEEP_EVERY_S):
            count, size = await sweep_images(self.store, self.images, now - self.image_grace_s)
            self._swept_at = now  # a sweep the store refused is tried again at the next pass
            if count:
                log.info("deleted %d image files (%.1f MB) no record holds whole and nothing used for %g h",
                         count, size / 1e6, self.image_grace_s / 3600)
        return total

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.prune()
            except StoreError as e:  # the next pass tries again
                log.warning("pruning delivered records failed: %s", e)
            except Exception:  # a bug must not end the loop unseen
                log.exception("pruning delivered records failed")
