"""``prepack audit``: re-pack shards and prove the stored records are what the code makes of the data.

A stream's output depends only on (config, tokenizer, data, stream id), and every shard starts
from a committed checkpoint, so shard k of stream s can be re-packed alone: restore ``ckpt-k``,
take as many batches as the shard holds, compare record digests one by one, and compare the state
reached with ``ckpt-(k+1)``.  ``all_streams`` re-packs whole streams from their seeds instead,
which also proves every checkpoint (each shard boundary's state must equal the stored one).

An audit is only meaningful with the same config, tokenizer, code and data: it is refused, with
one line saying why, when a fingerprint differs from pack.json's or a source is unreachable.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from loader.reader import Pack, read_shard
from prepack.engine.state_codec import state_to_payload
from prepack.engine.packers import open_packer
from prepack.run.chain import switch_at
from prepack.run.bounded.replay import state_at
from prepack.run.commit.atomic_files import sha256_hex
from prepack.run.commit.checkpoint_files import checkpoint_digests, read_checkpoint_files
from prepack.run.identity import identity_mismatch, pack_identity
from prepack.run.reference_pack import balances_samples, open_reference
from prepack.tools.balanced_check import audit_balanced_shard
from prepack.tools.report import CheckReport
from schemas.checkpoint import decode_pixels
from schemas.config import PrepackConfig
from schemas.errors import AuditRefused, DamagedFile, PrepackError
from schemas.location import PackLocation
from schemas.documents import load_checked
from schemas.layout import REFERENCE_DIR, checkpoint_file
from schemas.manifest import ShardEntry, StreamIndex, TrimmedShards
from schemas.packed_batch import PackedBatch, SampleOrigin, batch_fields
from schemas.record import batch_to_record, record_digest, record_to_batch

log = logging.getLogger(__name__)


# -- preconditions --------------------------------------------------------------------------------
@dataclass
class AuditContext:
    pack: Pack
    cfg: PrepackConfig
    tokenizer: Any
    special: Any

    @property
    def loc(self) -> PackLocation:
        return self.pack.location


def _reachable(path: str, directory: bool) -> bool:
    if "://" in path:
        import pyarrow.fs as pafs

        fs, p = pafs.FileSystem.from_uri(path)
        kind = fs.get_file_info(p).type
        return kind == (pafs.FileType.Directory if directory else pafs.FileType.File)
    return os.path.isdir(path) if directory else os.path.isfile(path)


def unreachable_source(cfg: PrepackConfig) -> str | None:
    """The first source path of the config that is not there, described, or None."""
    for g in cfg.groups:
        for ds in g.datasets:
            for label, path, is_dir in (("data_dir", ds.data_dir, True), ("jsonl_path", ds.jsonl_path, False),
                                        ("parquet_info_path", ds.parquet_info_path, False)):
                if path is not None and not _reachable(path, is_dir):
                    return f"{g.name}/{ds.name} {label} {path}"
    return None


def prepare(out, tokenizer=None) -> AuditContext:
    """Open the pack and rebuild its config and tokenizer; refuse when re-packing cannot match.

    ``tokenizer`` is an optional ``(tokenizer, special_tokens)`` pair already loaded (tests).
    """
    # here, not at the top: transformers (seconds) is needed only when no tokenizer was handed in
    from prepack.engine.tokenizer import load_tokenizer, recorded_fingerprint, special_token_ids

    pack = Pack.open(out)
    loc, info = pack.location, pack.info
    try:
        cfg = info.stored_config()
    except (KeyError, TypeError, DamagedFile) as e:
        raise AuditRefused(f"cannot audit {loc.base}: the stored config does not rebuild ({e!r})") from None
    if cfg.content_hash() != info.config_hash:
        raise AuditRefused(f"cannot audit {loc.base}: the stored config does not hash to its config_hash")
    missing = unreachable_source(cfg)
    if missing:
        raise AuditRefused(f"cannot audit {loc.base}: source data unreachable: {missing}")
    if tokenizer is None:
        try:
            tokenizer = special_token_ids(load_tokenizer(cfg.tokenizer))
        except (OSError, ValueError, TypeError) as e:
            raise AuditRefused(f"cannot audit {loc.base}: tokenizer {cfg.tokenizer!r} unavailable ({e})") from None
    tok, special = tokenizer
    why = identity_mismatch(info, pack_identity(cfg, recorded_fingerprint(tok), special, info.parent), check_code=True)
    if why:
        raise AuditRefused(f"cannot audit {loc.base}: {why}")
    return AuditContext(pack, cfg, tok, special)


# -- comparisons ----------------------------------------------------------------------------------
def _array_difference(name: str, a: np.ndarray, b: np.ndarray, what=("stored", "re-packed")) -> str | None:
    if a.shape != b.shape:
        return f"{name}: shape {a.shape} {what[0]}, {b.shape} {what[1]}"
    x, y = a.reshape(-1), b.reshape(-1)
    same = x == y
    if x.dtype.kind == "f":
        same |= np.isnan(x) & np.isnan(y)
    if same.all():
        return None
    i = int(np.argmin(same))
    return f"{name}[{i}]: {what[0]} {x[i].item()!r}, {what[1]} {y[i].item()!r}"


def first_difference(stored: PackedBatch, repacked: PackedBatch) -> str | None:
    """The first field (declaration order) where two batches differ, with the values, or None."""
    for name in batch_fields():
        a, b = getattr(stored, name), getattr(repacked, name)
        if name == "origins":
            if len(a) != len(b):
                return f"origins: {len(a)} samples stored, {len(b)} re-packed"
            for i, (oa, ob) in enumerate(zip(a, b)):
                for f in fields(SampleOrigin):
                    va, vb = getattr(oa, f.name), getattr(ob, f.name)
                    if va != vb:
                        return f"origins[{i}].{f.name}: stored {va!r}, re-packed {vb!r}"
        elif isinstance(a, np.ndarray):
            diff = _array_difference(name, np.asarray(a), np.asarray(b))
            if diff:
                return diff
        elif a != b:
            return f"{name}: stored {a!r}, re-packed {b!r}"
    return None


def _json_difference(a: Any, b: Any, path: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{path}.{k}: only in {'stored' if k in a else 're-packed'}"
            d = _json_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: length {len(a)} stored, {len(b)} re-packed"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _json_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path or '.'}: stored {a!r}, re-packed {b!r}"


def state_difference(ctx: AuditContext, index: StreamIndex, shard: int, packer) -> str | None:
    """How the packer's state differs from the stored checkpoint at the start of ``shard``, or None.

    The stored files are checked against the digests the index recorded first (DamagedFile)."""
    doc, pixels = state_to_payload(packer.state())
    if shard in TrimmedShards.read(ctx.loc, index.stream).checkpoints:  # dropped by a trim: its digests
        if (sha256_hex(doc.to_json().encode()), sha256_hex(pixels)) != checkpoint_digests(index, shard):
            return "state differs from the digests the stream index recorded of the checkpoint a trim dropped"
        return None
    doc = json.loads(json.dumps(asdict(doc)))  # tuples -> lists, as stored
    stored_json, stored_pixels = read_checkpoint_files(ctx.loc, index, shard)
    diff = _json_difference(load_checked(stored_json, checkpoint_file(index.stream, shard)), doc)
    if diff:
        return f"state{diff}"
    if stored_pixels != pixels:
        a, b = decode_pixels(stored_pixels), decode_pixels(pixels)
        if len(a) != len(b):
            return f"buffered pictures: {len(a)} stored, {len(b)} re-packed"
        for i, (x, y) in enumerate(zip(a, b)):
            diff = _array_difference(f"buffered picture {i}", x, y)
            if diff:
                return diff
    return None


# -- audit ----------------------------------------------------------------------------------------
def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _stored_record(ctx: AuditContext, shard: ShardEntry, i: int) -> pa.RecordBatch:
    return next(read_shard(ctx.pack, shard, i, verify=False))[1]


def _compare_shard(ctx: AuditContext, batches: Iterator[PackedBatch], shard: ShardEntry, rep: CheckReport) -> bool:
    """Consume the shard's number of batches from ``batches``; one report row; True if identical."""
    target = shard.file
    bad, first = 0, None
    for i, entry in enumerate(shard.records):
        try:
            batch = next(batches, None)
        except Exception as e:  # a source failing now (edited, unreadable) is an audit finding
            return rep.add("re-pack", target, False, f"stream {shard.stream} record {shard.first_record + i}: "
                           f"packing failed: {type(e).__name__}: {_first_line(e)}")
        if batch is None:
            return rep.add("re-pack", target, False, f"stream {shard.stream} record {shard.first_record + i}: "
                           f"the re-packed stream ended after {shard.first_record + i} records")
        record = batch_to_record(batch)
        if record_digest(record) == entry.digest:
            continue
        bad += 1
        if first is None:
            try:
                where = first_difference(record_to_batch(_stored_record(ctx, shard, i)), record_to_batch(record))
            except Exception as e:  # the stored bytes themselves are damaged: verify says where
                where = f"the digest (stored record unreadable, run verify: {type(e).__name__})"
            first = (f"stream {shard.stream} record {shard.first_record + i} (#{i} in shard): differs first in "
                     f"{where or 'the digest only'}")
    if bad:
        more = f"; {bad - 1} more of {len(shard.records)} records differ" if bad > 1 else ""
        return rep.add("re-pack", target, False, first + more)
    return rep.add("re-pack", target, True, f"{_plural(len(shard.records), 'record')} identical")


def _check_state(ctx: AuditContext, index: StreamIndex, shard: int, packer, rep: CheckReport) -> bool:
    rel = checkpoint_file(index.stream, shard, "json")
    try:
        diff = state_difference(ctx, index, shard, packer)
    except PrepackError as e:
        return rep.add("checkpoint", rel, False, str(e))
    return rep.add("checkpoint", rel, diff is None, diff or "state equal")


def audit_shard(ctx: AuditContext, index: StreamIndex, shard: ShardEntry, rep: CheckReport) -> None:
    """Re-pack one shard from its start checkpoint; also compare the end state with the next one."""
    try:  # the checkpoint, or the nearest one a trim kept before it and the batches between packed again
        state = state_at(ctx.loc, index, ctx.cfg, shard.first_record, (ctx.tokenizer, ctx.special)).state
    except PrepackError as e:  # a missing or damaged checkpoint: one line naming it
        rep.add("checkpoint", checkpoint_file(index.stream, shard.shard), False, str(e))
        return
    try:
        packer = open_packer(ctx.cfg, index.stream, ctx.tokenizer, ctx.special, state)
    except Exception as e:  # sources that no longer fit the checkpoint
        rep.add("checkpoint", checkpoint_file(index.stream, shard.shard), False,
                f"cannot start shard {shard.shard} from it: {type(e).__name__}: {_first_line(e)}")
        return
    log.info("auditing %s from %s", shard.file, checkpoint_file(index.stream, shard.shard))
    with packer:  # stops the sources' read-ahead threads however the comparison ends
        if _compare_shard(ctx, iter(packer), shard, rep):
            _check_state(ctx, index, shard.shard + 1, packer, rep)


def audit_stream_from_seed(ctx: AuditContext, index: StreamIndex, rep: CheckReport) -> None:
    """Re-pack a whole stream from its seed, checking each shard and each boundary's checkpoint.  A
    continuation's stream starts from its parent's state at the switch, recomputed from the parent
    (``prepack.run.chain.switch_at``): its first checkpoint is checked against it."""
    link = ctx.pack.info.parent
    try:
        start = None if link is None else switch_at(ctx.pack.parent, index.stream, link.after[index.stream],
                                                    ctx.tokenizer, ctx.special)
        packer = open_packer(ctx.cfg, index.stream, ctx.tokenizer, ctx.special, start)
    except Exception as e:  # sources that no longer open the way they did, a parent that no longer replays
        rep.add("re-pack", f"stream {index.stream}", False, f"cannot start: {type(e).__name__}: {_first_line(e)}")
        return
    log.info("auditing stream %d from %s", index.stream, "its seed" if link is None else
             f"its parent's state after record {link.after[index.stream]}")
    with packer:  # stops the sources' read-ahead threads however the comparison ends
        _check_state(ctx, index, 0, packer, rep)
        batches = iter(packer)
        for shard in index.shards:
            if not _compare_shard(ctx, batches, shard, rep):
                return  # later shards would only repeat the divergence
            _check_state(ctx, index, shard.shard + 1, packer, rep)
    if ctx.pack.done(index.stream) is not None:
        rep.add("budget", f"stream {index.stream}", packer.budget_spent(),
                "stream ends where its budget ends" if packer.budget_spent() else
                f"the budget is not spent after {packer.batches} batches: records are missing from the pack")


def audit_pack(out, *, stream: int | None = None, shard: int | None = None, all_streams: bool = False,
               tokenizer=None, progress: bool = False) -> CheckReport:
    """Audit shard ``shard`` of ``stream`` (None: every shard / every stream); see module doc."""
    if all_streams and shard is not None:
        raise AuditRefused("--all re-packs whole streams from their seeds; it takes no --shard")
    ctx = prepare(out, tokenizer)
    if stream is not None and not 0 <= stream < ctx.pack.num_streams:
        raise AuditRefused(f"stream {stream} is not in this pack ({ctx.pack.num_streams} streams)")
    ids = [stream] if stream is not None else list(range(ctx.pack.num_streams))
    if balances_samples(ctx.pack):
        return _audit_balanced(ctx, ids, shard, progress)
    mode = "from seeds" if all_streams else "from checkpoints"
    rep = CheckReport(f"audit {ctx.loc.base} ({mode})")
    from tqdm import tqdm

    bar = tqdm(unit="batch", desc="re-packing", disable=not progress)
    for s in ids:  # one stream's index in memory at a time
        index = ctx.pack.index(s)
        if all_streams:
            audit_stream_from_seed(ctx, index, rep)
            bar.update(index.num_records)
        else:
            shards = [sh for sh in index.shards if shard is None or sh.shard == shard]
            if shard is not None and not shards and stream is not None:
                raise AuditRefused(f"stream {s} has no committed shard {shard} (it has {len(index.shards)})")
            for sh in shards:
                audit_shard(ctx, index, sh, rep)
                bar.update(len(sh.records))
        ctx.pack.forget(s)
    bar.close()
    if not rep.rows:
        raise AuditRefused(f"nothing to audit: no stream has shard {shard}")
    return rep


def _audit_balanced(ctx: AuditContext, ids: list[int], shard: int | None, progress: bool) -> CheckReport:
    """A balanced-samples pack: each shard re-split from its reference (``balanced_check``); the
    reference, an ordinary pack, is audited from its own checkpoints with ``prepack audit OUT/reference``."""
    reference = open_reference(ctx.pack)
    cfg = ctx.pack.info.stored_config()
    rep = CheckReport(f"audit {ctx.loc.base} (re-split from {REFERENCE_DIR}/; audit that as a pack of its own)")
    from tqdm import tqdm

    bar = tqdm(unit="batch", desc="re-splitting", disable=not progress)
    for s in ids:
        for sh in ctx.pack.index(s).shards:
            if shard is None or sh.shard == shard:
                audit_balanced_shard(ctx.pack, reference, cfg, sh, rep, (ctx.tokenizer, ctx.special))
                bar.update(len(sh.records))
    bar.close()
    if not rep.rows:
        raise AuditRefused(f"nothing to audit: no stream has shard {shard}")
    return rep
