"""A stream's state before any of its records: its nearest kept checkpoint, then its batches packed again.

``ckpt-k`` is the state at the start of shard k; a trim drops those off the ladder
(``prepack.run.bounded.checkpoint_ladder``).  The state before record n is read from the nearest
checkpoint kept at or before the shard holding n and the batches between are packed again under the
pack's config, their pictures taken from the stream's shards still there (the reuse path) or
decoded.  Every batch packed again must have the digest its index row records, and a state that
ends where a checkpoint was dropped must have that checkpoint's recorded sha256s, so a replay that
would not give the pack back is refused, never continued from.  Used by a continuation
(``prepack.run.chain``), a restore and an audit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prepack.engine.packer import PackerOptions, StreamState
from prepack.engine.packers import open_packer
from prepack.engine.reuse.earlier_pixels import PixelReuse
from prepack.engine.state_codec import detached
from prepack.run.bounded.checkpoint_ladder import nearest_kept
from prepack.run.commit.atomic_files import sha256_hex
from prepack.run.commit.checkpoint_files import checkpoint_digests, read_checkpoint, state_files
from schemas.config import PrepackConfig
from schemas.errors import PackRefused
from schemas.location import PackLocation
from schemas.manifest import StreamIndex, TrimmedShards
from schemas.packed_batch import PackedBatch
from schemas.record import encode_record

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replayed:
    """The state before record ``record`` (stream-local), from ``ckpt-checkpoint`` and ``replayed`` batches."""

    state: StreamState
    record: int
    checkpoint: int
    replayed: int


def shard_of(index: StreamIndex, record: int) -> int:
    """The shard holding stream-local record ``record`` (the number of shards: after the last)."""
    starts = [sh.first_record for sh in index.shards] + [index.num_records]
    return max(i for i, b in enumerate(starts) if b <= record)


@contextmanager
def _packer_from(loc: PackLocation, index: StreamIndex, cfg: PrepackConfig, tokenizer: tuple, state: StreamState):
    """A packer of the stream going on from ``state``, its pictures taken from the stream's shards
    still there (the reuse path), else decoded."""
    pixels = PixelReuse((), frame_format=None)
    pixels.add_stream(loc, index)
    try:
        with open_packer(cfg, index.stream, tokenizer[0], tokenizer[1], state, PackerOptions(pixels=pixels)) as packer:
            yield packer
    finally:
        pixels.close()


def _checked(loc: PackLocation, index: StreamIndex, packer, records: tuple[int, int]) -> "Iterator[tuple[int, PackedBatch]]":
    """``packer``'s batches as the stream's records ``records`` (first, stop), each checked against its
    index row's digest; PackRefused where one differs or the packer ends first."""
    first, stop = records
    at = first
    for batch in packer if at < stop else ():
        if encode_record(batch).digest != index.record(at).digest:
            raise PackRefused(f"{loc.base}: packing stream {index.stream} again does not give its record {at} back "
                              "(the data or the packing code changed since it was packed)")
        yield at, batch
        at += 1
        if at >= stop:
            break
    if at < stop:
        raise PackRefused(f"{loc.base}: packing stream {index.stream} again ended after record {at - 1}, before "
                          f"record {stop - 1}")


def packed_again(loc: PackLocation, index: StreamIndex, cfg: PrepackConfig, tokenizer: tuple,
                 records: tuple[int, int]) -> "Iterator[tuple[int, PackedBatch]]":
    """The stream's records ``records`` (first, stop: stream-local) packed again from the nearest
    checkpoint kept, each checked against its index row's digest: ``(record, batch)``.  For a reader
    of records whose shard was trimmed (a balanced-samples pack's reference)."""
    start = state_at(loc, index, cfg, records[0], tokenizer).state
    with _packer_from(loc, index, cfg, tokenizer, start) as packer:
        yield from _checked(loc, index, packer, records)


def _replay(loc: PackLocation, index: StreamIndex, cfg: PrepackConfig, tokenizer: tuple, start: tuple[int, int],
            todo: int) -> StreamState:
    """Pack ``todo`` batches from ``ckpt-k`` (``start``: k and its first record), each checked against its
    index row; the state after them."""
    k, first = start
    with _packer_from(loc, index, cfg, tokenizer, read_checkpoint(loc, index, k)) as packer:
        for _ in _checked(loc, index, packer, (first, first + todo)):
            pass
        return detached(packer.state())


def state_at(loc: PackLocation, index: StreamIndex, cfg: PrepackConfig, record: int, tokenizer: tuple) -> Replayed:
    """The state of ``index``'s stream before its record ``record`` (stream-local; ``num_records``:
    after the last), under ``cfg`` (the pack's stored config); ``tokenizer``: (tokenizer, special ids)."""
    k = shard_of(index, record)
    dropped = set(TrimmedShards.read(loc, index.stream).checkpoints)
    j = nearest_kept(k, dropped)
    first = index.shards[j].first_record if j < len(index.shards) else index.num_records
    todo = record - first
    if not todo:
        return Replayed(read_checkpoint(loc, index, j), record, j, 0)
    state = _replay(loc, index, cfg, tokenizer, (j, first), todo)
    if k in dropped and record == index.shards[k].first_record:
        text, arrow = state_files(state)
        if (sha256_hex(text), sha256_hex(arrow)) != checkpoint_digests(index, k):
            raise PackRefused(f"{loc.base}: packing stream {index.stream} again from its checkpoint {j} does not give "
                              f"its dropped checkpoint {k} back (its digests differ from the stream index)")
    log.info("stream %d: state before record %d from checkpoint %d, %d batch(es) packed again",
             index.stream, record, j, todo)
    return Replayed(state, record, j, todo)
