"""The folder layout of a pack: every on-disk name, declared once, formatted and parsed from here.

Layout of a pack (every name deterministic, no uuids or timestamps)::

    OUT/pack.json                                 identity: format, config, fingerprints, W, K, budget (first)
    OUT/.prepack/leases/<holder>.json             one lease per live job (prepack.run.lease)
    OUT/reference/.prepack/grants/stream-00003.json  a reference shard granted room (balanced samples, --disk-budget)
    OUT/stream-00003/ckpt-00000.json (+ .arrow)   stream state at the start of shard 0
    OUT/stream-00003/shard-00000.arrow            Arrow IPC file, one record batch per packed batch
    OUT/stream-00003/shard-00000.pixels.arrow     where each picture of the shard lies, by content (schemas.pixel_index)
    OUT/stream-00003/shard-00000.lineage.parquet  one row per packed sample of the shard (until the stream is done)
    OUT/stream-00003/shard-00000.sources.json     every source the shard read, by identity (schemas.sources: restorable?)
    OUT/stream-00003/shard-00000.latents.arrow    its records' VAE encoder moments (prepack latents; schemas.latents)
    OUT/stream-00003/latents.json                 the shards whose latents are written: their commit marker
    OUT/stream-00003/ckpt-00001.json (+ .arrow)   stream state after shard 0 = at the start of shard 1
    OUT/stream-00003/index.arrow                  one row per committed shard: THE commit marker
    OUT/stream-00003/done.json                    the stream finished its budget: totals, drops, digest root
    OUT/stream-00003/trimmed.json                 shards whose records file was trimmed (prepack trim; restorable)
    OUT/lineage/stream-00003.parquet              the stream's lineage once it is done (its shard files are then removed)
    OUT/manifest.json                             a summary of every stream once all are done (O(streams))
    OUT/pixels/...                                the pack's pixel catalog (its names: schemas.pixel_catalog)

How a shard is committed into this layout is ``prepack.run.commit.writer``'s (its module doc); what the
documents hold is ``schemas.manifest``'s.

Why one table: the writer, crash recovery, the reader's evidence of records, the tools and the
leases all name or recognise these files.  Each name is one template in ``LAYOUT``: the format
functions fill it in, and ``parse`` recognises a name with a pattern made from the same template,
so no name can be written one way and read another.  Numbers are written with five digits at
least and read at any width.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

PACK_INFO_NAME = "pack.json"
MANIFEST_NAME = "manifest.json"
LINEAGE_DIR = "lineage"
LEASE_DIR = ".prepack/leases"
GRANT_DIR = ".prepack/grants"
INDEX_NAME = "index.arrow"
DONE_NAME = "done.json"
TRIMMED_NAME = "trimmed.json"
LATENTS_NAME = "latents.json"
# a balanced-samples pack (``prepack: balance: samples``) holds its reference, an ordinary pack, here
REFERENCE_DIR = "reference"
# a training's progress folder (``schemas.progress``): a rank's checkpoint file keeps this many entries,
# the most ``--keep-checkpoints`` can ask for
MAX_CHECKPOINTS = 32
TMP_SUFFIX = ".tmp"  # a file being written under its final name + this, renamed when complete (local disks)

_STREAM_DIR = "stream-{stream:05d}"

# the kinds of file a pack holds
PACK_INFO = "pack_info"
MANIFEST = "manifest"
LEASE = "lease"
GRANT = "grant"
SHARD = "shard"
PIXELS = "pixels"
SOURCES = "sources"
SHARD_LINEAGE = "shard_lineage"
CKPT_JSON = "ckpt_json"
CKPT_ARROW = "ckpt_arrow"
INDEX = "index"
DONE = "done"
TRIMMED = "trimmed"
STREAM_LINEAGE = "stream_lineage"
LATENTS = "latents"
STREAM_LATENTS = "stream_latents"

# kind -> name relative to the pack's root: {stream} and {shard} are numbers, {holder} a lease's holder id
LAYOUT: dict[str, str] = {
    PACK_INFO: PACK_INFO_NAME,
    MANIFEST: MANIFEST_NAME,
    LEASE: LEASE_DIR + "/{holder}.json",
    GRANT: GRANT_DIR + "/" + _STREAM_DIR + ".json",
    SHARD: _STREAM_DIR + "/shard-{shard:05d}.arrow",
    PIXELS: _STREAM_DIR + "/shard-{shard:05d}.pixels.arrow",
    SHARD_LINEAGE: _STREAM_DIR + "/shard-{shard:05d}.lineage.parquet",
    SOURCES: _STREAM_DIR + "/shard-{shard:05d}.sources.json",
    LATENTS: _STREAM_DIR + "/shard-{shard:05d}.latents.arrow",
    STREAM_LATENTS: _STREAM_DIR + "/" + LATENTS_NAME,
    CKPT_JSON: _STREAM_DIR + "/ckpt-{shard:05d}.json",
    CKPT_ARROW: _STREAM_DIR + "/ckpt-{shard:05d}.arrow",
    INDEX: _STREAM_DIR + "/" + INDEX_NAME,
    DONE: _STREAM_DIR + "/" + DONE_NAME,
    TRIMMED: _STREAM_DIR + "/" + TRIMMED_NAME,
    STREAM_LINEAGE: LINEAGE_DIR + "/stream-{stream:05d}.parquet",
}
SHARD_FILES = (SHARD, PIXELS, SHARD_LINEAGE, SOURCES, LATENTS)  # numbered by the shard they belong to
CHECKPOINT_FILES = (CKPT_JSON, CKPT_ARROW)  # numbered by the shard they are the state at the start of
_CHECKPOINT_EXT = {"json": CKPT_JSON, "arrow": CKPT_ARROW}


def stream_dir(stream: int) -> str:
    return _STREAM_DIR.format(stream=stream)


def shard_file(stream: int, shard: int) -> str:
    return LAYOUT[SHARD].format(stream=stream, shard=shard)


def shard_pixels_file(stream: int, shard: int) -> str:
    return LAYOUT[PIXELS].format(stream=stream, shard=shard)


def shard_sources_file(stream: int, shard: int) -> str:
    return LAYOUT[SOURCES].format(stream=stream, shard=shard)


def shard_latents_file(stream: int, shard: int) -> str:
    return LAYOUT[LATENTS].format(stream=stream, shard=shard)


def stream_latents_file(stream: int) -> str:
    return LAYOUT[STREAM_LATENTS].format(stream=stream)


def shard_lineage_file(stream: int, shard: int) -> str:
    return LAYOUT[SHARD_LINEAGE].format(stream=stream, shard=shard)


def stream_lineage_file(stream: int) -> str:
    return LAYOUT[STREAM_LINEAGE].format(stream=stream)


def checkpoint_file(stream: int, shard: int, ext: str = "json") -> str:
    return LAYOUT[_CHECKPOINT_EXT[ext]].format(stream=stream, shard=shard)


def index_file(stream: int) -> str:
    return LAYOUT[INDEX].format(stream=stream)


def done_file(stream: int) -> str:
    return LAYOUT[DONE].format(stream=stream)


def trimmed_file(stream: int) -> str:
    return LAYOUT[TRIMMED].format(stream=stream)


def lease_file(holder: str) -> str:
    return LAYOUT[LEASE].format(holder=holder)


def grant_file(stream: int) -> str:
    return LAYOUT[GRANT].format(stream=stream)


def temporary(relpath: str, writer: str = "") -> str:
    """Where ``relpath`` is written until it is complete (local disks).  ``writer`` tells apart
    writers that may write the same file at once (two jobs starting on one new output both write
    its ``pack.json``): each then renames its own complete file into place."""
    return f"{relpath}.{writer}{TMP_SUFFIX}" if writer else relpath + TMP_SUFFIX


def is_temporary(name: str) -> bool:
    return name.endswith(TMP_SUFFIX)


@dataclass(frozen=True)
class PackFile:
    """What a name of the layout says: its kind and the numbers or holder in it."""

    kind: str
    stream: int | None = None
    shard: int | None = None
    holder: str | None = None


_FIELD_PATTERNS = {"stream": r"(?P<stream>\d+)", "shard": r"(?P<shard>\d+)", "holder": r"(?P<holder>[^/]*)"}


def _pattern(template: str) -> re.Pattern:
    parts = []
    for literal, name, _spec, _conv in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if name is not None:
            parts.append(_FIELD_PATTERNS[name])
    return re.compile("".join(parts))


_PATTERNS = {kind: _pattern(template) for kind, template in LAYOUT.items()}


def parse(relpath: str) -> PackFile | None:
    """The kind and numbers of a name relative to the pack's root; None for a name not of the layout
    (a name inside a folder, as listed, is parsed as ``f"{folder}/{name}"``)."""
    for kind, pattern in _PATTERNS.items():
        m = pattern.fullmatch(relpath)
        if m:
            d = m.groupdict()
            return PackFile(kind, int(d["stream"]) if "stream" in d else None,
                            int(d["shard"]) if "shard" in d else None, d.get("holder"))
    return None
