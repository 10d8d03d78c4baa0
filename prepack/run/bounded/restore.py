"""Restoring trimmed shards byte for byte (``prepack restore``).

``restore`` packs a trimmed shard again from its checkpoint, or from the nearest one a trim kept
before it (``prepack.run.bounded.replay``; ``prepack.run.bounded.trim`` deleted its records file and
maybe its checkpoint: its index row, pixel index and lineage stay), checks the file against
the size and XXH3-128 its index row recorded, writes back its checkpoint where a trim dropped it, encodes its VAE latents again when it had them
(``prepack.run.latents.stage.LatentsRestore``), and only then takes it off the stream's ``trimmed.json``.
Everything asked for is checked before any work (its sources and tokenizer as packed:
``prepack.run.bounded.restorable``; the latents' weights and device), so a refusal writes nothing.  A
crash at any point leaves a listed shard whose file is either absent or complete and checked;
readers read a file that is there, and name the restore command for one that is not
(``loader.reader``).  One trim or restore at a time per pack.
"""

from __future__ import annotations

import logging

from loader.reader import Pack
from loader.state import read_state_file
from prepack.engine.packer import PackerOptions, StreamState
from prepack.engine.packers import open_packer
from prepack.engine.state_codec import detached
from prepack.engine.reuse.earlier_pixels import PixelReuse
from prepack.engine.tokenizer import load_tokenizer, special_token_ids, tokenizer_fingerprint
from prepack.run.bounded.replay import state_at
from prepack.run.commit.atomic_files import sha256_hex
from prepack.run.commit.checkpoint_files import checkpoint_digests, state_files, write_checkpoint
from prepack.run.latents.stage import LatentsRestore
from prepack.run.reference_pack import balances_samples, open_reference
from prepack.run.sample_balance import balanced_records
from prepack.run.bounded.restorable import RestoreCheck
from prepack.run.bounded.trim import positions_of, write_trimmed
from prepack.run.commit.writer import ShardFormat, StreamWriter
from schemas.compression import Compression
from schemas.cost import CostModel
from schemas.errors import DamagedFile, PackRefused, UsageError
from schemas.layout import checkpoint_file, shard_file
from schemas.manifest import ShardEntry, StreamIndex, TrimmedShards
from schemas.streams import step_class

log = logging.getLogger(__name__)


def _restore_shard(pack: Pack, index: StreamIndex, shard: ShardEntry, cfg, tokenizer: tuple,
                   start: StreamState) -> StreamState:
    """Pack ``shard`` again from ``start`` (the state at its first record) into its file; the state
    after it.  DamagedFile (and no file) unless it is byte for byte the one the index recorded."""
    loc, stream = pack.location, index.stream
    tokenizer, special = tokenizer
    compression = Compression.parse(cfg.prepack.compression)
    pixels = PixelReuse((), frame_format=compression.frame_format)
    pixels.add_stream(loc, index)  # the stream's shards still there may hold the same pictures
    try:
        with open_packer(cfg, stream, tokenizer, special, start,
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
            end = detached(packer.state())
    finally:
        pixels.close()
    _check_restored(loc, stream, shard, entry if made == len(shard.records) else None)
    return end


def _restore_balanced_shard(pack: Pack, index: StreamIndex, shard: ShardEntry, cfg, tokenizer: tuple) -> None:
    """Re-split ``shard`` of a balanced-samples pack from its reference's steps (its trimmed reference
    shards packed again from their checkpoints: ``sample_balance.reference_batches``) into its file.
    DamagedFile (and no file) unless it is byte for byte the one the index recorded."""
    loc, stream = pack.location, index.stream
    first = pack.switch(stream) + shard.first_record
    streams = step_class(stream, cfg.world_size, cfg.num_workers)
    step = balanced_records(open_reference(pack), streams, CostModel.of(cfg), first, tokenizer,
                            first + len(shard.records))
    entry = None
    with StreamWriter(loc, stream, ShardFormat(2**62, cfg.prepack.compression, pack.info.shard_metadata()),
                      start=(shard.shard, shard.first_record)) as writer:
        made = 0
        while (got := step()) is not None:
            writer.append(got[1][stream])
            made += 1
        if made == len(shard.records):
            entry = writer.finish()
    _check_restored(loc, stream, shard, entry, "re-split from its reference's steps")


def _check_restored(loc, stream: int, shard: ShardEntry, entry: "ShardEntry | None",
                    how: str = "packed again from its checkpoint") -> None:
    """Delete the file made again and raise DamagedFile unless it is the one the index recorded."""
    if entry is None or (entry.nbytes, entry.xxh3) != (shard.nbytes, shard.xxh3):
        try:
            loc.fs.delete_file(loc.path(shard_file(stream, shard.shard)))
        except FileNotFoundError:
            pass
        raise DamagedFile(f"{loc.path(shard_file(stream, shard.shard))}: {how}, it is not "
                          "the file the index recorded (the data or the packing code changed); not restored")


def _put_back(pack: Pack, index: StreamIndex, shard: int, state: StreamState) -> bool:
    """Write ``ckpt-shard`` again from ``state`` when it has the digests the index recorded."""
    files = state_files(state)
    if tuple(sha256_hex(b) for b in files) != checkpoint_digests(index, shard):
        log.warning("%s: the state a restore made is not the checkpoint a trim dropped; left dropped",
                    checkpoint_file(index.stream, shard))
        return False
    write_checkpoint(pack.location, index.stream, shard, files)
    return True


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
    balanced = balances_samples(pack)
    for stream, shards in wanted.items():
        index = pack.index(stream)
        doc = TrimmedShards.read(pack.location, stream)
        listed = set(doc.shards)
        after: tuple[int, StreamState] | None = None  # the state after the shard restored last
        for sh in shards:
            log.info("restoring %s", shard_file(stream, sh.shard))
            if balanced:  # no states of its own: re-split from the reference
                _restore_balanced_shard(pack, index, sh, cfg, tokenizer)
                latents.encode(pack, stream, sh)
                listed.discard(sh.shard)
                write_trimmed(pack.location, stream, listed, set(doc.checkpoints))
                done.setdefault(stream, []).append(sh.shard)
                continue
            start = after[1] if after is not None and after[0] == sh.first_record else \
                state_at(pack.location, index, cfg, sh.first_record, tokenizer).state
            after = (sh.first_record + len(sh.records), _restore_shard(pack, index, sh, cfg, tokenizer, start))
            latents.encode(pack, stream, sh)
            listed.discard(sh.shard)
            dropped = set(doc.checkpoints)
            if sh.shard in dropped and _put_back(pack, index, sh.shard, start):  # a shard that is there keeps its own
                dropped.discard(sh.shard)
            write_trimmed(pack.location, stream, listed, dropped)  # after the checked files are in place
            done.setdefault(stream, []).append(sh.shard)
    return done


def spans_of_state(out, state_path: str) -> dict[int, tuple[int, None]]:
    """What the loader state in ``state_path`` will read of the pack at ``out``: each stream from its
    position on."""
    try:
        state = read_state_file(state_path)
    except ValueError as e:
        raise UsageError(f"--state {e}") from None
    return {s: (p, None) for s, p in positions_of(Pack.open(out), [state]).items()}


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
