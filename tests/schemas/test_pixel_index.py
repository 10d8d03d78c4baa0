"""The pixel index seal: its one-pass form of the string and binary columns is what hashing
each value after its 4-byte length feeds the hash (the seal of files already written)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from schemas.pixel_index import _length_prefixed


def _one_by_one(column) -> bytes:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    out = bytearray()
    for value in column.to_pylist():
        raw = value if isinstance(value, bytes) else value.encode()
        out += len(raw).to_bytes(4, "little") + raw
    return bytes(out)


_RNG = np.random.default_rng(0)
COLUMNS = {
    "strings": pa.array(["", "rgb", "plain", "truncated_image,high_bit_depth_image_saturated", "é"]),
    "keys": pa.array([_RNG.bytes(16) for _ in range(9)], pa.binary(16)),
    "sliced strings": pa.array(["a", "bb", "ccc", "dddd", ""]).slice(1, 3),
    "sliced keys": pa.array([_RNG.bytes(16) for _ in range(9)], pa.binary(16)).slice(3, 4),
    "chunked": pa.chunked_array([pa.array(["x", "yy"]), pa.array(["zzz"])]),
    "empty": pa.array([], pa.string()),
}


@pytest.mark.parametrize("name", sorted(COLUMNS))
def test_length_prefixed_equals_value_by_value(name):
    assert _length_prefixed(COLUMNS[name]) == _one_by_one(COLUMNS[name])
