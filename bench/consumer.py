"""A trainer-side consumer that fetches groups the way the slime adapter does, and counts what it gets.

It uses the adapter's own protocol client (`slime_adapter.client.BufferClient`: synchronous httpx,
long-poll with a lease, then ack), in a thread of the benchmark process, and timestamps every delivery.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field

from slime_adapter.client import BufferClient, RetryPolicy


@dataclass
class Arrivals:
    """Delivery times (monotonic) and the samples each delivery held."""

    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def add(self, when: float, n: int) -> None:
        self.times.append(when)
        self.counts.append(n)

    def samples_between(self, start: float, end: float) -> int:
        """Samples delivered in [start, end)."""
        lo, hi = bisect.bisect_left(self.times, start), bisect.bisect_left(self.times, end)
        return sum(self.counts[lo:hi])

    @property
    def total(self) -> int:
        return sum(self.counts)


class PollingConsumer:
    """Long-polls `/get_rollout_data` (lease + ack, like the adapter) until stopped; `wait_s=0` polls."""

    def __init__(self, buffer_url: str, wait_s: float = 5.0, lease_s: float | None = 300.0, idle_s: float = 0.2):
        self.buffer_url = buffer_url
        self.wait_s = wait_s
        self.lease_s = lease_s
        # Pause after an empty answer when not long-polling (a buffer without long-poll answers at once).
        self.idle_s = idle_s
        self.arrivals = Arrivals()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="consumer", daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> PollingConsumer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.wait_s + 35)

    def _loop(self) -> None:
        try:
            with BufferClient(self.buffer_url, retry=RetryPolicy(retries=3, backoff_s=0.2)) as client:
                while not self._stop.is_set():
                    got = client.get_rollout_data(wait_s=self.wait_s, lease_s=self.lease_s)
                    if got.records:
                        self.arrivals.add(time.monotonic(), len(got.records))
                        if got.batch_id is not None and self.lease_s is not None:
                            client.ack(got.batch_id)
                    elif self.wait_s == 0:
                        self._stop.wait(self.idle_s)
        except BaseException as e:  # reported by the benchmark, which decides whether the run counts
            self.error = e
