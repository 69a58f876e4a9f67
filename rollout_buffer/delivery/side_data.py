"""A record's per-token side data, kept beside its JSON as bytes: the experts each of its tokens was routed to and
the ids top-p sampling kept (`engine.replay`), little-endian int32 arrays. In the JSON they would be lists of
numbers, several bytes a value where these take four, and every reader of a record would parse them; apart, a
32k-token trajectory of a 48-layer top-8 MoE model keeps its 12M routed-expert values in 48 MB. They go out as
SGLang encodes them, base64 under slime's names, put into the record's JSON as it is read (`spliced`).
"""

from __future__ import annotations

import base64
import struct

SIDE_FIELDS = ("rollout_routed_experts", "rollout_top_p_token_ids", "rollout_top_p_token_offsets")
_MAGIC = b"RBS1"
_HEAD = struct.Struct("<4sB")  # magic, how many fields
_FIELD = struct.Struct("<BQ")  # the field's index in SIDE_FIELDS, its length in bytes


def packed(fields: dict[str, bytes]) -> bytes | None:
    """The side data of a record (`SIDE_FIELDS` present, by name) as one blob; None when it has none."""
    present = [(i, fields[name]) for i, name in enumerate(SIDE_FIELDS) if fields.get(name) is not None]
    if not present:
        return None
    return b"".join([_HEAD.pack(_MAGIC, len(present)),
                     *(part for i, data in present for part in (_FIELD.pack(i, len(data)), data))])


def unpacked(side: bytes) -> dict[str, memoryview]:
    """The fields of a `packed` blob, by name (views into it, not copies). ValueError for a blob it did not make."""
    view = memoryview(side)
    magic, count = _HEAD.unpack_from(view)
    if magic != _MAGIC:
        raise ValueError("not a record's side data")
    at, out = _HEAD.size, {}
    for _ in range(count):
        index, length = _FIELD.unpack_from(view, at)
        at += _FIELD.size
        out[SIDE_FIELDS[index]] = view[at:at + length]
        at += length
    return out


def spliced(record: bytes, side: bytes | None) -> bytes:
    """A record's JSON (an object) with its side data in it, each field base64 of its bytes."""
    if side is None:
        return record
    fields = b"".join(b',"' + name.encode() + b'":"' + base64.b64encode(data) + b'"'
                      for name, data in unpacked(side).items())
    return b"".join((memoryview(record)[:-1], fields, b"}"))
