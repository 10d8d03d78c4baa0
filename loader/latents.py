"""VAE latents for the batches a loader hands out (``vae_latents=``; ``prepack latents``; issue 51).

Why here: a pack whose shards have their encoder moments stored (``schemas.latents``) lets
training skip its frozen VAE encode.  For each record the loader reads its moments from its
shard's latents file and gives them to the batch (``loader.batch.VaeMoments``), which draws
``padded_latent`` on its device (``SimpleCustomBatch``): ``scale * (mean + exp(logvar / 2) * eps
- shift)``, with ``eps`` from a generator seeded by the record's digest and the dataset's epoch,
as NeMo's recipe draws it from ``encoder(padded_images)`` under bfloat16 autocast.  The noise
differs from an online run's, as two online runs' noise already does; everything else in the
batch is unchanged.

Checks: the stream's ``latents.json`` lists the shard (its commit marker); with ``verify`` the
file's size and XXH3-128 are the listing's; the file names its shard's digest and each record's,
which must be the index's.  A shard without latents is ``MissingLatents`` naming it, unless the
mode is ``"prefer"`` (pixels for that batch).  With ``follow`` a shard whose latents are not
written yet is waited for (``prepack latents --follow`` runs beside the packer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import xxhash

from loader.batch import VaeMoments
from loader.reader import Follow, Pack
from schemas.errors import FollowTimeout, MissingLatents
from schemas.latents import LatentsFile, StreamLatents, file_digest
from schemas.layout import shard_latents_file, stream_latents_file

MODES = ("require", "prefer")


def latents_mode(value: "bool | str | None") -> "str | None":
    """``vae_latents=``: False/None (pixels), True or "require" (latents, a shard without them is an
    error), "prefer" (latents where a shard has them, pixels elsewhere)."""
    if value is None or value is False:
        return None
    if value is True:
        return "require"
    if value in MODES:
        return value
    raise ValueError(f"vae_latents must be True, False, 'require' or 'prefer', got {value!r}")


def noise_seed(record_digest: str, epoch: int) -> int:
    """The seed of a record's latent noise in one epoch: the same record and epoch, the same draw."""
    return xxhash.xxh3_64(f"{record_digest}:{epoch}".encode()).intdigest() & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class _Open:
    shard: int
    file: LatentsFile


class LatentsReader:
    """Each record's moments, shard by shard (one latents file open per stream at a time)."""

    def __init__(self, pack: Pack, mode: str, verify: "bool | str", follow: "Follow | None"):
        self.pack, self.mode, self.verify, self.follow = pack, mode, verify, follow
        self._open: dict[tuple[int, int], _Open] = {}  # (pack id, stream) -> the open shard's file
        self._listings: dict[tuple[int, int], StreamLatents | None] = {}
        self._made_by: tuple | None = None  # (encoder, weights, scale, shift) of the first file read
        self.epoch = 0

    def _listing(self, pack: Pack, stream: int, refresh: bool = False) -> "StreamLatents | None":
        key = (id(pack), stream)
        if refresh or key not in self._listings:
            try:
                data = pack.location.read_bytes(stream_latents_file(stream))
            except FileNotFoundError:
                self._listings[key] = None
            else:
                self._listings[key] = StreamLatents.from_json(data, pack.location.path(stream_latents_file(stream)))
        return self._listings[key]

    def _file(self, pack: Pack, stream: int, index_shard) -> "LatentsFile | None":
        shard = index_shard.shard
        key = (id(pack), stream)
        opened = self._open.get(key)
        if opened is not None and opened.shard == shard:
            return opened.file
        entry = self._wait_for_entry(pack, stream, shard)
        if entry is None:
            return None
        name = shard_latents_file(stream, shard)
        path = pack.location.path(name)
        try:
            data = pack.location.read_bytes(name)
        except FileNotFoundError:
            raise MissingLatents(f"{path}: missing, but {stream_latents_file(stream)} lists it") from None
        if self.verify and (len(data) != entry.size or file_digest(data) != entry.digest):
            raise MissingLatents(f"{path}: its size or digest differs from {stream_latents_file(stream)} "
                                 "(damaged or replaced)")
        file = LatentsFile(data, path)
        if file.shard_digest != index_shard.xxh3:
            raise MissingLatents(f"{path}: the latents of another shard (its shard digest differs from the index)")
        made_by = (file.info.encoder, file.info.weights, file.info.scale_factor, file.info.shift_factor)
        if self._made_by is None:
            self._made_by = made_by
        elif made_by != self._made_by:  # one training, one VAE: a chain or pack encoded twice must agree
            raise MissingLatents(f"{path}: encoded by {made_by[0]} with weights {made_by[1]}, but the latents read "
                                 f"before by {self._made_by[0]} with weights {self._made_by[1]}")
        self._open[key] = _Open(shard, file)
        return file

    def _wait_for_entry(self, pack: Pack, stream: int, shard: int):
        listing = self._listing(pack, stream)
        entry = listing.get(shard) if listing is not None else None
        since = time.monotonic()
        while entry is None and self.follow is not None:
            if self.follow.timeout_s is not None and time.monotonic() - since > self.follow.timeout_s:
                raise FollowTimeout(f"stream {stream} shard {shard}: no VAE latents after {self.follow.timeout_s:g} s")
            time.sleep(self.follow.poll_s)
            listing = self._listing(pack, stream, refresh=True)
            entry = listing.get(shard) if listing is not None else None
        if entry is None and self.mode == "require":
            where = pack.location.path(shard_latents_file(stream, shard))
            raise MissingLatents(f"{where}: no VAE latents for shard {shard} of stream {stream} (run prepack latents "
                                 f"on the pack, or vae_latents='prefer' to read pixels where they are missing)")
        return entry

    def moments(self, stream: int, record: int) -> "VaeMoments | None":
        """Record ``record`` (counted over a continuation's chain) of ``stream``: its moments and
        their draw, or None for pixels (``prefer``, a shard without latents)."""
        pack, n = self.pack, self.pack.switch(stream)
        while record < n:  # a continuation's parent's record: the parent pack's latents
            pack = pack.parent
            n = pack.switch(stream)
        own = record - n
        shard = pack.index(stream).shard_of(own)
        file = self._file(pack, stream, shard)
        if file is None:
            return None
        j = own - shard.first_record
        digest = shard.records[j].digest
        if file.record_digests[j] != digest:
            raise MissingLatents(f"{file.where}: record {j}'s latents are of another record (digest differs)")
        info = file.info
        return VaeMoments(file.moments(j), info.dtype, info.z_channels, info.scale_factor, info.shift_factor,
                          noise_seed(digest, self.epoch))
