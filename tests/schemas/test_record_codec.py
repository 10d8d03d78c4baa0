"""The record's pixel codec: compressed by the encoder, digest over decoded content, decoded once."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pyarrow as pa
import pytest

from schemas.compression import Compression, decompress
from schemas.anatomy import FIELD_KINDS, NOT_STORED
from schemas.packed_batch import SampleOrigin
from schemas.record import RECORD_SCHEMA, encode_record, record_digest, record_pixels, record_to_batch
from tests.helpers.fakepack import make_batch

SPECS = ["none", "zstd:1", "zstd:3", "zstd:-5", "lz4"]


def photo_like(batch):
    """Smooth pixels (compressible, unlike the random ones of make_batch), same table layout."""
    n = len(batch.image_pixels)
    batch.image_pixels = (np.arange(n) // 7 % 251).astype(np.uint8)
    return batch


def roundtrip(record: pa.RecordBatch) -> pa.RecordBatch:
    """The record as a reader sees it: written to an IPC file and read back."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, record.schema, options=Compression.parse("zstd:1").write_options()) as w:
        w.write_batch(record)
    return pa.ipc.open_file(pa.BufferReader(sink.getvalue())).get_batch(0)


@pytest.mark.parametrize("spec", SPECS)
def test_digest_is_the_content_digest_for_every_codec(spec):
    batch = photo_like(make_batch(5))
    ref_digest = encode_record(batch, Compression.parse("none")).digest
    encoded = encode_record(batch, Compression.parse(spec))
    record, digest = encoded.record, encoded.digest
    assert digest == ref_digest
    back = roundtrip(record)
    assert record_digest(back) == digest
    assert record.column("image_pixels_codec")[0].as_py() == spec.split(":")[0]
    np.testing.assert_array_equal(record_to_batch(back).image_pixels, batch.image_pixels)
    if spec.startswith("zstd"):
        assert record.column("image_pixels").nbytes < len(batch.image_pixels) / 5


def test_hand_over_gives_each_record_its_own_pixels():
    """Digests of two records, then decoding in the other order: no record gets the other's pixels."""
    zstd = Compression.parse("zstd:1")
    a, b = photo_like(make_batch(1)), photo_like(make_batch(1))
    b.image_pixels = b.image_pixels[::-1].copy()
    ra, rb = roundtrip(encode_record(a, zstd).record), roundtrip(encode_record(b, zstd).record)
    record_digest(ra), record_digest(rb)
    np.testing.assert_array_equal(record_to_batch(rb).image_pixels, b.image_pixels)
    np.testing.assert_array_equal(record_to_batch(ra).image_pixels, a.image_pixels)
    np.testing.assert_array_equal(record_to_batch(ra).image_pixels, a.image_pixels)  # no digest first: decoded


def test_damaged_compressed_pixels_are_caught():
    """A flipped byte inside the compressed pixel table: decoding fails or the digest differs."""
    encoded = encode_record(photo_like(make_batch(2)), Compression.parse("zstd:1"))
    record, digest = encoded.record, encoded.digest
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, record.schema, options=Compression.parse("zstd:1").write_options()) as w:
        w.write_batch(record)
    data = bytearray(sink.getvalue().to_pybytes())
    blob = record.column("image_pixels").flatten().to_numpy().tobytes()
    pos = bytes(data).find(blob[len(blob) // 2 : len(blob) // 2 + 64])
    assert pos > 0
    data[pos] ^= 0xFF
    damaged = pa.ipc.open_file(pa.BufferReader(bytes(data))).get_batch(0)
    try:
        assert record_digest(damaged) != digest
    except (pa.ArrowException, OSError, ValueError):
        pass
    with pytest.raises(ValueError, match="unknown pixel codec"):
        decompress("gzip", pa.py_buffer(blob), 10)


def test_wrong_decoded_size_is_refused():
    blob = Compression.parse("zstd:1").compress(np.zeros(1000, np.uint8))[1]
    with pytest.raises((pa.ArrowException, OSError, ValueError)):
        decompress("zstd", pa.py_buffer(blob), 999)


def _ipc(record: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, record.schema, options=Compression.parse("zstd:1").write_options()) as w:
        w.write_batch(record)
    return sink.getvalue().to_pybytes()


def _with_frames(batch, encoded, which):
    """``batch`` as a later pack holds it when images ``which`` come from ``encoded``'s frames: their
    slots of the table unwritten (here: scrambled), a ``StoredImage`` with the frame instead."""
    import copy

    from schemas.pixel_table import StoredImage
    from schemas.record import stored_pixel_frames

    _, data, frames = stored_pixel_frames(encoded.record)
    later = copy.copy(batch)
    later.image_pixels = batch.image_pixels.copy()
    later.image_stored = [None] * len(batch.image_heights)
    for i in which:
        a, b = int(batch.image_offsets[i]), int(batch.image_offsets[i + 1])
        later.image_pixels[a:b] = 0xA5
        later.image_stored[i] = StoredImage(int(batch.image_widths[i]), int(batch.image_heights[i]),
                                            int(encoded.image_digests[i]),
                                            frame=data.slice(int(frames[i]), int(frames[i + 1] - frames[i])).to_pybytes(),
                                            frame_format=encoded.frame_format)
    return later


@pytest.mark.parametrize("spec", ["zstd:1", "zstd:3", "lz4", "none"])
def test_a_frame_passed_through_is_the_record_a_fresh_encode_makes(spec):
    """Frames of an earlier zstd:1 record: a zstd:1 writer stores them as they are, any other
    compression decompresses and stores them its own way; either way the record is byte for byte the
    one made from the pixels, and so is its digest."""
    batch = photo_like(make_batch(4))
    first = encode_record(batch, Compression.parse("zstd:1"))
    n = len(batch.image_heights)
    assert n >= 2
    later = _with_frames(batch, first, range(0, n, 2))
    want = encode_record(batch, Compression.parse(spec))
    got = encode_record(later, Compression.parse(spec))
    assert _ipc(got.record) == _ipc(want.record) and got.digest == want.digest
    assert got.image_digests.tolist() == want.image_digests.tolist()
    assert got.frame_digests.tolist() == want.frame_digests.tolist()
    assert record_digest(roundtrip(got.record)) == want.digest
    for i in range(n):
        np.testing.assert_array_equal(later.image(i), batch.image(i))


def test_the_digest_sees_every_image():
    """The record digest covers each image's pixels: one byte of any image changes it."""
    batch = photo_like(make_batch(3))
    digest = encode_record(batch, Compression.parse("zstd:1")).digest
    for i in range(len(batch.image_heights)):
        changed = photo_like(make_batch(3))
        changed.image_pixels[int(batch.image_offsets[i])] ^= 1
        assert encode_record(changed, Compression.parse("zstd:1")).digest != digest


@pytest.mark.parametrize("spec", SPECS)
def test_frames_are_each_picture_compressed_alone(spec):
    """The table's frames (zstd: compressed in one call) are byte for byte what compressing each
    picture alone gives, with frames given from elsewhere kept as they are, in their places."""
    rng = np.random.default_rng(1)
    data = (np.cumsum(rng.integers(0, 7, 400_000)) % 256).astype(np.uint8)
    offsets = np.array([0, 90_000, 90_001, 250_000, 251_000, 400_000])
    c = Compression.parse(spec)
    bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
    alone = [bytes(memoryview(c.compress(data[a:b])[1])) for a, b in bounds]
    for given in ([None] * 5, [None, b"given-1", None, None, b"given-4"]):
        codec, stored, frames = c.compress_frames(data, offsets, None if spec == "none" else given)
        if spec == "none":
            assert bytes(memoryview(stored)) == data.tobytes()
            break
        want = [g if g is not None else a for g, a in zip(given, alone)]
        got = bytes(memoryview(stored))
        assert [got[frames[i]:frames[i + 1]] for i in range(5)] == want and codec == spec.split(":")[0]


def test_every_stored_field_comes_back_from_the_record():
    """Each field whose kind the record stores (``FIELD_KINDS``) has its column and comes back as
    it went in; a field of kind ``NOT_STORED`` has none and comes back empty."""
    batch = make_batch(6)
    columns = set(RECORD_SCHEMA.names)
    back = record_to_batch(roundtrip(encode_record(batch, Compression.parse("zstd:1")).record))
    for name, kind in FIELD_KINDS.items():
        want, got = getattr(batch, name), getattr(back, name)
        if kind.values == NOT_STORED:
            assert name not in columns and got == [], name
        elif name == "origins":
            assert {f"origin_{f.name}" for f in fields(SampleOrigin)} <= columns and got == want
        else:
            assert name in columns, name
            np.testing.assert_array_equal(got, want, err_msg=name)
            assert np.shape(got) == np.shape(want), name
