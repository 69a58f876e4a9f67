"""The store's group commit: operations queued together run in one transaction; when that transaction fails (a
full disk), each runs again on its own, so that only those that fail by themselves are refused."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest

from rollout_buffer.delivery.store import Store, StoreError


def test_a_write_the_full_store_refuses_refuses_nothing_batched_with_it(tmp_path: Path) -> None:
    async def main() -> None:
        store = Store(tmp_path / "store.sqlite", max_bytes=256 * 1024)
        await store.open()
        try:
            await store.call(lambda c: c.execute("CREATE TABLE t(k INTEGER PRIMARY KEY, v BLOB)"))
            stored = 0
            while stored < 1000:  # fill it: writes are refused once its pages run out
                try:
                    await store.call(lambda c, k=stored: c.execute("INSERT INTO t VALUES (?, ?)", (k, b"x" * 8000)))
                except StoreError:
                    break
                stored += 1
            assert 0 < stored < 1000

            def count(conn: sqlite3.Connection) -> int:
                n: int = conn.execute("SELECT count(*) FROM t").fetchone()[0]
                return n

            # The store thread held while a write that cannot fit, a read and a write that needs no new page are
            # queued: they run as one batch.
            gate = threading.Event()
            held = store.queue(lambda c: gate.wait(10))
            big = store.queue(lambda c: c.execute("INSERT INTO t VALUES (?, ?)", (10**6, b"y" * 100_000)))
            read = store.queue(count)
            small = store.queue(lambda c: c.execute("UPDATE t SET v=? WHERE k=0", (b"z" * 8000,)).rowcount)
            gate.set()
            assert await held is True
            with pytest.raises(StoreError, match="full"):
                await big
            assert await read == stored
            assert await small == 1
            assert await store.call(lambda c: c.execute("SELECT v FROM t WHERE k=0").fetchone()[0]) == b"z" * 8000
            # `/status` shows the last refusal for a while.
            refused = store.refusal()
            assert refused is not None and "full" in refused["error"]
            assert store.refusal(within_s=-1) is None
        finally:
            await store.close()

    asyncio.run(main())
