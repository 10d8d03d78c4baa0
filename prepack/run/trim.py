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
from dataclasses import dataclass, field

from loader.reader import Pack
from loader.state import positions_in
from prepack.engine.schedule import open_packer
from prepack.engine.reuse.earlier_pixels import PixelReuse
from prepack.run.atomic_files import write_bytes_atomic
from prepack.run.checkpoints import read_checkpoint
from prepack.run.writer import StreamWriter
from schemas.compression import Compression
from schemas.errors import DamagedFile, PackRefused, UsageError
from schemas.layout import shard_file, trimmed_file
from schemas.location import PackLocation
from schemas.manifest import ShardEntry, StreamIndex, TrimmedShards

log = logging.getLogger(__name__)


@dataclass
class TrimResult:
    shards: dict[int, list[int]] = field(default_factory=dict)  # stream -> shards trimmed now
    freed_bytes: int = 0

    def lines(self) -> list[str]:
        n = sum(len(v) for v in self.shards.values())
        if not n:
            return ["nothing to trim: no shard lies wholly behind the positions given"]
        return [f"trimmed {n} shard(s) of {len(self.shards)} stream(s), {self.freed_bytes / 2**20:,.1f} MiB freed "
                "(indexes, digests and checkpoints kept: prepack restore packs them again)"]


def positions_of(pack: Pack, states: "list[dict | list]") -> dict[int, int]:
    """Per stream, the earliest next record of the loader states given (``loader.state.positions_in``;
    several trainings, or the oldest checkpoint each keeps): nothing at or after it may be trimmed."""
    try:
        return positions_in(pack, states)
    except (KeyError, TypeError, ValueError) as e:
        raise PackRefused(f"--state: {e}; nothing was trimmed or restored") from None


def _write_trimmed(loc: PackLocation, stream: int, shards: "set[int]") -> None:
    write_bytes_atomic(loc, trimmed_file(stream), TrimmedShards(stream, sorted(shards)).to_json().encode())


def trim_stream(pack: Pack, stream: int, before: int) -> tuple[list[int], int]:
    """Trim the shards of ``stream`` whose records all lie before chain record ``before``; returns
    (shards trimmed now, bytes freed)."""
    loc, n = pack.location, pack.switch(stream)
    index = pack.index(stream, refresh=True)
    listed = set(TrimmedShards.read(loc, stream).shards)
    behind = [sh for sh in index.shards if n + sh.first_record + len(sh.records) <= before and sh.shard not in listed]
    if not behind:
        return [], 0
    _write_trimmed(loc, stream, listed | {sh.shard for sh in behind})  # first: a listed file may be absent
    freed = 0
    for sh in behind:
        try:
            loc.fs.delete_file(loc.path(shard_file(stream, sh.shard)))
            freed += sh.nbytes
        except FileNotFoundError:
            pass
    return [sh.shard for sh in behind], freed


def trim_pack(out, states: "list[dict | list]") -> TrimResult:
    """Trim every shard wholly behind the positions of ``states`` (``positions_of``)."""
    pack = Pack.open(out)
    result = TrimResult()
    for stream, before in sorted(positions_of(pack, states).items()):
        shards, freed = trim_stream(pack, stream, before)
        if shards:
            result.shards[stream] = shards
            result.freed_bytes += freed
        pack.forget(stream)
    return result


def trim_to_progress(out, folders: "list[str]", keep: int) -> TrimResult:
    """Trim every shard behind the ``keep`` newest checkpoints the trainings publishing to ``folders``
    kept (``prepack.run.ahead.Bound.trim_before``); a stream some training has not checkpointed
    ``keep`` times yet is left whole."""
    from prepack.run.ahead import Bound, BoundSpec

    pack = Pack.open(out)
    bound = Bound(BoundSpec(None, tuple(folders), keep), pack)
    bound.refresh(force=True)
    result = TrimResult()
    for stream in range(pack.num_streams):
        before = bound.trim_before(stream)
        if before:
            shards, freed = trim_stream(pack, stream, before)
            if shards:
                result.shards[stream] = shards
                result.freed_bytes += freed
        pack.forget(stream)
    return result


def _restore_shard(pack: Pack, index: StreamIndex, shard: ShardEntry, tokenizer, special, cfg) -> None:
    """Pack ``shard`` again from its checkpoint into its file; DamagedFile (and no file) unless it is
    byte for byte the one the index recorded."""
    loc, stream = pack.location, index.stream
    compression = Compression.parse(cfg.prepack.compression)
    pixels = PixelReuse((), frame_format=compression.frame_format)
    pixels.add_stream(loc, index)  # the stream's shards still there may hold the same pictures
    try:
        with open_packer(cfg, stream, tokenizer, special, state=read_checkpoint(loc, index, shard.shard),
                          reuse_pixel_table=True, pixels=pixels) as packer, \
                StreamWriter(loc, stream, shard_bytes=2**62, compression=cfg.prepack.compression,
                             metadata=pack.info.shard_metadata(), start_shard=shard.shard,
                             start_record=shard.first_record) as writer:
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


def restore(out, spans: dict[int, tuple[int, int | None]], tokenizer=None) -> dict[int, list[int]]:
    """Pack again the trimmed shards holding any record of ``spans`` (stream -> (first, last) chain
    records, last None: to the end); returns the shards restored per stream."""
    from prepack.engine.tokenizer import load_tokenizer, special_token_ids

    pack = Pack.open(out)
    cfg = pack.info.stored_config()
    if cfg.content_hash() != pack.info.config_hash:
        raise DamagedFile(f"{pack.location.base}: the stored config does not hash to its config_hash; not restoring")
    done: dict[int, list[int]] = {}
    for stream, (first, last) in sorted(spans.items()):
        pack.check_stream(stream)
        n = pack.switch(stream)
        index = pack.index(stream, refresh=True)
        listed = set(TrimmedShards.read(pack.location, stream).shards)
        wanted = [sh for sh in index.shards if sh.shard in listed
                  and n + sh.first_record + len(sh.records) > first and (last is None or n + sh.first_record <= last)]
        for sh in wanted:
            if tokenizer is None:
                tokenizer = special_token_ids(load_tokenizer(cfg.tokenizer))
            log.info("restoring %s from its checkpoint", shard_file(stream, sh.shard))
            _restore_shard(pack, index, sh, tokenizer[0], tokenizer[1], cfg)
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
