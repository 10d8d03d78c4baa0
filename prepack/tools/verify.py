"""``prepack verify``: is every file of a pack what its indexes say?

Per stream, in memory bounded by that stream: the index (schema, contiguity, digest chain), the
start checkpoint and every shard's end checkpoint (sha256 recorded at commit), every shard (size,
XXH3-128 file digest, schema identity and each record's digest, through the loader's own
``read_shard``), the lineage (sha256 and one row per packed sample of each record; a stream being
extended has its earlier shards' rows in its compacted lineage file) and ``done.json`` (totals
and root agree with the index).  Then the pack: ``pack.json`` (format, stored config hashes to its
config_hash) and ``manifest.json`` (each stream's summary equals its ``done.json``).  A
balanced-samples pack's streams have no checkpoints of their own: each step's samples are checked
against its reference instead (``balanced_check``).  A file that is damaged or missing fails with
its path named; nothing is repaired.
"""

from __future__ import annotations

import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from loader.reader import Pack, read_shard
from prepack.run.bounded.checkpoint_ladder import nearest_kept
from prepack.run.bounded.restorable import RestoreCheck, current_tokenizer
from prepack.tools.latents_check import check_latents
from prepack.tools.report import CheckReport
from schemas.errors import DamagedFile, PrepackError, ShardTrimmed
from schemas.layout import (
    MANIFEST_NAME,
    PACK_INFO_NAME,
    checkpoint_file,
    done_file,
    index_file,
    shard_file,
    shard_lineage_file,
    shard_pixels_file,
    shard_sources_file,
    stream_lineage_file,
)
from prepack.run.reference_pack import balances_samples
from prepack.tools.balanced_check import check_balanced_steps
from schemas.lineage import LINEAGE_SCHEMA, lineage_by_shard, lineage_columns, samples_per_record
from schemas.location import PackLocation, resolve_location
from schemas.manifest import PackSummary, ShardEntry, StreamIndex, StreamSummary, TrimmedShards
from schemas.pixel_catalog import CATALOG_NAME, ROW_DTYPE, Catalog, block_digest, fences_file, parse_fences, part_file
from schemas.sources import ShardSources

log = logging.getLogger(__name__)

_IDENTITY_KEYS = ("config_hash", "tokenizer_fingerprint", "code_fingerprint", "record_schema_version", "config")


def _sha256(loc: PackLocation, relpath: str) -> tuple[bytes | None, str]:
    """(bytes, sha256) of a file, or (None, why) when it cannot be read."""
    try:
        data = loc.read_bytes(relpath)
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        return None, f"unreadable: {e}"
    return data, hashlib.sha256(data).hexdigest()


def _check_file(loc: PackLocation, rep: CheckReport, check: str, relpath: str, want: str) -> bytes | None:
    """One row: the file's sha256 equals the recorded one.  Returns its bytes when it does."""
    data, sha = _sha256(loc, relpath)
    if data is None:
        rep.add(check, relpath, False, sha)
        return None
    ok = sha == want
    rep.add(check, relpath, ok, f"{len(data):,} bytes" if ok else f"sha256 {sha[:16]}.. != recorded {want[:16]}..")
    return data if ok else None


def check_shard(pack: Pack, shard: ShardEntry) -> list:
    """Rows for one shard file: bytes, schema identity, every record digest (the loader's reader)."""
    rep = CheckReport("")
    try:
        n = sum(1 for _ in read_shard(pack, shard, verify="file"))
    except ShardTrimmed:  # on purpose, and restorable: its index row, checkpoints and pixel index are checked
        rep.add("shard", shard.file, True, f"trimmed ({len(shard.records)} records; prepack restore packs it again)")
    except PrepackError as e:
        rep.add("shard", shard.file, False, str(e))
    else:
        rep.add("shard", shard.file, True, f"{shard.nbytes:,} bytes, {n} record{'' if n == 1 else 's'}")
    return rep.rows


def check_lineage_rows(data: bytes, shards: list[ShardEntry], rel: str, rep: CheckReport) -> None:
    """The lineage file holds exactly one row per packed sample of each record of ``shards``."""
    try:
        schema = lineage_columns(data)
        counts = samples_per_record(data)
    except (pa.ArrowException, OSError) as e:
        rep.add("lineage rows", rel, False, f"not a readable parquet file ({e})")
        return
    if not schema.remove_metadata().equals(LINEAGE_SCHEMA):
        rep.add("lineage rows", rel, False, "columns differ from the lineage schema")
        return
    want = {sh.first_record + i: r.num_samples for sh in shards for i, r in enumerate(sh.records) if r.num_samples}
    bad = sorted(k for k in set(want) | set(counts) if want.get(k, 0) != counts.get(k, 0))
    if bad:
        r = bad[0]
        rep.add("lineage rows", rel, False, f"{len(bad)} records disagree; first: record {r} has {counts.get(r, 0)} "
                f"lineage rows, the index says {want.get(r, 0)} samples")
    else:
        rep.add("lineage rows", rel, True, f"{sum(counts.values())} rows = samples of every record")


def _check_sources(loc: PackLocation, rep: CheckReport, shard: ShardEntry) -> None:
    """A shard's record of its sources (``schemas.sources``): there, intact (its own checksum) and its own."""
    where = shard_sources_file(shard.stream, shard.shard)
    try:
        doc = ShardSources.read(loc, shard.stream, shard.shard)
    except DamagedFile as e:
        rep.add("sources", where, False, str(e))
        return
    if doc is None:
        rep.add("sources", where, False, "missing: a trim could not tell whether this shard can be restored")
    elif (doc.stream, doc.shard) != (shard.stream, shard.shard):
        rep.add("sources", where, False, f"names stream {doc.stream} shard {doc.shard}")
    else:
        rep.add("sources", where, True, f"{len(doc.sources)} sources recorded")


def check_stream(pack: Pack, stream: int, rep: CheckReport, pool: ThreadPoolExecutor, bar,
                 metadata_only: bool = False) -> StreamSummary | None:
    """Every file of one stream; returns its done.json summary (None while it is still packing).

    ``metadata_only``: the index and done.json, not the shard, checkpoint and lineage bytes."""
    loc = pack.location
    try:
        index = pack.index(stream, refresh=True)
    except PrepackError as e:
        rep.add("stream index", index_file(stream), False, str(e))
        return None
    if not index.shards:  # Pack.index raised if anything said the stream had records
        rep.add("stream index", index_file(stream), True, "nothing committed yet")
        return None
    rep.add("stream index", index_file(stream), True,
            f"{len(index.shards)} shards, {index.num_records} records, digest chain ok")
    if metadata_only:
        return _check_done(pack, index, rep)
    if index.ckpt0_json_sha256:
        for ext, sha in (("json", index.ckpt0_json_sha256), ("arrow", index.ckpt0_arrow_sha256)):
            _check_file(loc, rep, "checkpoint", checkpoint_file(stream, 0, ext), sha)
    for sh, rows in zip(index.shards, pool.map(lambda sh: check_shard(pack, sh), index.shards)):
        rep.rows.extend(rows)
        bar.update(sh.nbytes)
    own_states = not balances_samples(pack)  # a balanced stream's states are its reference's (balanced_check)
    dropped = set(TrimmedShards.read(loc, stream).checkpoints)
    for sh in index.shards:
        if sh.shard + 1 in dropped:  # a trim dropped it, off the ladder: a restore packs it again
            rep.add("checkpoint", checkpoint_file(stream, sh.shard + 1), True,
                    f"dropped by a trim (a restore starts from checkpoint {nearest_kept(sh.shard + 1, dropped)})")
        for ext, sha in (("json", sh.ckpt_json_sha256), ("arrow", sh.ckpt_arrow_sha256)) \
                if own_states and sh.shard + 1 not in dropped else ():
            _check_file(loc, rep, "checkpoint", checkpoint_file(stream, sh.shard + 1, ext), sha)
        _check_file(loc, rep, "pixel index", shard_pixels_file(stream, sh.shard), sh.pixels_sha256)
        if sh.ckpt_json_sha256:  # committed by a stream job: it recorded the sources its restore reads
            _check_sources(loc, rep, sh)
    check_latents(pack, index, rep)
    done = _check_done(pack, index, rep)
    if done is not None and done.lineage_sha256:
        data = _check_file(loc, rep, "lineage", stream_lineage_file(stream), done.lineage_sha256)
        if data is not None:
            check_lineage_rows(data, index.shards, stream_lineage_file(stream), rep)
    elif done is None:  # still packing: lineage is per shard, but an extended stream's earlier shards are compacted
        compacted = _compacted_shards(loc, index, rep)
        for sh in index.shards[compacted:]:
            data = _check_file(loc, rep, "lineage", shard_lineage_file(stream, sh.shard), sh.lineage_sha256)
            if data is not None:
                check_lineage_rows(data, [sh], shard_lineage_file(stream, sh.shard), rep)
    return done


def _compacted_shards(loc: PackLocation, index: StreamIndex, rep: CheckReport) -> int:
    """How many leading shards of a stream being extended have their lineage in
    ``lineage/stream-S.parquet`` (compacted when it was last done; one row group per shard),
    after checking that file's rows against them.  0 when there is no such file."""
    rel = stream_lineage_file(index.stream)
    try:
        data = loc.read_bytes(rel)
    except FileNotFoundError:
        return 0
    try:
        groups = min(lineage_by_shard(data).num_row_groups, len(index.shards))
    except Exception:  # unreadable: check_lineage_rows says so against every shard
        groups = len(index.shards)
    check_lineage_rows(data, index.shards[:groups], rel, rep)
    return groups


def _check_done(pack: Pack, index: StreamIndex, rep: CheckReport) -> StreamSummary | None:
    rel = done_file(index.stream)
    try:
        done = StreamSummary.read(pack.location, index.stream)
    except PrepackError as e:
        rep.add("stream done", rel, False, str(e))
        return None
    if done is None:
        finished = PackSummary.written(pack.location)
        rep.add("stream done", rel, not finished, "missing, but manifest.json says every stream is done" if finished
                else "not done yet (still packing, or packed by another job)")
        return None
    recs = [r for sh in index.shards for r in sh.records]
    got = (done.num_shards, done.num_records, done.num_tokens, done.num_samples, done.root)
    want = (len(index.shards), len(recs), sum(r.num_tokens for r in recs), sum(r.num_samples for r in recs), index.root)
    ok = got == want and done.stream == index.stream
    rep.add("stream done", rel, ok, f"{done.num_records} records, {done.num_tokens:,} tokens" if ok else
            f"shards/records/tokens/samples/root {got} != index {want}")
    return done


def check_identity(pack: Pack, rep: CheckReport) -> None:
    """Fingerprints present; the stored config rebuilds and hashes to its config_hash."""
    ident = pack.identity
    missing = [k for k in _IDENTITY_KEYS if k not in ident]
    rep.add("identity", PACK_INFO_NAME, not missing, f"missing {', '.join(missing)}" if missing else
            f"format {ident['format_version']}, config {ident['config_hash'][:12]}.., "
            f"tokenizer {ident['tokenizer_fingerprint'][:12]}.., code {ident['code_fingerprint']}")
    if "config" in ident and "config_hash" in ident:
        try:
            ok = pack.info.stored_config().content_hash() == pack.info.config_hash
            detail = "stored config hashes to config_hash" if ok else "stored config does not hash to config_hash"
        except (KeyError, TypeError, ValueError) as e:
            ok, detail = False, f"stored config does not rebuild: {e}"
        rep.add("config hash", PACK_INFO_NAME, ok, detail)


def check_parent(pack: Pack, rep: CheckReport) -> None:
    """A continuation: the pack it continues is there, unchanged, and holds each stream's first
    records with the digests pack.json recorded (its own files are that pack's to verify)."""
    link = pack.info.parent
    if link is None:
        return
    bad = []
    for s in range(pack.num_streams):
        try:
            pack.switch(s)  # checks the link of stream s
        except PrepackError as e:
            bad.append(str(e))
    rep.add("parent", PACK_INFO_NAME, not bad, bad[0] + (f" (and {len(bad) - 1} more streams)" if len(bad) > 1 else "")
            if bad else f"continues {link.uri}: each stream's switch record is there, unchanged")


def check_summary(pack: Pack, dones: dict[int, StreamSummary | None], rep: CheckReport) -> None:
    """manifest.json, when present, lists exactly each stream's done.json."""
    try:
        summary = PackSummary.read(pack.location)
    except PrepackError as e:
        rep.add("manifest", MANIFEST_NAME, False, str(e))
        return
    if summary is None:
        unfinished = sum(1 for d in dones.values() if d is None)
        # Not OK once every stream is done: the manifest is the finished pack's summary (and its
        # sign of being finished), so its absence means the run that finished last died before
        # writing it, or it was deleted.  Nothing is lost: a rerun rewrites it from done.json.
        rep.add("manifest", MANIFEST_NAME, unfinished > 0,
                f"not written: {unfinished} streams still packing" if unfinished else
                "missing, though every stream is done: rerun the same 'prepack run CONFIG --out OUT' "
                "(it packs nothing and writes the manifest from each stream's done.json)")
        return
    wrong = [s.stream for s in summary.streams if dones.get(s.stream) != s]
    problems = []
    if wrong:
        problems.append(f"{len(wrong)} streams differ from their done.json (first: {done_file(wrong[0])}), "
                        "or it could not be checked")
    if len(summary.streams) != pack.num_streams:
        problems.append(f"lists {len(summary.streams)} streams, {PACK_INFO_NAME} says {pack.num_streams}")
    if summary.identity != pack.identity:
        problems.append(f"its identity differs from {PACK_INFO_NAME}")
    rep.add("manifest", MANIFEST_NAME, not problems,
            "; ".join(problems) or f"{len(summary.streams)} streams = their done.json")


def check_catalog(pack: Pack, rep: CheckReport) -> None:
    """The pixel catalog, when the pack has one (``prepack index``): its checksum, its fences'
    sha256, every block's digest, and a coverage that is a prefix of each stream's shards."""
    loc = pack.location
    try:
        catalog = Catalog.read(loc)
    except PrepackError as e:
        rep.add("pixel catalog", CATALOG_NAME, False, str(e))
        return
    if catalog is None:
        return  # optional: a --reuse run builds it when it needs it
    fences_data = _check_file(loc, rep, "pixel catalog", fences_file(catalog.build), catalog.fences_sha256)
    if fences_data is None:
        return
    fences = parse_fences(fences_data, fences_file(catalog.build))
    parts, starts, counts, digests = (fences.column(n).to_numpy() for n in ("part", "row", "rows", "digest"))
    size = ROW_DTYPE.itemsize
    for part in np.unique(parts):
        rel = part_file(catalog.build, int(part))
        mine = parts == part
        data, _ = _sha256(loc, rel)
        if data is None or len(data) != int(counts[mine].sum()) * size:
            rep.add("pixel catalog", rel, False, "missing or unreadable" if data is None else
                    f"{len(data):,} bytes, its fences say {int(counts[mine].sum()) * size:,}")
            continue
        bad = [i for i, (b, n, d) in enumerate(zip(starts[mine], counts[mine], digests[mine]))
               if block_digest(data[int(b) * size:(int(b) + int(n)) * size]) != d]
        rep.add("pixel catalog", rel, not bad, f"blocks {bad} differ from their fences" if bad else
                f"{int(mine.sum())} blocks ok")
    committed = 0
    for stream in range(pack.num_streams):
        shards = pack.index(stream).shards
        committed += len(shards)
        pack.forget(stream)
        if not catalog.holds_for(stream, shards):
            rep.add("pixel catalog", CATALOG_NAME, False, f"covers shards of stream {stream} its index does not have")
            return
    covered = sum(n for n, _ in catalog.covered.values())
    rep.add("pixel catalog", CATALOG_NAME, True, f"{catalog.rows:,} pictures of {covered:,} shards"
            + (f" ({committed - covered:,} committed since: the next --reuse run indexes them)" if covered < committed else ""))


def check_restorable(pack: Pack, rep: CheckReport) -> None:
    """Each trimmed shard: could ``prepack restore`` pack it again now (its sources and tokenizer as
    they were when it was packed, ``prepack.run.bounded.restorable``)?"""
    check = RestoreCheck(pack, current_tokenizer(pack))
    trimmed = 0
    for stream in range(pack.num_streams):
        for shard in TrimmedShards.read(pack.location, stream).shards:
            trimmed += 1
            why = check.why_not(stream, shard)
            rep.add("restorable", shard_file(stream, shard), why is None,
                    "its sources and tokenizer are as they were packed" if why is None else why)
    if not trimmed:
        rep.add("restorable", "trimmed shards", True, "none is trimmed")


def verify_pack(out: "str | os.PathLike | PackLocation", *, threads: int | None = None, progress: bool = False,
                metadata_only: bool = False, restorable: bool = False) -> CheckReport:
    """Check every file of a pack, one stream at a time (see the module doc); ``metadata_only``
    checks pack.json, the stream indexes, done.json and the manifest, reading no shard;
    ``restorable``: also whether each trimmed shard could be packed again now."""
    loc = resolve_location(out)
    rep = CheckReport(f"verify {loc.base}")
    try:
        pack = Pack.open(loc)
    except PrepackError as e:
        rep.add("pack.json", PACK_INFO_NAME, False, str(e))
        return rep
    check_identity(pack, rep)
    check_parent(pack, rep)
    workers = max(1, threads or min(4, os.cpu_count() or 1))
    from tqdm import tqdm

    dones = {}
    with ThreadPoolExecutor(workers, thread_name_prefix="verify") as pool, \
            tqdm(unit="B", unit_scale=True, desc="verifying", disable=not progress) as bar:
        for s in range(pack.num_streams):
            dones[s] = check_stream(pack, s, rep, pool, bar, metadata_only)
            pack.forget(s)  # memory bounded by one stream
    check_summary(pack, dones, rep)
    if not metadata_only:
        check_catalog(pack, rep)
        if balances_samples(pack):
            check_balanced_steps(pack, rep)
    if restorable:
        check_restorable(pack, rep)
    return rep
