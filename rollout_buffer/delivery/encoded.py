"""A record in the form the store keeps it: its JSON encoded once, beside the few fields delivery and a run's
progress read. Session workers encode their sessions' records and hand them over so, and the buffer stores them
without validating or encoding them again (for a long trajectory that is most of what storing it costs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import orjson
import pybase64
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from rollout_buffer.delivery.record_images import image_names
from rollout_buffer.delivery.record_layout import record_facts, rewards_first
from rollout_buffer.delivery.records import NewRecord
from rollout_buffer.delivery.side_data import SIDE_FIELDS, packed
from rollout_buffer.delivery.streams import role_of
from rollout_buffer.delivery.versions import version_range
from rollout_buffer.schemas import TrajectoryRecord, TrajectoryStatus

_SIDE = set(SIDE_FIELDS)


class RecordError(ValueError):
    """A record that validates but cannot be stored (e.g. integers beyond 64 bits)."""


def _stored_form(record: TrajectoryRecord) -> dict[str, Any]:
    """The record's fields as stored (`record_layout.rewards_first`).

    Log-probs (the engine's, a teacher's) are kept at float32 precision, in their shortest float32 form: SGLang
    computes them in
    float32 and slime trains on float32 tensors, and the float64 digits beyond that are nearly half of the
    JSON of a long trajectory (which every consumer then has to parse).
    """
    try:
        data = record.model_dump(mode="json", exclude=_SIDE)  # its side data goes beside the JSON (`side_data`)
    except ValueError as e:  # pydantic's serializer stops at a depth JSON consumers would choke on too
        raise RecordError(_too_deep(record, e)) from None
    for name in ("teacher_log_probs", "images"):  # a run that has none stores nothing of them
        if data.get(name) is None:
            data.pop(name, None)
    for name in ("rollout_log_probs", "teacher_log_probs"):
        if data.get(name):
            data[name] = np.asarray(data[name], dtype=np.float32)
    return rewards_first(data)


def _side(record: TrajectoryRecord) -> bytes | None:
    return packed({name: getattr(record, name) for name in SIDE_FIELDS})


def _dumps(record: TrajectoryRecord, data: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY)
    except orjson.JSONEncodeError as e:
        if "recursion" in str(e).lower():
            raise RecordError(_too_deep(record, e)) from None
        raise RecordError(f"record {record.uid!r} cannot be stored as JSON: {e}") from None
    except TypeError as e:
        raise RecordError(f"record {record.uid!r} cannot be stored as JSON: {e}") from None


def _too_deep(record: TrajectoryRecord, error: Exception) -> str:
    """Why a record nested too deep for JSON cannot be stored, naming the field that goes deepest."""
    deepest: tuple[int, list[str]] = (0, [])
    fields = (*type(record).model_fields, *(record.model_extra or {}))
    stack: list[tuple[Any, list[str]]] = [(getattr(record, name, None), [name]) for name in fields]
    while stack:
        value, path = stack.pop()
        if len(path) > deepest[0]:
            deepest = (len(path), path)
        if isinstance(value, dict):
            stack += [(v, [*path, str(k)]) for k, v in value.items()]
        elif isinstance(value, list | tuple):
            stack += [(v, [*path, str(i)]) for i, v in enumerate(value) if isinstance(v, dict | list | tuple)]
    field = ".".join(deepest[1][:3]) + ("..." if len(deepest[1]) > 3 else "")
    return f"{field}: nested {deepest[0]} levels deep, too deep to store as JSON ({error})"


def encode_record(record: TrajectoryRecord) -> bytes:
    """The record as stored JSON; raises RecordError naming the uid when JSON cannot hold it."""
    return _dumps(record, _stored_form(record))


# A record's facts are kept when its JSON is at least this long. Below, they would be a sizeable share of the
# store (a short record's last message and `extra_info` are most of it) for no gain: completing a group of short
# records costs the buffer the same either way (docs/benchmarks/2026-11-26-storing-long-records.md).
FACTS_FROM_BYTES = 64 * 1024


@dataclass(frozen=True)
class EncodedRecord:
    """A validated record as the store takes it (`row`), with its weight versions (oldest, newest) and its
    `extra_info.metrics` (a run's progress averages them)."""

    row: NewRecord
    versions: tuple[int, int] | None
    metrics: dict[str, Any] | None
    failure: tuple[str, str] | None = None  # a failed trajectory's (error_kind, error), when known

    @classmethod
    def of(cls, record: TrajectoryRecord) -> EncodedRecord:
        """Encode a validated record, and the facts of a long one (RecordError when JSON cannot hold it)."""
        info = record.extra_info
        data = _stored_form(record)
        blob = _dumps(record, data)
        row = NewRecord(record.uid, record.instance_id, record.epoch, record.status, blob,
                        episode=info.get("episode_id"), agent_id=role_of({"extra_info": info}), reward=record.reward,
                        facts=orjson.dumps(record_facts(data)) if len(blob) >= FACTS_FROM_BYTES else None,
                        side=_side(record), images=image_names(blob))
        metrics = info.get("metrics")
        failure = ((str(info.get("error_kind") or "failed"), str(info.get("error") or ""))
                   if record.status == "failed" else None)
        return cls(row, version_range({"extra_info": info, "weight_versions": record.weight_versions}),
                   metrics if isinstance(metrics, dict) else None, failure)

    def wire(self) -> dict[str, Any]:
        """JSON-ready, for `decode_wire` in another process (the record's JSON as a string)."""
        r = self.row
        return {"uid": r.uid, "instance_id": r.instance_id, "epoch": r.epoch, "status": r.status,
                "episode": r.episode, "agent_id": r.agent_id, "reward": r.reward, "versions": self.versions,
                "metrics": self.metrics, "record": r.blob.decode(), "facts": (r.facts or b"").decode(),
                "side": None if r.side is None else pybase64.b64encode(r.side).decode()}


class _Wire(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    uid: str
    instance_id: str
    epoch: int
    status: TrajectoryStatus
    episode: str | None
    agent_id: str | None
    reward: float | None
    versions: Annotated[list[int], Field(min_length=2, max_length=2)] | None  # JSON has no tuples
    metrics: dict[str, Any] | None
    record: str
    facts: str = ""  # a short record has none (and a parcel an outbox kept from before facts)
    side: str | None = None  # its side data, base64


_WIRE: TypeAdapter[list[_Wire]] = TypeAdapter(list[_Wire])


def decode_wire(items: Any) -> list[EncodedRecord]:
    """Encoded records from their `wire()` form; pydantic's ValidationError names a malformed field. The record's
    JSON itself is not parsed again: the process that encoded it validated it (a session worker of this buffer)."""
    out = []
    for w in _WIRE.validate_python(items):
        blob = w.record.encode()
        out.append(EncodedRecord(NewRecord(w.uid, w.instance_id, w.epoch, w.status, blob, episode=w.episode,
                                           agent_id=w.agent_id, reward=w.reward, facts=w.facts.encode() or None,
                                           side=None if w.side is None else pybase64.b64decode(w.side),
                                           images=image_names(blob)),
                                 (w.versions[0], w.versions[1]) if w.versions else None, w.metrics))
    return out
