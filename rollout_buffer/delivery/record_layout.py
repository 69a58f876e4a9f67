"""How a record is laid out in the store: its JSON begins with its `reward` and `raw_reward`, the two fields its
group's outcome changes, and beside a long record's JSON are its facts, what the built-in group policy reads of
it.

So a long record's JSON is written once: its group completes from the facts (`records._finish`), and what it
decided, the JSON's new beginning, is kept apart (`record_rewards`) and put in place as the record is read
(`with_rewards`). For a 128k-token trajectory (megabytes of JSON) that is most of what storing it would
otherwise cost (`python -m bench.store_write --long-tokens 128000`).
"""

from __future__ import annotations

from typing import Any

import orjson

from rollout_buffer.delivery.side_data import spliced

# The fields the built-in group policy never reads (of the messages it reads the last: `groups.has_response`).
_HEAVY = ("messages", "tokens", "loss_mask", "rollout_log_probs", "teacher_log_probs")


def rewards_first(data: dict[str, Any]) -> dict[str, Any]:
    """A record's fields (`data`, as JSON-ready values) in the order they are stored: `reward`, `raw_reward`,
    then the rest in their own order."""
    return {"reward": data.get("reward"), "raw_reward": data.get("raw_reward"),
            **{k: v for k, v in data.items() if k not in ("reward", "raw_reward")}}


def rewards_prefix(record: dict[str, Any]) -> bytes:
    """How the stored JSON of a record with these `reward` and `raw_reward` begins (`rewards_first`)."""
    return (b'{"reward":' + orjson.dumps(record["reward"]) + b',"raw_reward":'
            + orjson.dumps(record.get("raw_reward")) + b",")


def record_facts(data: dict[str, Any]) -> dict[str, Any]:
    """What the built-in group policy reads of a record: all of it but its token lists and log-probs, and of
    its messages the last."""
    facts = {k: v for k, v in data.items() if k not in _HEAVY}
    facts["messages"] = data.get("messages", [])[-1:]
    return facts


# Reading a record: its JSON, what its group decided (NULLs when its JSON holds that already) and its side data,
# from `trajectories t` joined with `record_rewards w`; `with_rewards` puts them together.
REWARDED_SQL = "t.record, w.cut, w.head, t.side"
REWARDS_JOIN_SQL = "LEFT JOIN record_rewards w ON w.uid = t.uid"


def with_rewards(blob: bytes, cut: int | None, head: bytes | None, side: bytes | None = None) -> bytes:
    """A stored record's JSON as its group left it: its first `cut` bytes replaced by `head` when its group
    completed from its facts (`REWARDED_SQL`), else as stored; with its side data (`side_data`) in it."""
    record = blob if head is None or cut is None else head + memoryview(blob)[cut:]
    return spliced(record, side)
