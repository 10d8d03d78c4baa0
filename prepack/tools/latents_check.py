"""``verify``'s check of a stream's VAE latents (``prepack latents``; ``schemas.latents``).

A stream's ``latents.json`` lists the shards whose latents are written; each listed file must be
there (unless its shard was trimmed, which removes it with the records), of the listed size and
XXH3-128, readable, and of its own shard: the shard's digest and every record's digest are the
stream index's.  A stream without latents is fine (they are optional); one with some says how
many of its shards have them.
"""

from __future__ import annotations

from loader.reader import Pack
from prepack.tools.report import CheckReport
from schemas.errors import DamagedFile
from schemas.latents import LatentsFile, StreamLatents, file_digest
from schemas.layout import shard_latents_file, stream_latents_file
from schemas.manifest import StreamIndex


def check_latents(pack: Pack, index: StreamIndex, rep: CheckReport) -> None:
    """The latents of ``index``'s stream, if it has any."""
    loc, stream = pack.location, index.stream
    where = stream_latents_file(stream)
    try:
        data = loc.read_bytes(where)
    except FileNotFoundError:
        return
    try:
        listing = StreamLatents.from_json(data, loc.path(where))
    except DamagedFile as e:
        rep.add("latents", where, False, str(e))
        return
    shards = {sh.shard: sh for sh in index.shards}
    trimmed = pack.trimmed(stream)
    for entry in listing.shards:
        name = shard_latents_file(stream, entry.shard)
        shard = shards.get(entry.shard)
        if shard is None:
            rep.add("latents", name, False, f"{where} lists shard {entry.shard}, which the stream index does not hold")
            continue
        try:
            raw = loc.read_bytes(name)
        except FileNotFoundError:
            if entry.shard in trimmed:  # trimmed with its records: restore --vae makes it again
                rep.add("latents", name, True, "trimmed with its shard (prepack restore --vae encodes it again)")
            else:
                rep.add("latents", name, False, f"missing ({where} lists it)")
            continue
        if len(raw) != entry.size or file_digest(raw) != entry.digest:
            rep.add("latents", name, False, f"{len(raw)} bytes whose digest is not the one {where} lists (damaged)")
            continue
        try:
            file = LatentsFile(raw, loc.path(name))
        except DamagedFile as e:
            rep.add("latents", name, False, str(e))
            continue
        if file.shard_digest != shard.xxh3 or file.record_digests != [r.digest for r in shard.records]:
            rep.add("latents", name, False, "the latents of other records than its shard's")
            continue
        rep.add("latents", name, True, f"{entry.images} images of {entry.records} records, encoded on "
                f"{entry.device} in {entry.dtype}")
    missing = len(set(shards) - set(trimmed) - {e.shard for e in listing.shards})
    if missing:
        rep.add("latents", where, True, f"{missing} committed shard(s) have no latents yet (prepack latents)")
