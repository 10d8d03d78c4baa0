"""Trimming a pack behind training, and restoring what was trimmed byte for byte.

A shard's records file is most of a pack's bytes, and a cache of its checkpoint: ``ckpt-k`` and
the pack's config re-pack shard k exactly (that is what ``audit`` checks).  So once every training
reading the pack has checkpointed past a shard (its position in the oldest checkpoint it keeps is
beyond the shard's last record), the file can go: ``trim`` lists the shard in the stream's
``trimmed.json`` first, then deletes ``shard-k.arrow``; the index row (sizes, digests), the
checkpoints, the pixel index and the lineage stay.  ``restore`` packs a trimmed shard again from
its checkpoint, checks the file against the size and XXH3-128 its index row recorded, and only
then takes it off the list.  A crash at any point leaves a listed shard whose file is either
absent or complete and checked; readers read a file that is there, and name the restore command
for one that is not (``loader.reader``).  One trim or restore at a time per pack.
"""

from __future__ import annotations

import logging

from loader.reader import Pack
from loader.state import positions_in, read_state_file  # noqa: F401  (read_state_file: for trim_command)
from prepack.engine.packer import PackerOptions
from prepack.engine.packers import open_packer
from prepack.engine.tokenizer import load_tokenizer, special_token_ids, tokenizer_fingerprint
from prepack.engine.reuse.earlier_pixels import PixelReuse
from prepack.run.atomic_files import write_bytes_atomic
from prepack.run.checkpoint_files import read_checkpoint
from prepack.run.latents import LatentsRestore
from prepack.run.restorable import RestoreCheck
from prepack.run.writer import ShardFormat, StreamWriter
from schemas.compression import Compression
from schemas.errors import DamagedFile, PackRefused, UsageError
from schemas.layout import shard_file, shard_latents_file, trimmed_file
from schemas.location import PackLocation
from schemas.manifest import ShardEntry, StreamIndex, TrimmedShards

log = logging.getLogger(__name__)


def positions_of(pack: Pack, states: "list[dict | list]") -> dict[int, int]:
    """Per stream, the earliest next record of the loader states given (``loader.state.positions_in``;
    several trainings, or the oldest checkpoint each keeps): nothing at or after it may be trimmed."""
    try:
        return positions_in(pack, states)
    except (KeyError, TypeError, ValueError) as e:
        raise PackRefused(f"--state: {e}; nothing was trimmed or restored") from None


def _write_trimmed(loc: PackLocation, stream: int, shards: "set[int]") -> None:
    write_bytes_atomic(loc, trimmed_file(stream), TrimmedShards(stream, sorted(shards)).to_json().encode())


def trim_shards(pack: Pack, stream: int, shards: "list[ShardEntry]") -> int:
    """Delete the records files of ``shards`` of ``stream``, listed in ``trimmed.json`` first (a listed
    file may be absent; an unlisted one never is); the bytes freed.  Which shards may go is the trim
    policy's to say (``prepack.run.trim_policy``)."""
    loc = pack.location
    listed = set(TrimmedShards.read(loc, stream).shards)
    _write_trimmed(loc, stream, listed | {sh.shard for sh in shards})
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


def _restore_shard(pack: Pack, index: StreamIndex, shard: ShardEntry, tokenizer, special, cfg) -> None:
    """Pack ``shard`` again from its checkpoint into its file; DamagedFile (and no file) unless it is
    byte for byte the one the index recorded."""
    loc, stream = pack.location, index.stream
    compression = Compression.parse(cfg.prepack.compression)
    pixels = PixelReuse((), frame_format=compression.frame_format)
    pixels.add_stream(loc, index)  # the stream's shards still there may hold the same pictures
    try:
        with open_packer(cfg, stream, tokenizer, special, read_checkpoint(loc, index, shard.shard),
                         PackerOptions(reuse_pixel_table=True, pixels=pixels)) as packer, \
                StreamWriter(loc, stream, ShardFormat(2**62, cfg.prepack.compression, pack.info.shard_metadata()),
                             start=(shard.shard, shard.first_record)) as writer:
            made = 0
            for batch in packer:
                writer.append(batch)
                made += 1
                if made == len(shard.records):
                    break
            entry = writer.finish()
    finally:
        pixels.close()
    if entry is None or (entry.nbytes, entry.xxh3) != (shard.nbytes, shard.xxh3) or made != len(shard.records):
        try:
            loc.fs.delete_file(loc.path(shard_file(stream, shard.shard)))
        except FileNotFoundError:
            pass
        raise DamagedFile(f"{loc.path(shard_file(stream, shard.shard))}: packed again from its checkpoint, it is not "
                          "the file the index recorded (the data or the packing code changed); not restored")


def restore(out, spans: dict[int, tuple[int, int | None]], tokenizer=None,
            latents: "LatentsRestore | None" = None) -> dict[int, list[int]]:
    """Pack again the trimmed shards holding any record of ``spans`` (stream -> (first, last) chain
    records, last None: to the end), and encode again the VAE latents those shards had
    (``latents``: the weights; refused before any work without them); returns the shards restored
    per stream."""
    latents = latents or LatentsRestore(None)
    pack = Pack.open(out)
    cfg = pack.info.stored_config()
    if cfg.content_hash() != pack.info.config_hash:
        raise DamagedFile(f"{pack.location.base}: the stored config does not hash to its config_hash; not restoring")
    wanted: dict[int, list[ShardEntry]] = {}
    for stream, (first, last) in sorted(spans.items()):
        pack.check_stream(stream)
        n = pack.switch(stream)
        index = pack.index(stream, refresh=True)
        listed = set(TrimmedShards.read(pack.location, stream).shards)
        wanted[stream] = [sh for sh in index.shards if sh.shard in listed and n + sh.first_record + len(sh.records)
                          > first and (last is None or n + sh.first_record <= last)]
    if any(wanted.values()) and tokenizer is None:
        tokenizer = special_token_ids(load_tokenizer(cfg.tokenizer))
    check = RestoreCheck(pack, tokenizer_fingerprint(tokenizer[0]) if tokenizer is not None else None)
    for stream, shards in wanted.items():  # every shard asked for, before any work
        for sh in shards:
            why = check.why_not(stream, sh.shard) or latents.why_not(pack, stream, sh.shard)
            if why is not None:
                raise PackRefused(f"{pack.location.path(shard_file(stream, sh.shard))}: cannot be restored: {why}; "
                                  "nothing was restored")
    done: dict[int, list[int]] = {}
    for stream, shards in wanted.items():
        index = pack.index(stream)
        listed = set(TrimmedShards.read(pack.location, stream).shards)
        for sh in shards:
            log.info("restoring %s from its checkpoint", shard_file(stream, sh.shard))
            _restore_shard(pack, index, sh, tokenizer[0], tokenizer[1], cfg)
            latents.encode(pack, stream, sh)
            listed.discard(sh.shard)
            _write_trimmed(pack.location, stream, listed)  # after the checked file is in place
            done.setdefault(stream, []).append(sh.shard)
    return done


def spans_of_state(pack: Pack, state: "dict | list") -> dict[int, tuple[int, None]]:
    """What a loader state will read: each stream from its position on."""
    return {s: (p, None) for s, p in positions_of(pack, [state]).items()}


def parse_records(text: str) -> tuple[int, int | None]:
    """``--records A-B`` (inclusive), ``A-`` (to the end) or ``A``."""
    lo, sep, hi = text.partition("-")
    try:
        first = int(lo)
        last = (int(hi) if hi else None) if sep else first
    except ValueError:
        raise UsageError(f"--records takes A-B, A- or A (chain record numbers), got {text!r}") from None
    if first < 0 or (last is not None and last < first):
        raise UsageError(f"--records {text}: not a range of records")
    return first, last
