"""A record's per-token side data, kept beside its JSON as bytes: the experts each of its tokens was routed to and
the ids top-p sampling kept (`engine.replay`), int32 arrays. In the JSON they would be lists of numbers, several
bytes a value, and every reader of a record would parse them; apart, each array is stored in the narrowest of
1, 2 or 4 bytes a value that holds it (expert ids fit one byte: a 32k-token trajectory of a 48-layer top-8 MoE
model keeps its 12M routed-expert values in 12 MB, not 48). They go out as SGLang encodes them, base64 of
little-endian int32 under slime's names, put into the record's JSON as it is read (`spliced`).
"""

from __future__ import annotations

import struct

import numpy as np
import pybase64

SIDE_FIELDS = ("rollout_routed_experts", "rollout_top_p_token_ids", "rollout_top_p_token_offsets")
_MAGIC = b"RBS2"
_HEAD = struct.Struct("<4sB")  # magic, how many fields
_FIELD = struct.Struct("<BBQ")  # the field's index in SIDE_FIELDS, bytes a value, its length in bytes
_INT32 = np.dtype("<i4")
_NARROW: dict[int, np.dtype[np.generic]] = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: _INT32}


def _narrowed(data: bytes) -> tuple[int, bytes]:
    """Little-endian int32 values in the fewest bytes a value that hold them all, and that width."""
    values = np.frombuffer(data, dtype=_INT32)
    if not values.size or values.min() < 0:
        return 4, data
    top = int(values.max())
    width = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4
    return width, data if width == 4 else values.astype(_NARROW[width]).tobytes()


def packed(fields: dict[str, bytes]) -> bytes | None:
    """The side data of a record (`SIDE_FIELDS` present, by name, as little-endian int32 bytes) as one blob; None
    when it has none."""
    present = [(i, *_narrowed(fields[name])) for i, name in enumerate(SIDE_FIELDS) if fields.get(name) is not None]
    if not present:
        return None
    return b"".join([_HEAD.pack(_MAGIC, len(present)),
                     *(part for i, width, data in present for part in (_FIELD.pack(i, width, len(data)), data))])


def unpacked(side: bytes) -> dict[str, memoryview]:
    """The fields of a `packed` blob, by name, as little-endian int32 (views, copied only to widen them). ValueError
    for a blob it did not make."""
    view = memoryview(side)
    magic, count = _HEAD.unpack_from(view)
    if magic != _MAGIC:
        raise ValueError("not a record's side data")
    at, out = _HEAD.size, {}
    for _ in range(count):
        index, width, length = _FIELD.unpack_from(view, at)
        at += _FIELD.size
        data = view[at:at + length]
        out[SIDE_FIELDS[index]] = (data if width == 4
                                   else np.frombuffer(data, dtype=_NARROW[width]).astype(_INT32).data.cast("B"))
        at += length
    return out


def spliced(record: bytes, side: bytes | None) -> bytes:
    """A record's JSON (an object) with its side data in it, each field base64 of its int32 bytes."""
    if side is None:
        return record
    parts: list[bytes | memoryview] = [memoryview(record)[:-1]]
    for name, data in unpacked(side).items():  # joined once: each field is megabytes
        parts += [b',"', name.encode(), b'":"', pybase64.b64encode(data), b'"']
    parts.append(b"}")
    return b"".join(parts)
