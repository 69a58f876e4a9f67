"""How records are stored and read back: float32 log-probs in their shortest form, a GC-paused decode, records a
session worker encoded crossing to the buffer as stored."""

from __future__ import annotations

import base64
import gc

import numpy as np
import orjson
import pytest
from pydantic import ValidationError

from rollout_buffer.delivery.encoded import EncodedRecord, decode_wire, encode_record
from rollout_buffer.delivery.side_data import packed, spliced, unpacked
from rollout_buffer.schemas import TrajectoryRecord
from slime_adapter.client import decode_json


def _record(log_probs: list[float]) -> TrajectoryRecord:
    n = len(log_probs)
    return TrajectoryRecord.model_validate({
        "uid": "u", "instance_id": "i", "reward": 1.0, "extra_info": {},
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        "tokens": list(range(10, 12 + n)), "loss_mask": [0, 0] + [1] * n, "rollout_log_probs": log_probs,
        "response_length": n,
    })


def test_log_probs_are_kept_at_float32_precision_in_their_shortest_form() -> None:
    # What SGLang sends: float32 values widened to Python floats (17 significant digits).
    sent = [float(np.float32(v)) for v in (-0.1234567, -2.5, -1e-7, -13.75390625, 0.0)]
    stored = encode_record(_record(sent))
    assert b"-0.1234567," in stored and b"-0.12345670163631439" not in stored
    back = orjson.loads(stored)["rollout_log_probs"]
    assert np.array_equal(np.asarray(back, dtype=np.float32), np.asarray(sent, dtype=np.float32))
    assert all(isinstance(v, float) for v in back)
    # Everything else is stored as it came.
    assert orjson.loads(stored)["tokens"] == _record(sent).tokens


def test_records_without_log_probs_are_stored_unchanged() -> None:
    rec = _record([-0.5])
    rec.rollout_log_probs = None
    assert orjson.loads(encode_record(rec))["rollout_log_probs"] is None


def test_decoding_pauses_the_gc_and_restores_it() -> None:
    assert decode_json(b'{"a": [1, 2.5]}') == {"a": [1, 2.5]}
    assert gc.isenabled()
    with pytest.raises(orjson.JSONDecodeError):
        decode_json(b"{not json")
    assert gc.isenabled()
    gc.disable()
    try:
        decode_json(b"[]")
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_a_record_encoded_by_a_worker_reaches_the_store_as_it_was_encoded() -> None:
    rec = _record([-0.5, -1.25])
    rec.extra_info = {"epoch": 2, "episode_id": "ep-1", "agent_id": 3, "metrics": {"steps": 4},
                      "weight_version_min": "5", "weight_version_max": "7"}
    encoded = EncodedRecord.of(rec)
    (back,) = decode_wire(orjson.loads(orjson.dumps([encoded.wire()])))
    assert back == encoded and back.row.blob == encode_record(rec)
    assert (back.row.epoch, back.row.episode, back.row.agent_id, back.versions, back.metrics) == (
        2, "ep-1", "3", (5, 7), {"steps": 4})
    malformed = {**encoded.wire(), "status": "done"}
    with pytest.raises(ValidationError, match="status"):
        decode_wire([malformed])
    sent = orjson.loads(orjson.dumps(encoded.wire()))
    kept = {k: v for k, v in sent.items() if k != "facts"}  # in an outbox since before facts were kept
    assert decode_wire([kept]) == [encoded]  # a record this short carries none


@pytest.mark.parametrize(("values", "bytes_a_value"), [
    ([0, 5, 127, 255], 1),  # expert ids
    ([0, 300, 65535], 2),
    ([0, 151_935, 2**31 - 1], 4),  # token ids
    ([-1, 4], 4),
    ([], 4),
])
def test_side_data_is_stored_narrow_and_read_back_as_int32(values: list[int], bytes_a_value: int) -> None:
    data = np.asarray(values, dtype="<i4").tobytes()
    blob = packed({"rollout_routed_experts": data, "rollout_top_p_token_ids": None})
    assert blob is not None and len(blob) <= 5 + 10 + len(values) * bytes_a_value
    assert unpacked(blob) == {"rollout_routed_experts": data}
    assert packed({}) is None


def test_a_records_side_data_goes_beside_its_json_and_comes_back_in_it_as_base64() -> None:
    rows = list(range(3 * 4))  # 3 rows (4 tokens) of 4 values
    rec = TrajectoryRecord.model_validate({**_record([-0.5, -0.25]).model_dump(), "rollout_routed_experts": rows,
                                           "rollout_id": "traj"})
    encoded = EncodedRecord.of(rec)
    assert b"rollout_routed_experts" not in encoded.row.blob and encoded.row.side is not None
    read = orjson.loads(spliced(encoded.row.blob, encoded.row.side))
    assert np.frombuffer(base64.b64decode(read["rollout_routed_experts"]), "<i4").tolist() == rows
    assert read["rollout_id"] == "traj" and "teacher_log_probs" not in read
    [crossed] = decode_wire(orjson.loads(orjson.dumps([encoded.wire()])))
    assert crossed.row.side == encoded.row.side
    with pytest.raises(ValidationError, match="rollout_routed_experts"):
        TrajectoryRecord.model_validate({**rec.model_dump(), "rollout_routed_experts": rows[:-1]})
