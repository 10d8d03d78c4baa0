"""A shard's VAE latents: the frozen encoder's moments of each record's VAE canvas (issue 51).

Why: training encodes every batch's VAE pictures with a frozen encoder on every rank, every
micro-batch and every pass; a pack fixes each batch's padded canvas, so the encoder's output is
fixed too and can be computed once, at pack time, on other GPUs.  What is stored is the
encoder's *moments* (``encoder(padded_images)``: mean and log-variance, ``2 * z_channels``
channels at 1/8 of the canvas), each VAE image cropped to the latent rows the model reads of it
(``2 * vae_latent_shapes``: BAGEL patchifies ``latent[:, :2h, :2w]``); the random draw from them,
and the scale and shift, happen at training time on the device (``loader.latents``).

Layout (``schemas.layout``): beside shard k of a stream,

- ``shard-k.latents.arrow``: an Arrow IPC file with one record batch per packed record, in
  record order; one row per VAE image use of that record (``vae_image_ids`` order): its crop's
  ``height`` and ``width`` and its ``moments``, the raw bytes of a C-ordered
  ``[2 * z_channels, height, width]`` array of ``dtype`` (bfloat16 as its 16 bits).  The schema's
  metadata holds ``LatentsInfo`` (how the moments were made) and the digests of the shard's
  records, so a file can be checked against the shard it belongs to.
- the stream's ``latents.json`` (``StreamLatents``): one entry per shard whose latents are
  written, with the file's size and XXH3-128: the commit marker of a shard's latents, what
  ``verify`` checks and a trim removes with the shard.

The pixel records are untouched, so parity, audit, reuse, continuation and balancing hold as
they were.  numpy and pyarrow only: the loader reads these.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import xxhash

from schemas.documents import Document
from schemas.errors import DamagedFile

LATENTS_VERSION = 1
# the moments' dtypes: numpy dtype of their stored bytes (bfloat16 kept as its raw 16 bits)
MOMENT_DTYPES = {"float32": np.dtype("<f4"), "bfloat16": np.dtype("<u2")}
LATENT_CROP = 2  # BAGEL's latent patch: an image's latent rows are 2 x its vae_latent_shapes
_INFO_KEY = b"latents_info"
_RECORDS_KEY = b"record_digests"
_SHARD_KEY = b"shard_digest"
_VERSION_KEY = b"latents_version"
SCHEMA = pa.schema([("height", pa.int32()), ("width", pa.int32()), ("moments", pa.large_binary())])


@dataclass(frozen=True)
class LatentsInfo:
    """How a shard's moments were made: what training must match to use them."""

    encoder: str  # the training stack's encoder module, e.g. "nemo_automodel 0.7.0"
    weights: str  # XXH3-128 of the VAE weights file
    device: str  # e.g. "cpu", "NVIDIA H200"
    device_type: str  # torch's: "cpu" or "cuda"
    dtype: str  # of the stored moments: MOMENT_DTYPES
    autocast: str  # the autocast the encoder ran under: "bfloat16" (the recipe's, on a GPU) or "none"
    z_channels: int
    scale_factor: float
    shift_factor: float

    def __post_init__(self) -> None:
        if self.dtype not in MOMENT_DTYPES:
            raise DamagedFile(f"latents: moments of dtype {self.dtype!r} (known: {', '.join(MOMENT_DTYPES)})")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: "str | bytes", where: str) -> "LatentsInfo":
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError) as e:
            raise DamagedFile(f"{where}: damaged latents info ({e})") from None


def crop_shape(latent_shape) -> tuple[int, int]:
    """The latent rows BAGEL reads of one VAE image of ``vae_latent_shapes`` entry (h, w)."""
    h, w = (int(v) for v in latent_shape)
    return LATENT_CROP * h, LATENT_CROP * w


def encode_latents(per_record: "list[list[np.ndarray]]", info: LatentsInfo, shard_digest: str,
                   record_digests: "list[str]") -> bytes:
    """The bytes of a shard's latents file: ``per_record[j]`` is record j's moments, one array
    ``[2 * z_channels, h, w]`` of ``MOMENT_DTYPES[info.dtype]`` per VAE image use."""
    if len(per_record) != len(record_digests):
        raise ValueError(f"{len(per_record)} records' moments for {len(record_digests)} records")
    want = MOMENT_DTYPES[info.dtype]
    meta = {_VERSION_KEY: str(LATENTS_VERSION).encode(), _INFO_KEY: info.to_json().encode(),
            _SHARD_KEY: shard_digest.encode(), _RECORDS_KEY: json.dumps(list(record_digests)).encode()}
    schema = SCHEMA.with_metadata(meta)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        for moments in per_record:
            for m in moments:
                if m.dtype != want or m.ndim != 3 or m.shape[0] != 2 * info.z_channels:
                    raise ValueError(f"moments of shape {m.shape} and dtype {m.dtype}: expected "
                                     f"[{2 * info.z_channels}, h, w] of {want}")
            writer.write_batch(pa.record_batch(
                [pa.array([m.shape[1] for m in moments], pa.int32()), pa.array([m.shape[2] for m in moments], pa.int32()),
                 pa.array([np.ascontiguousarray(m).tobytes() for m in moments], pa.large_binary())], schema=schema))
    return sink.getvalue().to_pybytes()


def file_digest(data: "bytes | memoryview") -> str:
    """A latents file's digest (what ``StreamLatents`` records and ``verify`` checks)."""
    return xxhash.xxh3_128(data).hexdigest()


class LatentsFile:
    """One shard's latents, read: ``info``, the shard's and its records' digests, and record j's
    moments (``moments(j)``: one array ``[2 * z_channels, h, w]`` per VAE image use)."""

    def __init__(self, data: "bytes | pa.Buffer", where: str):
        self.where = where
        try:
            self._reader = pa.ipc.open_file(pa.py_buffer(data) if isinstance(data, bytes) else data)
            meta = self._reader.schema.metadata or {}
            version = int(meta.get(_VERSION_KEY, b"0"))
        except (pa.ArrowInvalid, ValueError, OSError) as e:
            raise DamagedFile(f"{where}: not a latents file ({e})") from None
        if version != LATENTS_VERSION:
            raise DamagedFile(f"{where}: latents version {version}, this reader reads {LATENTS_VERSION}")
        self.info = LatentsInfo.from_json(meta.get(_INFO_KEY, b""), where)
        self.shard_digest = meta.get(_SHARD_KEY, b"").decode()
        try:
            self.record_digests = [str(d) for d in json.loads(meta.get(_RECORDS_KEY, b"[]"))]
        except ValueError:
            raise DamagedFile(f"{where}: damaged record digests") from None
        if self._reader.num_record_batches != len(self.record_digests):
            raise DamagedFile(f"{where}: {self._reader.num_record_batches} records' latents for "
                              f"{len(self.record_digests)} records")

    def __len__(self) -> int:
        return len(self.record_digests)

    def moments(self, j: int) -> "list[np.ndarray]":
        """Record j's moments (zero-copy views of the file's buffer)."""
        batch = self._reader.get_batch(j)
        dtype, c = MOMENT_DTYPES[self.info.dtype], 2 * self.info.z_channels
        heights, widths = batch.column(0).to_pylist(), batch.column(1).to_pylist()
        column = batch.column(2)
        out = []
        for k, (h, w) in enumerate(zip(heights, widths)):
            raw = column[k].as_buffer()
            if raw.size != c * h * w * dtype.itemsize:
                raise DamagedFile(f"{self.where}: record {j} image {k}: {raw.size} bytes of moments for "
                                  f"[{c}, {h}, {w}] {self.info.dtype}")
            out.append(np.frombuffer(raw, dtype).reshape(c, h, w))
        return out


@dataclass
class ShardLatents(Document):
    """One shard's entry in its stream's ``latents.json``: the file and what made it."""

    shard: int
    size: int
    digest: str  # ``file_digest`` of the file
    records: int
    images: int
    device: str
    dtype: str


@dataclass
class StreamLatents(Document):
    """A stream's ``latents.json``: the shards whose latents are written (the commit marker of each)."""

    stream: int
    encoder: str
    weights: str
    shards: list[ShardLatents] = field(default_factory=list)
    version: int = LATENTS_VERSION

    def get(self, shard: int) -> "ShardLatents | None":
        for entry in self.shards:
            if entry.shard == shard:
                return entry
        return None

    def with_shard(self, entry: ShardLatents) -> "StreamLatents":
        """This listing with ``entry`` in place of any entry of its shard, in shard order."""
        kept = [e for e in self.shards if e.shard != entry.shard]
        return StreamLatents(self.stream, self.encoder, self.weights,
                             sorted(kept + [entry], key=lambda e: e.shard), self.version)

    def without(self, shards: "set[int]") -> "StreamLatents":
        return StreamLatents(self.stream, self.encoder, self.weights,
                             [e for e in self.shards if e.shard not in shards], self.version)
