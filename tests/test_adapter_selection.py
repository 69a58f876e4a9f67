"""Which groups a training step gets: newest first, surplus kept, irregular groups beside the data buffer.

A scripted in-memory stand-in for the buffer's client replays deliveries and records every call, so the
order of "into the data buffer" and "ack" is visible. The live-server path is in test_adapter_e2e.py.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

import pytest

from slime_adapter.client import Delivery
from slime_adapter.data_buffer import DataBuffer
from slime_adapter.flags import AdapterSettings
from slime_adapter.records import SampleBuilder
from slime_adapter.rollout import GroupCollector, held_irregular_groups, take_batch


def group(instance_id: str, size: int, timestamp: float | None = None, **extra: Any) -> list[dict[str, Any]]:
    info: dict[str, Any] = {"epoch": 0, **extra}
    if timestamp is not None:
        info["timestamp"] = timestamp
    return [
        {
            "uid": f"{instance_id}-{k}",
            "instance_id": instance_id,
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "reward": float(k),
            "extra_info": dict(info),
            "tokens": [1, 2, 3, 4],
            "loss_mask": [0, 0, 1, 1],
            "response_length": 2,
        }
        for k in range(size)
    ]


class ScriptedBuffer:
    """Hands out prepared deliveries in order, then empty answers; logs calls into `events`."""

    def __init__(self, deliveries: list[list[dict[str, Any]]], events: list[str]):
        self.deliveries = [Delivery(recs, {"batch_id": f"b{i}", "total_samples": len(recs)})
                           for i, recs in enumerate(deliveries)]
        self.events = events

    def get_rollout_data(self, wait_s: float = 0.0, lease_s: float | None = None, **_: Any) -> Delivery:
        self.events.append("fetch")
        return self.deliveries.pop(0) if self.deliveries else Delivery([], {"total_samples": 0})

    def ack(self, batch_id: str, agent_id: str | None = None) -> int:
        self.events.append(f"ack {batch_id}" + (f" ({agent_id})" if agent_id else ""))
        return 1

    def status(self) -> dict[str, Any]:
        return {"run": {"state": "running"}, "groups": {}}


class RecordingDataBuffer(DataBuffer):
    def __init__(self, n: int, events: list[str], fail: bool = False):
        super().__init__(n)
        self.events = events
        self.fail = fail

    def add_samples(self, samples: list[list[Any]]) -> None:
        if self.fail:
            raise RuntimeError("trainer died in add_samples")
        super().add_samples(samples)
        self.events.append(f"add {len(samples)}")


def collector(client: ScriptedBuffer, data_buffer: DataBuffer, n: int, lease_s: float = 60.0,
              wait_s: float = 0.0) -> GroupCollector:
    args = Namespace(rollout_buffer_url="http://unused", rollout_buffer_lease_s=lease_s,
                     rollout_buffer_wait_s=wait_s)
    builder = SampleBuilder(lambda: None, "qwen")
    return GroupCollector(client, AdapterSettings.from_args(args), builder, data_buffer, n, rollout_id=5)  # type: ignore[arg-type]


def ids(groups: list[list[Any]]) -> list[str]:
    return [g[0].index for g in groups]


def test_newest_groups_are_used_first_and_the_rest_kept() -> None:
    events: list[str] = []
    stamps = {"g0": 3.0, "g1": 1.0, "g2": 5.0, "g3": 2.0, "g4": 4.0}
    delivery = [r for name, ts in stamps.items() for r in group(name, 2, ts)]
    data_buffer = RecordingDataBuffer(2, events)
    c = collector(ScriptedBuffer([delivery], events), data_buffer, n=2)
    c.fill(2)
    assert events == ["fetch", "add 5", "ack b0"]  # acked only once in the data buffer
    assert ids(take_batch(data_buffer, 2)) == ["g2", "g4"]
    assert data_buffer.get_buffer_length() == 3  # surplus kept, not dropped
    c.fill(2)
    assert events == ["fetch", "add 5", "ack b0"]  # enough held: the next step does not fetch
    assert ids(take_batch(data_buffer, 2)) == ["g0", "g3"]
    assert data_buffer.get_metadata() == {"5": ["g2", "g4", "g0", "g3", "g1"]}


def test_without_timestamps_later_deliveries_count_as_newer() -> None:
    events: list[str] = []
    first, second = group("old", 2), group("mid", 2) + group("new", 2) + group("newest", 2)
    data_buffer = RecordingDataBuffer(2, events)
    collector(ScriptedBuffer([first, second], events), data_buffer, n=2).collect(3)
    assert events == ["fetch", "fetch", "add 4", "ack b0", "ack b1"]
    assert ids(take_batch(data_buffer, 3)) == ["newest", "new", "mid"]
    assert ids(take_batch(data_buffer, 3)) == ["old"]


def test_a_crash_before_the_data_buffer_has_the_samples_acks_nothing() -> None:
    events: list[str] = []
    data_buffer = RecordingDataBuffer(2, events, fail=True)
    with pytest.raises(RuntimeError, match="trainer died"):
        collector(ScriptedBuffer([group("a", 2)], events), data_buffer, n=2).collect(1)
    assert events == ["fetch"]  # no ack: the buffer delivers the group again after the lease


def test_pending_groups_are_committed_before_a_wait_could_outlive_their_lease() -> None:
    events: list[str] = []
    data_buffer = RecordingDataBuffer(2, events)
    # lease 0.4 s, long-poll 0.35 s: waiting for more could let the first batch's lease run out.
    client = ScriptedBuffer([group("a", 2), group("b", 2)], events)
    collector(client, data_buffer, n=2, lease_s=0.4, wait_s=0.35).collect(2)
    assert events == ["fetch", "add 1", "ack b0", "fetch", "add 1", "ack b1"]


def test_irregular_groups_are_held_beside_the_data_buffer_and_returned_whole() -> None:
    events: list[str] = []
    episode = group("ep", 3, 9.0, agent_id="planner")  # e.g. a multi-agent episode of 3 trajectories
    data_buffer = RecordingDataBuffer(2, events)
    collector(ScriptedBuffer([group("reg", 2, 1.0) + episode], events), data_buffer, n=2).collect(2)
    assert data_buffer.get_buffer_length() == 1 and len(held_irregular_groups(data_buffer)) == 1
    batch = take_batch(data_buffer, 2)
    assert [len(g) for g in batch] == [2, 3]
    assert [s.group_index for g in batch for s in g] == [0, 0, 1, 1, 1]
    assert batch[1][0].metadata["agent_id"] == "planner"
    assert held_irregular_groups(data_buffer) == [] and data_buffer.get_buffer_length() == 0


def test_a_group_that_cannot_become_samples_is_dropped_not_redelivered_forever() -> None:
    events: list[str] = []
    broken = group("bad", 2)
    broken[1] = {**broken[1], "loss_mask": None, "response_length": None}
    data_buffer = RecordingDataBuffer(2, events)
    collector(ScriptedBuffer([broken + group("good", 2), group("next", 2)], events), data_buffer, n=2).fill(2)
    assert events == ["fetch", "add 1", "ack b0", "fetch", "add 1", "ack b1"]  # the broken group is acked too
    assert ids(take_batch(data_buffer, 2)) == ["good", "next"]


def test_an_engine_outage_is_logged_at_each_empty_poll_and_generation_is_waited_for(
        caplog: pytest.LogCaptureFixture) -> None:
    """The buffer's engines are down (a restart): the trainer says so each time it finds nothing, and keeps waiting;
    the groups come once the engines are back."""
    events: list[str] = []

    class DuringAnOutage(ScriptedBuffer):
        polls = 0

        def get_rollout_data(self, wait_s: float = 0.0, lease_s: float | None = None, **_: Any) -> Delivery:
            self.polls += 1
            if self.polls <= 2:
                events.append("fetch")
                return Delivery([], {"total_samples": 0})
            return super().get_rollout_data(wait_s, lease_s)

        def status(self) -> dict[str, Any]:
            outage = {"since": 1.0, "seconds": 42.0, "engines": ["http://router:30000"], "budget_s": 1800.0,
                      "error": "connection: ConnectionRefusedError"} if self.polls <= 2 else None
            return {"run": {"state": "running", "progress": {"engine_outage": outage}}, "groups": {}}

    client = DuringAnOutage([group("g0", 2)], events)
    with caplog.at_level("WARNING", logger="slime_adapter.rollout"):
        collector(client, RecordingDataBuffer(2, events), n=2, wait_s=1.0).fill(1)
    lines = [r.getMessage() for r in caplog.records if "have not answered" in r.getMessage()]
    assert len(lines) == 2 and "http://router:30000" in lines[0] and "42 s" in lines[0] and "1800" in lines[0]
    assert events == ["fetch", "fetch", "fetch", "add 1", "ack b0"]
