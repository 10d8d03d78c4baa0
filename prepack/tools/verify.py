"""``prepack verify``: is every byte of a pack what its manifest says?

Checks, in one read of each shard file: the file's sha256 and size, its schema and the identity
stamped into its metadata (record schema version, config / tokenizer / code fingerprints, stream
and shard), and every record's content digest, length and sample count, in order.  Then the
identity itself (the stored config rebuilds to its hash, pack.json agrees) and the lineage (one
row per packed sample).  Why one read: a pack is hundreds of GiB; the file is hashed while it is
read into memory and the Arrow IPC file is parsed from that same buffer.

``CheckReport`` (a plain-text table) is shared with ``prepack.tools.audit``.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa

from schemas.location import PackLocation, resolve_location
from schemas.manifest import LINEAGE_NAME, MANIFEST_NAME, PACK_INFO_NAME, Manifest, ShardEntry, StreamEntry
from schemas.record import RECORD_SCHEMA, RECORD_SCHEMA_VERSION, record_digest

log = logging.getLogger(__name__)

_CHUNK = 8 * 2**20
_MAX_RECORD_ROWS = 20  # failing records listed per shard; the rest are counted
_IDENTITY_KEYS = ("config_hash", "tokenizer_fingerprint", "code_fingerprint", "record_schema_version", "config")


# -- report ---------------------------------------------------------------------------------------
@dataclass
class CheckRow:
    """One line of a report: what was checked, on what, and the outcome."""

    check: str
    target: str
    ok: bool
    detail: str = ""


@dataclass
class CheckReport:
    """Rows of checks; ``ok`` only when every row passed.  ``lines()`` renders a plain-text table."""

    title: str
    rows: list[CheckRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    def add(self, check: str, target: str, ok: bool, detail: str = "") -> bool:
        self.rows.append(CheckRow(check, target, ok, detail))
        return ok

    def failures(self) -> list[CheckRow]:
        return [r for r in self.rows if not r.ok]

    def lines(self) -> list[str]:
        wc = max([len("CHECK")] + [len(r.check) for r in self.rows])
        wt = max([len("TARGET")] + [len(r.target) for r in self.rows])
        out = [self.title, f"{'CHECK':<{wc}}  {'TARGET':<{wt}}  RESULT  DETAIL"]
        for r in self.rows:
            out.append(f"{r.check:<{wc}}  {r.target:<{wt}}  {'ok' if r.ok else 'FAIL':<6}  {r.detail}".rstrip())
        bad = self.failures()
        verdict = "OK" if self.ok else "FAILED"
        out.append(f"{verdict}: {len(self.rows) - len(bad)} of {len(self.rows)} checks passed")
        return out


# -- reading --------------------------------------------------------------------------------------
def load_manifest(loc: PackLocation) -> Manifest:
    return Manifest.from_json(loc.read_bytes(MANIFEST_NAME).decode())


def read_hashed(loc: PackLocation, relpath: str) -> tuple[pa.Buffer, str]:
    """The whole file as one Arrow buffer plus its sha256, hashed chunk by chunk as it arrives."""
    h = hashlib.sha256()
    with loc.fs.open_input_file(loc.path(relpath)) as f:
        size = f.size()
        data = bytearray(size)
        view = memoryview(data)
        pos = 0
        while pos < size:
            n = f.readinto(view[pos : pos + _CHUNK])
            if not n:
                raise OSError(f"{relpath}: file ended at byte {pos} of {size}")
            h.update(view[pos : pos + n])
            pos += n
    return pa.py_buffer(data), h.hexdigest()


def _exists(loc: PackLocation, relpath: str) -> bool:
    return loc.fs.get_file_info(loc.path(relpath)).type.name == "File"


# -- checks ---------------------------------------------------------------------------------------
def _expected_metadata(manifest: Manifest, shard: ShardEntry) -> dict[str, str]:
    ident = manifest.identity
    return {
        "prepack.record_schema_version": str(manifest.record_schema_version),
        "prepack.config_hash": str(ident.get("config_hash")),
        "prepack.tokenizer_fingerprint": str(ident.get("tokenizer_fingerprint")),
        "prepack.code_fingerprint": str(ident.get("code_fingerprint")),
        "prepack.stream": str(shard.stream),
        "prepack.shard": str(shard.shard),
    }


def check_shard(loc: PackLocation, manifest: Manifest, shard: ShardEntry) -> list[CheckRow]:
    """Rows for one shard: file bytes, schema metadata, then each record in order."""
    rep = CheckReport("")
    target = shard.file
    try:
        data, sha = read_hashed(loc, shard.file)
    except (OSError, FileNotFoundError) as e:
        rep.add("file", target, False, f"unreadable: {e}")
        return rep.rows
    size_ok = data.size == shard.nbytes
    sha_ok = sha == shard.sha256
    rep.add("file sha256", target, size_ok and sha_ok,
            f"{data.size:,} bytes" if size_ok and sha_ok else
            (f"{data.size:,} bytes, manifest says {shard.nbytes:,}" if not size_ok else
             f"sha256 {sha[:16]}.. != manifest {shard.sha256[:16]}.."))
    try:
        reader = pa.ipc.open_file(pa.BufferReader(data), options=pa.ipc.IpcReadOptions(use_threads=False))
    except (pa.ArrowException, OSError) as e:
        rep.add("records", target, False, f"not a readable Arrow IPC file ({e}): none of its "
                f"{len(shard.records)} records can be checked")
        return rep.rows
    meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    wrong = [f"{k}={meta.get(k)!r} (expected {v!r})" for k, v in _expected_metadata(manifest, shard).items() if meta.get(k) != v]
    if reader.schema.remove_metadata() != RECORD_SCHEMA:
        wrong.append("column schema differs from this reader's RECORD_SCHEMA")
    rep.add("schema metadata", target, not wrong, "; ".join(wrong) or "schema, version and fingerprints match")
    n, expected = reader.num_record_batches, len(shard.records)
    if n != expected:
        rep.add("records", target, False, f"record {min(n, expected)}: file holds {n} records, manifest says {expected}")
    bad = 0
    for i in range(min(n, expected)):
        why = _check_record(reader, i, shard)
        if why:
            bad += 1
            if bad <= _MAX_RECORD_ROWS:
                rep.add("record digest", target, False, f"record {i} (stream record {shard.first_record + i}): {why}")
    if bad > _MAX_RECORD_ROWS:
        rep.add("record digest", target, False, f"... and {bad - _MAX_RECORD_ROWS} more failing records")
    if not bad and n == expected:
        rep.add("record digests", target, True, f"{n} record{'' if n == 1 else 's'}")
    return rep.rows


def _check_record(reader, i: int, shard: ShardEntry) -> str:
    """Why record i does not match its manifest entry, or ''."""
    entry = shard.records[i]
    try:
        record = reader.get_batch(i)
        record.validate(full=True)  # damaged offsets must not make the digest read out of bounds
        digest = record_digest(record)
        length = record.column("sequence_length")[0].as_py()
        samples = len(record.column("sample_lens")[0])
    except Exception as e:  # any failure to decode is a finding about this record, not a crash
        return f"cannot decode ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if digest != entry.digest:
        return f"content digest {digest} != manifest {entry.digest}"
    if (length, samples) != (entry.num_tokens, entry.num_samples):
        return f"{length} tokens / {samples} samples, manifest says {entry.num_tokens} / {entry.num_samples}"
    return ""


def check_identity(loc: PackLocation, manifest: Manifest, rep: CheckReport) -> None:
    """Versions and fingerprints present; stored config rebuilds to its hash; pack.json agrees."""
    ident = manifest.identity
    missing = [k for k in _IDENTITY_KEYS if k not in ident]
    rep.add("identity", MANIFEST_NAME, not missing, f"missing {', '.join(missing)}" if missing else
            f"config {ident['config_hash'][:12]}.., tokenizer {ident['tokenizer_fingerprint'][:12]}.., "
            f"code {ident['code_fingerprint']}")
    versions = {manifest.record_schema_version, ident.get("record_schema_version")}
    rep.add("schema version", MANIFEST_NAME, versions == {RECORD_SCHEMA_VERSION},
            f"record schema {sorted(versions, key=str)} (this reader: {RECORD_SCHEMA_VERSION})")
    if "config" in ident and "config_hash" in ident:
        from prepack.tools.audit import config_from_identity

        try:
            ok = config_from_identity(ident).content_hash() == ident["config_hash"]
            detail = "stored config hashes to config_hash" if ok else "stored config does not hash to config_hash"
        except (KeyError, TypeError, ValueError) as e:
            ok, detail = False, f"stored config does not rebuild: {e}"
        rep.add("config hash", MANIFEST_NAME, ok, detail)
    if _exists(loc, PACK_INFO_NAME):
        same = json.loads(loc.read_bytes(PACK_INFO_NAME)) == ident
        rep.add("pack.json", PACK_INFO_NAME, same, "same identity as the manifest" if same else "differs from the manifest's identity")
    else:
        rep.add("pack.json", PACK_INFO_NAME, False, "missing")
    seeds = ident.get("stream_seeds")
    streams = [s.stream for s in manifest.streams]
    ok = streams == list(range(len(streams))) and (seeds is None or [s.seed for s in manifest.streams] == seeds)
    rep.add("streams", MANIFEST_NAME, ok, f"{len(streams)} streams" if ok else f"streams {streams} / seeds disagree with the identity")


def check_stream_totals(stream: StreamEntry, rep: CheckReport) -> None:
    """A stream's totals and record numbering agree with its shards."""
    first, problems = 0, []
    for sh in stream.shards:
        if sh.first_record != first:
            problems.append(f"{sh.file} starts at record {sh.first_record}, expected {first}")
        first += len(sh.records)
    recs = [r for sh in stream.shards for r in sh.records]
    totals = (len(recs), sum(r.num_tokens for r in recs), sum(r.num_samples for r in recs))
    if totals != (stream.num_records, stream.num_tokens, stream.num_samples):
        problems.append(f"records/tokens/samples {totals} != stream totals "
                        f"{(stream.num_records, stream.num_tokens, stream.num_samples)}")
    if not problems:
        rep.add("stream totals", f"stream {stream.stream}", True, f"{totals[0]} records, {totals[1]:,} tokens")
    for p in problems:
        rep.add("stream totals", f"stream {stream.stream}", False, p)


def check_lineage(loc: PackLocation, manifest: Manifest, rep: CheckReport) -> None:
    """lineage.parquet has exactly one row per packed sample of every record."""
    import polars as pl

    expected = sum(s.num_samples for s in manifest.streams)
    if not _exists(loc, LINEAGE_NAME):
        rep.add("lineage", LINEAGE_NAME, expected == 0, "missing" if expected else "no samples, no lineage")
        return
    lin = pl.read_parquet(io.BytesIO(loc.read_bytes(LINEAGE_NAME)), columns=["stream", "record", "sample"])
    if lin.height != expected:
        rep.add("lineage", LINEAGE_NAME, False, f"{lin.height} rows, manifest counts {expected} samples")
        return
    per_record = lin.group_by("stream", "record").agg(pl.len().alias("n"))
    want = pl.DataFrame(
        [(s.stream, sh.first_record + i, r.num_samples) for s in manifest.streams for sh in s.shards
         for i, r in enumerate(sh.records)],
        schema={"stream": pl.Int32, "record": pl.Int64, "n": pl.UInt32}, orient="row",
    )
    diff = want.join(per_record, on=["stream", "record"], how="full", coalesce=True, suffix="_lineage").filter(
        pl.col("n").ne_missing(pl.col("n_lineage")))
    if diff.height:
        first = diff.sort("stream", "record").row(0, named=True)
        rep.add("lineage", LINEAGE_NAME, False, f"{diff.height} records disagree; first: stream {first['stream']} "
                f"record {first['record']} has {first['n_lineage']} lineage rows, manifest says {first['n']} samples")
    else:
        rep.add("lineage", LINEAGE_NAME, True, f"{lin.height} rows = samples of every record")


def verify_pack(out: "str | os.PathLike | PackLocation", *, threads: int | None = None,
                progress: bool = False) -> CheckReport:
    """Check every shard byte, record digest, identity field and lineage row against the manifest."""
    loc = resolve_location(out)
    rep = CheckReport(f"verify {loc.base}")
    try:
        manifest = load_manifest(loc)
    except (OSError, FileNotFoundError, ValueError, KeyError, TypeError) as e:
        rep.add("manifest", MANIFEST_NAME, False, f"unreadable: {e}")
        return rep
    check_identity(loc, manifest, rep)
    shards = [sh for s in manifest.streams for sh in s.shards]
    workers = max(1, min(threads or min(4, os.cpu_count() or 1), len(shards) or 1))
    from tqdm import tqdm

    with ThreadPoolExecutor(workers, thread_name_prefix="verify") as pool, \
            tqdm(total=sum(sh.nbytes for sh in shards), unit="B", unit_scale=True, desc="verifying",
                 disable=not progress) as bar:
        for sh, rows in zip(shards, pool.map(lambda sh: check_shard(loc, manifest, sh), shards)):
            rep.rows.extend(rows)
            bar.update(sh.nbytes)
    for s in manifest.streams:
        check_stream_totals(s, rep)
    check_lineage(loc, manifest, rep)
    return rep
