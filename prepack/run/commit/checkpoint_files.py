"""A stream's checkpoint files, ``ckpt-k.json`` + ``ckpt-k.arrow``: written and read here only.

``ckpt-k`` is the stream's full state at the start of shard k (``ckpt-00000`` before its first
batch): what a resumed stream starts from and what an audit re-packs a shard from.  Its content
is ``schemas.checkpoint`` (the format) and ``prepack.engine.state_codec`` (``StreamState`` to and
from that format); its sha256s are recorded in the stream index (``ckpt-00000``'s in the index's
metadata, the others in the row of the shard they end), so every read is checked against them.
"""

from __future__ import annotations

from prepack.engine.state_codec import state_from_payload, state_to_payload
from prepack.engine.packer import StreamState
from prepack.run.commit.atomic_files import sha256_hex, write_bytes_atomic
from schemas.checkpoint import CheckpointDoc
from schemas.errors import DamagedFile
from schemas.layout import checkpoint_file
from schemas.location import PackLocation
from schemas.manifest import StreamIndex


def state_files(state: StreamState) -> tuple[bytes, bytes]:
    """A packer's state as the (json, arrow) bytes of a checkpoint."""
    doc, pixels = state_to_payload(state)
    return doc.to_json().encode(), pixels


def write_checkpoint(loc: PackLocation, stream: int, shard: int, files: tuple[bytes, bytes]) -> tuple[str, str]:
    """Write ``ckpt-shard`` (arrow first: the json names a complete state); the sha256 of (json, arrow)."""
    text, pixels = files
    write_bytes_atomic(loc, checkpoint_file(stream, shard, "arrow"), pixels)
    write_bytes_atomic(loc, checkpoint_file(stream, shard, "json"), text)
    return sha256_hex(text), sha256_hex(pixels)


def checkpoint_digests(index: StreamIndex, shard: int) -> tuple[str, str]:
    """The recorded sha256 of ``ckpt-shard`` (json, arrow): the start checkpoint or a shard's end."""
    if shard == 0:
        return index.ckpt0_json_sha256, index.ckpt0_arrow_sha256
    row = index.shards[shard - 1]
    return row.ckpt_json_sha256, row.ckpt_arrow_sha256


def read_checkpoint_files(loc: PackLocation, index: StreamIndex, shard: int) -> tuple[bytes, bytes]:
    """The (json, arrow) bytes of ``ckpt-shard``, each checked against the digest the index recorded."""
    out = []
    for ext, sha in zip(("json", "arrow"), checkpoint_digests(index, shard)):
        rel = checkpoint_file(index.stream, shard, ext)
        try:
            data = loc.read_bytes(rel)
        except FileNotFoundError:
            raise DamagedFile(f"{loc.path(rel)}: checkpoint is missing") from None
        if sha256_hex(data) != sha:
            raise DamagedFile(f"{loc.path(rel)}: checkpoint is damaged (sha256 differs from the stream index)")
        out.append(data)
    return out[0], out[1]


def read_checkpoint(loc: PackLocation, index: StreamIndex, shard: int) -> StreamState:
    """Load ``ckpt-shard`` after checking both files against the digests the index recorded."""
    text, pixels = read_checkpoint_files(loc, index, shard)
    where = loc.path(checkpoint_file(index.stream, shard))
    try:
        return state_from_payload(CheckpointDoc.from_json(text, where), pixels)
    except DamagedFile:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedFile(f"{where}: checkpoint does not load ({e})") from None
