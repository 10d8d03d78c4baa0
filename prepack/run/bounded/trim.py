"""Trimming a pack behind training: a trimmed shard's records file goes, its index row stays.

A shard's records file is most of a pack's bytes, and a cache of its checkpoint: ``ckpt-k`` and
the pack's config re-pack shard k exactly (that is what ``audit`` checks).  So once every training
reading the pack has checkpointed past a shard (its position in the oldest checkpoint it keeps is
beyond the shard's last record), the file can go: ``trim`` lists the shard in the stream's
``trimmed.json`` first, then deletes ``shard-k.arrow`` (and its VAE latents); the index row (sizes,
digests), the pixel index and the lineage stay, and so do the checkpoints on the ladder
(``prepack.run.bounded.checkpoint_ladder``; ``drop_checkpoints`` deletes the others, listed first).
``prepack.run.bounded.restore`` packs a trimmed shard again.  Which shards may go is
``prepack.run.bounded.trim_policy``'s to say.
"""

from __future__ import annotations

import logging

from loader.reader import Pack
from loader.state import positions_in, read_state_file
from prepack.run.commit.atomic_files import write_bytes_atomic
from schemas.errors import PackRefused, UsageError
from prepack.run.bounded.checkpoint_ladder import to_drop
from schemas.layout import checkpoint_file, shard_file, shard_latents_file, trimmed_file
from schemas.location import PackLocation
from schemas.manifest import ShardEntry, TrimmedShards

log = logging.getLogger(__name__)


def positions_of(pack: Pack, states: "list[dict | list]") -> dict[int, int]:
    """Per stream, the earliest next record of the loader states given (``loader.state.positions_in``;
    several trainings, or the oldest checkpoint each keeps): nothing at or after it may be trimmed."""
    try:
        return positions_in(pack, states)
    except (KeyError, TypeError, ValueError) as e:
        raise PackRefused(f"--state: {e}; nothing was trimmed or restored") from None


def read_states(paths: "list[str]") -> list:
    """The loader states in ``paths`` (``--state``: saved training checkpoints' loader states)."""
    try:
        return [read_state_file(p) for p in paths]
    except ValueError as e:
        raise UsageError(f"--state {e}") from None


def write_trimmed(loc: PackLocation, stream: int, shards: "set[int]", checkpoints: "set[int]") -> None:
    doc = TrimmedShards(stream, sorted(shards), sorted(checkpoints))
    write_bytes_atomic(loc, trimmed_file(stream), doc.to_json().encode())


def trim_shards(pack: Pack, stream: int, shards: "list[ShardEntry]") -> int:
    """Delete the records files of ``shards`` of ``stream``, listed in ``trimmed.json`` first (a listed
    file may be absent; an unlisted one never is); the bytes freed.  Which shards may go is the trim
    policy's to say (``prepack.run.bounded.trim_policy``)."""
    loc = pack.location
    listed = TrimmedShards.read(loc, stream)
    write_trimmed(loc, stream, set(listed.shards) | {sh.shard for sh in shards}, set(listed.checkpoints))
    freed = 0
    for sh in shards:
        try:
            loc.fs.delete_file(loc.path(shard_file(stream, sh.shard)))
            freed += sh.nbytes
        except FileNotFoundError:
            pass
        try:  # its VAE latents go with it (the stream's latents.json keeps what restore makes again)
            path = loc.path(shard_latents_file(stream, sh.shard))
            size = loc.fs.get_file_info(path).size
            loc.fs.delete_file(path)
            freed += size or 0
        except FileNotFoundError:
            pass
    return freed


def drop_checkpoints(pack: Pack, stream: int) -> tuple[int, int]:
    """Delete the checkpoints of ``stream``'s trimmed shards that are off the ladder
    (``prepack.run.bounded.checkpoint_ladder``), listed in ``trimmed.json`` first; how many, and the
    bytes freed."""
    loc = pack.location
    listed = TrimmedShards.read(loc, stream)
    head = len(pack.index(stream).shards)
    drop = to_drop(head, listed.shards, listed.checkpoints)
    if not drop:
        return 0, 0
    write_trimmed(loc, stream, set(listed.shards), set(listed.checkpoints) | set(drop))
    freed = 0
    for k in drop:
        for ext in ("arrow", "json"):
            path = loc.path(checkpoint_file(stream, k, ext))
            try:
                size = loc.fs.get_file_info(path).size
                loc.fs.delete_file(path)
                freed += size or 0
            except FileNotFoundError:
                pass
    log.debug("stream %d: dropped checkpoints %s (off the ladder behind the trainings)", stream, drop)
    return len(drop), freed
