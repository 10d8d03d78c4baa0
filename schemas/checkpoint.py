"""Stream checkpoint format: JSON for the state, an Arrow IPC file for buffered pixels.

``ckpt-NNNNN.json`` is the stream's full state at the start of shard NNNNN::

    {"version": 1, "stream": s, "batches": n, "tokens": t,
     "py_rng": [3, [625 ints], null], "np_rng": {"name": "MT19937", "keys": [624], "pos", ...},
     "sources": [{"cursor": {...}, "passes": p, "yields_this_pass": y}, ...],   # one per group
     "buffer": [sample, ...], "counters": {...}, "refused_in_row": 0}

where a buffered ``sample`` is ``{"plan": [...], "texts": [[ids]], "images": [{"pixels": i,
"norm": [6 floats], "source": {...} | null}], "num_tokens": n, "origin": {...}}`` and ``pixels: i`` indexes row i of
``ckpt-NNNNN.arrow`` (columns ``height``, ``width``, ``pixels: list<uint8>``).  Nothing executable: both
files are plain data, safe to read from an untrusted source.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from schemas.documents import Document

CHECKPOINT_VERSION = 1


@dataclass
class BufferedImage(Document):
    pixels: int  # row of the checkpoint's pixel file
    norm: list[float]  # mean (3) and std (3) of the image's normalisation
    # the picture's identity for the shard's pixel index (schemas.pixel_index.PictureSource):
    # {"content": hex, "decode": ..., "width", "height", "damage": [...]}, or None (a video frame)
    source: dict | None = None


@dataclass
class BufferedSample(Document):
    plan: list[dict]
    texts: list[list[int]]
    images: list[BufferedImage]
    num_tokens: int
    origin: dict


@dataclass
class CheckpointDoc(Document):
    """``ckpt-NNNNN.json``: a stream's full state between two batches (see the module doc)."""

    version: int
    stream: int
    batches: int
    tokens: int
    py_rng: list
    np_rng: dict
    sources: list[dict]
    buffer: list[BufferedSample]
    counters: dict
    refused_in_row: int = 0

_PIXELS_SCHEMA = pa.schema([("height", pa.int32()), ("width", pa.int32()), ("pixels", pa.list_(pa.uint8()))])


def encode_pixels(images: list[np.ndarray]) -> bytes:
    """(h, w, 3) uint8 arrays -> Arrow IPC file bytes (zstd)."""
    flat = [np.ascontiguousarray(a, dtype=np.uint8).reshape(-1) for a in images]
    offsets = np.zeros(len(flat) + 1, np.int32)
    if flat:
        np.cumsum([len(f) for f in flat], out=offsets[1:])
    values = pa.array(np.concatenate(flat) if flat else np.zeros(0, np.uint8), type=pa.uint8())
    table = pa.Table.from_arrays(
        [pa.array([a.shape[0] for a in images], pa.int32()), pa.array([a.shape[1] for a in images], pa.int32()),
         pa.ListArray.from_arrays(pa.array(offsets), values)],
        schema=_PIXELS_SCHEMA,
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, _PIXELS_SCHEMA, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def decode_pixels(data: bytes) -> list[np.ndarray]:
    table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
    if table.schema.remove_metadata() != _PIXELS_SCHEMA:
        raise ValueError("checkpoint pixel file has an unexpected schema")
    hs, ws = table.column("height").to_pylist(), table.column("width").to_pylist()
    col = table.column("pixels").combine_chunks()
    return [col[i].values.to_numpy(zero_copy_only=False).reshape(h, w, 3) for i, (h, w) in enumerate(zip(hs, ws))]
