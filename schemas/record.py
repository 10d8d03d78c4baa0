"""The on-disk record: one packed batch (``schemas.packed_batch.PackedBatch``) = one single-row
Arrow record batch; its encoding, decoding and content digest.

Why a single row of list columns: a packed batch is a bag of arrays of unrelated lengths (text
tokens, ViT tokens, images, samples). A record batch needs equal-length columns, so every field is
a ``list<...>`` column holding one list; the reader takes each column's child buffer zero-copy.
Pixels are stored row-delta coded (each byte minus the same channel of the pixel to its left, mod
256): exact, and zstd then compresses photos to ~2/3 of the plain size at twice the speed.

On disk (version 3) the pixel table is the one buffer the encoder compresses itself
(``schemas.compression``: zstd with a small match-finder table, lz4 or none, named in the
``image_pixels_codec`` column), one frame per image (``image_pixels_frames``: where each frame
starts in the stored buffer), so a later pack can read one picture without the rest of the
record; every other buffer is stored as is.  The content digest covers the decoded values, so it
does not depend on the codec or the framing; for the pixel table it covers each image's XXH3-64
(``image_digest``), so a writer that passes an earlier pack's frame through untouched
(``StoredImage``) knows the digest without decompressing it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import xxhash

from schemas.compression import Compression, decompress_frame, decompress_frames
from schemas.packed_batch import PackedBatch, SampleOrigin
from schemas.pixel_table import StoredImage, image_digest, image_digests

# 2: the pixel table is compressed by the record encoder (codec in ``image_pixels_codec``),
#    the Arrow IPC buffers are not.
# 3: one compressed frame per image (``image_pixels_frames``).
# 4: the content digest covers the pixel table as its images' XXH3-64 digests; ``sample_num_frames``.
RECORD_SCHEMA_VERSION = 4

# Column order is part of the contract: digests are computed over columns in this order.
_ARRAY_COLUMNS: list[tuple[str, pa.DataType]] = [
    ("sample_lens", pa.int32()),
    ("sample_num_splits", pa.int32()),
    ("sample_num_frames", pa.int32()),
    ("split_lens", pa.int32()),
    ("attn_modes", pa.uint8()),
    ("packed_text_ids", pa.int32()),
    ("packed_text_indexes", pa.int32()),
    ("packed_position_ids", pa.int32()),
    ("packed_label_ids", pa.int32()),
    ("ce_loss_indexes", pa.int32()),
    ("ce_loss_weights", pa.float32()),
    ("image_heights", pa.int32()),
    ("image_widths", pa.int32()),
    ("image_offsets", pa.int64()),
    ("image_pixels", pa.uint8()),
    ("image_norm", pa.float64()),  # flattened [n_images * 6]: mean rgb, std rgb
    ("vit_image_ids", pa.int32()),
    ("vit_token_seqlens", pa.int32()),
    ("packed_vit_position_ids", pa.int32()),
    ("packed_vit_token_indexes", pa.int32()),
    ("vae_image_ids", pa.int32()),
    ("vae_latent_shapes", pa.int32()),  # flattened [n_vae * 2]: h, w
    ("packed_latent_position_ids", pa.int32()),
    ("packed_vae_token_indexes", pa.int32()),
    ("packed_timesteps", pa.float32()),
    ("mse_loss_indexes", pa.int32()),
]
_SCALAR_COLUMNS: list[tuple[str, pa.DataType]] = [
    ("use_flex", pa.bool_()),
    ("max_num_tokens", pa.int64()),
    ("vit_patch_size", pa.int32()),
    ("sequence_length", pa.int64()),
]
_ORIGIN_COLUMNS: list[tuple[str, pa.DataType]] = [
    ("origin_group", pa.string()),
    ("origin_dataset", pa.string()),
    ("origin_worker_id", pa.int32()),
    ("origin_data_indexes", pa.list_(pa.int64())),
    ("origin_scalar", pa.bool_()),
    ("origin_source_file", pa.string()),
    ("origin_source_row_group", pa.int64()),
    ("origin_source_row", pa.int64()),
]
_ORIGIN_ATTRS = [name[len("origin_") :] for name, _ in _ORIGIN_COLUMNS]
# How ``image_pixels`` is stored; not part of the content (nor of the digest).
_CODEC_COLUMN = "image_pixels_codec"
_FRAMES_COLUMN = "image_pixels_frames"  # [n_images + 1] offsets of each image's frame in the stored bytes

RECORD_SCHEMA = pa.schema(
    [pa.field(n, t, nullable=False) for n, t in _SCALAR_COLUMNS]
    + [pa.field(_CODEC_COLUMN, pa.string(), nullable=False)]
    + [pa.field(_FRAMES_COLUMN, pa.list_(pa.int64()), nullable=False)]
    + [pa.field(n, pa.list_(t), nullable=False) for n, t in _ARRAY_COLUMNS]
    + [pa.field(n, pa.list_(t), nullable=False) for n, t in _ORIGIN_COLUMNS]
)
_NUMPY = {pa.int32(): np.int32, pa.int64(): np.int64, pa.uint8(): np.uint8, pa.float32(): np.float32,
          pa.float64(): np.float64}
ARRAY_DTYPES = {name: np.dtype(_NUMPY[t]) for name, t in _ARRAY_COLUMNS}


def _to_record(batch: PackedBatch, codec: str, stored_pixels, frames: np.ndarray,
               metadata: dict[str, str] | None, arrays: dict[str, np.ndarray] | None = None) -> pa.RecordBatch:
    """The record of ``batch``; ``arrays`` (when given) receives each array column's values as the
    record holds them (``record_arrays`` of it, without reading them back)."""
    cols = [pa.array([getattr(batch, n)], type=t) for n, t in _SCALAR_COLUMNS]
    cols.append(pa.array([codec], type=pa.string()))
    cols.append(pa.ListArray.from_arrays(pa.array([0, len(frames)], type=pa.int32()),
                                         pa.array(np.asarray(frames, np.int64), type=pa.int64())))
    for name, typ in _ARRAY_COLUMNS:
        if name == "image_pixels":
            values = pa.py_buffer(stored_pixels) if not isinstance(stored_pixels, pa.Buffer) else stored_pixels
            values = pa.Array.from_buffers(pa.uint8(), values.size, [None, values])
        else:
            flat = np.ascontiguousarray(getattr(batch, name), dtype=ARRAY_DTYPES[name]).reshape(-1)
            values = pa.array(flat, type=typ)
            if arrays is not None:
                arrays[name] = flat
        offsets = pa.array([0, len(values)], type=pa.int32())
        cols.append(pa.ListArray.from_arrays(offsets, values))
    for (name, typ), attr in zip(_ORIGIN_COLUMNS, _ORIGIN_ATTRS):
        cols.append(pa.array([[getattr(o, attr) for o in batch.origins]], type=pa.list_(typ)))
    schema = RECORD_SCHEMA.with_metadata(metadata) if metadata else RECORD_SCHEMA
    return pa.RecordBatch.from_arrays(cols, schema=schema)


@dataclass(frozen=True)
class EncodedRecord:
    """A record as ``encode_record`` made it, with what the writer's pixel index needs of it."""

    record: pa.RecordBatch
    digest: str  # ``record_digest`` of the record
    frame_format: str  # of every frame in its pixel table
    image_digests: np.ndarray  # uint64 per image: ``image_digest`` of its coded pixels
    frame_digests: np.ndarray  # uint64 per image: XXH3-64 of its frame as stored


def encode_record(batch: PackedBatch, compression: Compression | None = None,
                  metadata: dict[str, str] | None = None) -> EncodedRecord:
    """A PackedBatch as a record, its pixel table stored with ``compression``.

    The digest is taken from the pixels in hand (or, for a frame passed through, from its pixel
    index digest), so writing never decompresses what it just compressed; it equals
    ``record_digest`` of the record read back.  A ``StoredImage`` frame of another format than
    ``compression``'s is decompressed and compressed again (never stored under a wrong name).
    """
    compression = compression or Compression(None, None)
    fmt = compression.frame_format
    pixels = np.ascontiguousarray(batch.image_pixels, dtype=np.uint8).reshape(-1)
    offsets = np.asarray(batch.image_offsets, np.int64)
    stored = list(batch.image_stored) + [None] * (len(offsets) - 1 - len(batch.image_stored))
    given: list = [None] * len(stored)
    digests = np.zeros(len(stored), np.uint64)
    for i, im in enumerate(stored):
        a, b = int(offsets[i]), int(offsets[i + 1])
        if im is not None and im.frame is not None:
            if im.frame_format == fmt and compression.codec is not None:
                given[i] = im.frame
                digests[i] = im.digest
                continue
            pixels = pixels if pixels.flags.writeable else pixels.copy()
            pixels[a:b] = im.coded_pixels()  # another format: stored anew from its pixels
        digests[i] = image_digest(pixels[a:b])
    codec, data, frames = compression.compress_frames(pixels, offsets, given)
    arrays: dict[str, np.ndarray] = {}
    record = _to_record(batch, codec, data, frames, metadata, arrays)
    view = memoryview(data if not isinstance(data, np.ndarray) else data.data).cast("B")
    bounds = frames.tolist()
    frame_digests = np.fromiter((xxhash.xxh3_64_intdigest(view[a:b]) for a, b in zip(bounds[:-1], bounds[1:])),
                                np.uint64, count=len(stored))
    return EncodedRecord(record, _digest(record, digests, arrays), fmt, digests, frame_digests)


def batch_to_record(batch: PackedBatch, metadata: dict[str, str] | None = None) -> pa.RecordBatch:
    """Encode a PackedBatch as one single-row record batch (schema ``RECORD_SCHEMA``), pixels
    stored uncompressed (``encode_record`` compresses them)."""
    pixels = np.ascontiguousarray(batch.image_pixels, dtype=np.uint8).reshape(-1)
    return _to_record(batch, "none", pixels, np.asarray(batch.image_offsets, np.int64), metadata)


def record_arrays(record: pa.RecordBatch) -> dict[str, np.ndarray]:
    """Zero-copy numpy views of a record's array columns as stored (read-only; ``image_pixels``
    is the stored, possibly compressed, pixel table: see ``record_pixels``)."""
    out = {}
    for name, _ in _ARRAY_COLUMNS:
        out[name] = record.column(name).flatten().to_numpy(zero_copy_only=True)
    return out


def _stored_pixels(record: pa.RecordBatch) -> tuple[str, pa.Array, int]:
    """(codec, stored pixel bytes as a uint8 array, decoded size) of a record."""
    codec = record.column(_CODEC_COLUMN)[0].as_py()
    offsets = record.column("image_offsets").flatten()
    nbytes = int(offsets[len(offsets) - 1].as_py()) if len(offsets) else 0
    return codec, record.column("image_pixels").flatten(), nbytes


def stored_pixel_frames(record: pa.RecordBatch) -> tuple[str, pa.Buffer, np.ndarray]:
    """(codec, the stored pixel bytes, each image's frame offsets in them) as written."""
    codec, stored, _ = _stored_pixels(record)
    frames = record.column(_FRAMES_COLUMN).flatten().to_numpy(zero_copy_only=True)
    data = stored.buffers()[1].slice(stored.offset, len(stored)) if len(stored) else pa.py_buffer(b"")
    return codec, data, frames


def record_pixels(record: pa.RecordBatch) -> np.ndarray:
    """The record's pixel table, decoded (row-delta coded uint8, as in ``PackedBatch``; read-only)."""
    codec, stored, nbytes = _stored_pixels(record)
    frames = record.column(_FRAMES_COLUMN).flatten().to_numpy(zero_copy_only=True)
    offsets = record.column("image_offsets").flatten().to_numpy(zero_copy_only=True)
    if len(frames) != len(offsets) or (len(frames) and int(frames[-1]) != len(stored)):
        raise ValueError(f"pixel frames {frames.tolist()[:4]}... do not match the {len(stored)} stored bytes")
    if codec == "none":
        if len(stored) != nbytes:
            raise ValueError(f"pixel table is {len(stored)} bytes, the image offsets say {nbytes}")
        return stored.to_numpy(zero_copy_only=True)
    data = stored.buffers()[1].slice(stored.offset, len(stored))
    return np.frombuffer(decompress_frames(codec, data, frames, offsets), dtype=np.uint8)


class _DecodedPixels:
    """Hand-over of decoded pixel tables from ``record_digest`` to ``record_to_batch``.

    A reader checks a record's digest and then decodes it: without the hand-over the pixel table
    would be decompressed twice.  Entries are keyed by the address and size of the stored bytes
    and hold a reference to them, so that memory cannot be reused by another record while its
    entry lives; ``record_to_batch`` takes its entry out, and only the last few are kept.
    """

    def __init__(self, keep: int = 2):
        self._keep = keep
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[int, int], tuple[pa.Array, np.ndarray]] = OrderedDict()

    @staticmethod
    def _key(stored: pa.Array) -> tuple[int, int]:
        return stored.buffers()[1].address + stored.offset, len(stored)

    def put(self, record: pa.RecordBatch, pixels: np.ndarray) -> None:
        stored = record.column("image_pixels").flatten()
        with self._lock:
            self._entries[self._key(stored)] = (stored, pixels)
            while len(self._entries) > self._keep:
                self._entries.popitem(last=False)

    def take(self, record: pa.RecordBatch) -> np.ndarray | None:
        stored = record.column("image_pixels").flatten()
        if len(stored) == 0:
            return None
        with self._lock:
            entry = self._entries.pop(self._key(stored), None)
        return None if entry is None else entry[1]


_decoded = _DecodedPixels()


def record_to_batch(record: pa.RecordBatch) -> PackedBatch:
    """Decode a record written by ``encode_record``/``batch_to_record``; arrays are zero-copy
    read-only views (the pixel table is decompressed once, or taken from ``record_digest``)."""
    pixels = _decoded.take(record)
    return _batch_of(record, record_pixels(record) if pixels is None else pixels)


def _batch_of(record: pa.RecordBatch, pixels: np.ndarray, stored: "list | None" = None) -> PackedBatch:
    """A one-row record's PackedBatch with ``pixels`` as its pixel table (and ``stored``: its
    ``image_stored``); every other field a zero-copy view of the record's columns."""
    if record.num_rows != 1:
        raise ValueError(f"a packed-batch record has exactly one row, got {record.num_rows}")
    kwargs = {n: record.column(n)[0].as_py() for n, _ in _SCALAR_COLUMNS}
    arrays = record_arrays(record)
    arrays["image_pixels"] = pixels
    arrays["image_norm"] = arrays["image_norm"].reshape(-1, 6)
    arrays["vae_latent_shapes"] = arrays["vae_latent_shapes"].reshape(-1, 2)
    kwargs.update(arrays)
    origin_lists = [record.column(n)[0].as_py() for n, _ in _ORIGIN_COLUMNS]
    kwargs["origins"] = [SampleOrigin(**dict(zip(_ORIGIN_ATTRS, vals))) for vals in zip(*origin_lists)]
    return PackedBatch(**kwargs, image_stored=stored or [])


def record_to_framed_batch(record: pa.RecordBatch, known: "dict[int, int]", frame_format: str) -> PackedBatch:
    """A record as ``record_to_batch`` gives it, but each image ``known`` names (image -> its
    ``image_digest``, from the shard's pixel index) left as its compressed frame (a ``StoredImage``
    in ``image_stored``, its slot of ``image_pixels`` unwritten), so a writer of frames of the same
    ``frame_format`` passes it through without decompressing or compressing it; the other images
    are decompressed into their slots.  The record's bytes must be checked already (its shard's
    file digest): nothing here decompresses what it passes through."""
    codec, data, frames = stored_pixel_frames(record)
    if codec == "none" or not known:
        return record_to_batch(record)
    offsets = record.column("image_offsets").flatten().to_numpy(zero_copy_only=True)
    heights = record.column("image_heights").flatten().to_numpy(zero_copy_only=True)
    widths = record.column("image_widths").flatten().to_numpy(zero_copy_only=True)
    pixels = np.empty(int(offsets[-1]) if len(offsets) else 0, np.uint8)  # a frame's slot stays unwritten
    view = memoryview(data)
    stored: list = []
    for i in range(len(offsets) - 1):
        frame = view[int(frames[i]):int(frames[i + 1])]
        a, b = int(offsets[i]), int(offsets[i + 1])
        if i in known:
            stored.append(StoredImage(int(widths[i]), int(heights[i]), int(known[i]), frame=frame,
                                      frame_format=frame_format))
            continue
        pixels[a:b] = np.frombuffer(decompress_frame(frame_format, frame, b - a), np.uint8)
        stored.append(None)
    return _batch_of(record, pixels, stored)


def _digest(record: pa.RecordBatch, image_digests: np.ndarray, arrays: dict[str, np.ndarray] | None = None) -> str:
    """``arrays``: the record's array columns but ``image_pixels`` (``record_arrays``), if at hand."""
    h = xxhash.xxh3_128()
    for name, _ in _SCALAR_COLUMNS:
        h.update(name.encode())
        h.update(repr(record.column(name)[0].as_py()).encode())
    if arrays is None:
        arrays = record_arrays(record)
    for name, _ in _ARRAY_COLUMNS:
        h.update(name.encode())
        if name == "image_pixels":  # the table by its images' digests (``image_digest``)
            a = np.ascontiguousarray(image_digests, dtype="<u8")
            h.update(int(arrays["image_offsets"][-1] if len(arrays["image_offsets"]) else 0).to_bytes(8, "little"))
        else:
            a = arrays[name]
            h.update(len(a).to_bytes(8, "little"))
        h.update(np.ascontiguousarray(a).view(np.uint8).data)
    for name, _ in _ORIGIN_COLUMNS:
        h.update(name.encode())
        h.update(repr(record.column(name)[0].as_py()).encode())
    return h.hexdigest()


def record_digest(record: pa.RecordBatch) -> str:
    """Content digest of a record: independent of compression, file layout and metadata.

    Hashes every column's logical values in schema order (the pixel table decoded), so the same
    packed batch has the same digest whether it was written with zstd level 1, 19, lz4 or no
    compression.  XXH3-128: an integrity and reproducibility check (~30 GB/s, so the loader can
    afford it on every record); each shard file's XXH3-128 is in its stream index.  The decoded
    pixels are handed to a following ``record_to_batch`` of the same record.
    """
    pixels = record_pixels(record)
    digest = _digest(record, image_digests(pixels, record.column("image_offsets").flatten().to_numpy(zero_copy_only=True)))
    if _stored_pixels(record)[0] != "none":
        _decoded.put(record, pixels)
    return digest
