"""Crash recovery of one stream: back to its committed prefix (the commit is ``prepack.run.commit.writer``).

A shard exists exactly when the stream index lists it; anything after the last listed shard is a
leftover of a crash and is deleted, except ``ckpt-next``: the state the stream resumes from.
"""

from __future__ import annotations

import logging
import os

import pyarrow.fs as pafs

from schemas.errors import DamagedFile
from schemas.layout import CHECKPOINT_FILES, SHARD_FILES, is_temporary, parse, shard_file, stream_dir
from schemas.location import PackLocation, resolve_location
from schemas.manifest import StreamIndex, TrimmedShards

log = logging.getLogger(__name__)


def recover_stream(
    out: "str | os.PathLike | PackLocation", stream: int, filesystem: pafs.FileSystem | None = None
) -> StreamIndex:
    """Bring a stream's directory back to its committed prefix after a crash; return its index.

    Committed shards are the rows of ``index.arrow``.  Deleted: every temporary file, shard files
    (records, pixel index, lineage) numbered at or beyond the next shard, and checkpoints beyond it
    (``ckpt-next`` is the state to resume from, so it stays).  A committed shard file that is
    missing (and not trimmed) or has the wrong size is damage a restart must not paper over:
    ``DamagedFile``.
    """
    loc = resolve_location(out, filesystem)
    sdir = loc.path(stream_dir(stream))
    infos = loc.list(stream_dir(stream))
    sizes = {i.base_name: i.size for i in infos if i.type == pafs.FileType.File}
    index = StreamIndex.read(loc, stream) or StreamIndex(stream, [])
    trimmed = set(TrimmedShards.read(loc, stream).shards)
    for entry in index.shards:
        name = shard_file(stream, entry.shard).rsplit("/", 1)[1]
        if name not in sizes and entry.shard in trimmed:
            continue  # its records file was trimmed on purpose (prepack trim); prepack restore brings it back
        if sizes.get(name) != entry.nbytes:
            raise DamagedFile(f"{sdir}/{name}: committed shard file missing or not {entry.nbytes} bytes")
    next_shard = len(index.shards)
    for name in sorted(sizes):
        f = parse(f"{stream_dir(stream)}/{name}")
        stale = is_temporary(name)
        stale |= f is not None and f.kind in SHARD_FILES and f.shard >= next_shard
        stale |= f is not None and f.kind in CHECKPOINT_FILES and f.shard > next_shard
        if stale:
            log.warning("stream %d: removing crash leftover %s", stream, name)
            loc.fs.delete_file(f"{sdir}/{name}")
    return index
