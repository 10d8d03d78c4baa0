"""verify and audit on real packs built in-process (pack_one_stream + finalize, no Ray).

verify must pass on a fresh pack and name the file and the record after one flipped byte; audit
must pass from checkpoints and from seeds, and name the record (and its first differing field)
after a source row is edited; it must refuse when fingerprints or data do not match.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers.fakepack import make_batch
from tests.helpers.packs import build_pack
from loader import open_stream
from loader.reader import Pack, read_shard
from prepack.run.commit.checkpoint_files import read_checkpoint
from prepack.tools.audit import AuditRefused, audit_pack, first_difference
from prepack.tools.lineage_queries import scan_lineage
from schemas.documents import dump_checked, load_checked
from schemas.errors import DamagedFile, PackFormatError, PackIntegrityError
from prepack.cli import main
from prepack.tools.lineage_queries import batches_with_row
from prepack.tools.verify import verify_pack
from prepack.run.commit.atomic_files import write_bytes_atomic, write_json_atomic
from schemas.compression import Compression
from schemas.config_file import load_config
from schemas.layout import MANIFEST_NAME, PACK_INFO_NAME, checkpoint_file, done_file, index_file, stream_lineage_file
from schemas.pack_info import FORMAT_VERSION, PackInfo
from schemas.location import resolve_location
from schemas.manifest import StreamIndex

@pytest.fixture(scope="module")
def pack(tmp_path_factory, tokenizer_and_special) -> str:
    return build_pack(str(tmp_path_factory.mktemp("pack")), tokenizer_and_special)


def indexes_of(out: str) -> list[StreamIndex]:
    pack = Pack.open(out)
    return [pack.index(s) for s in range(pack.num_streams)]


def identity_of(out: str) -> dict:
    return load_checked(open(os.path.join(out, PACK_INFO_NAME), "rb").read(), PACK_INFO_NAME)


def write_checked(out: str, rel: str, d: dict) -> None:
    write_bytes_atomic(out, rel, dump_checked(d))


def copy_pack(src: str, dst) -> str:
    out = os.path.join(str(dst), "out")
    shutil.copytree(src, out)
    return out


# -- verify ---------------------------------------------------------------------------------------
def test_verify_passes_on_fresh_pack(pack):
    indexes = indexes_of(pack)
    shards = [sh for ix in indexes for sh in ix.shards]
    assert len(shards) >= 4 and any(len(sh.records) > 1 for sh in shards)
    report = verify_pack(pack)
    assert report.ok, "\n".join(report.lines())
    targets = {(r.check, r.target) for r in report.rows}
    for ix in indexes:
        s = ix.stream
        assert {("shard", sh.file) for sh in ix.shards} <= targets
        assert {("checkpoint", checkpoint_file(s, k, ext)) for k in range(len(ix.shards) + 1) for ext in ("json", "arrow")} <= targets
        assert {("stream index", index_file(s)), ("stream done", done_file(s)), ("lineage", stream_lineage_file(s)),
                ("lineage rows", stream_lineage_file(s))} <= targets
    assert ("manifest", MANIFEST_NAME) in targets and ("config hash", PACK_INFO_NAME) in targets
    assert main(["verify", pack]) == 0


VICTIMS = {"pack": PACK_INFO_NAME, "manifest": MANIFEST_NAME, "done": done_file(1), "index": index_file(1),
           "ckpt-json": checkpoint_file(1, 1, "json"), "ckpt-arrow": checkpoint_file(1, 2, "arrow"),
           "shard": "stream-00001/shard-00001.arrow", "lineage": stream_lineage_file(0)}


def damage_offsets(n: int) -> list[int]:
    """Where to flip a byte: the first and last, and one at each sixteenth of the file, so a
    test fails wherever a file's unchecked bytes happen to lie on this machine."""
    return sorted({0, n - 1, *(n * i // 16 for i in range(1, 16))})


@pytest.mark.parametrize("victim", sorted(VICTIMS))
def test_verify_catches_every_changed_byte_naming_the_file(pack, tmp_path, victim):
    out = copy_pack(pack, tmp_path)
    rel = VICTIMS[victim]
    path = os.path.join(out, rel)
    clean = open(path, "rb").read()
    damages = [(f"flip byte {i}", clean[:i] + bytes([clean[i] ^ 0x01]) + clean[i + 1:]) for i in damage_offsets(len(clean))]
    damages += [(f"truncate to {n}", clean[:n]) for n in (0, len(clean) // 2, len(clean) - 1)]
    damages += [("append a byte", clean + b"\n"), ("delete", None)]
    missed = []
    for what, data in damages:
        if data is None:
            os.remove(path)
        else:
            open(path, "wb").write(data)
        report = verify_pack(out)
        if report.ok or not [r for r in report.failures() if rel in r.target or rel in r.detail]:
            missed.append(f"{what}: " + "; ".join(report.lines()[-3:]))
        open(path, "wb").write(clean)
    assert verify_pack(out).ok
    assert not missed, f"verify missed damage to {rel}:\n" + "\n".join(missed)


def test_verify_cli_exits_nonzero_on_damage(pack, tmp_path):
    out = copy_pack(pack, tmp_path)
    path = os.path.join(out, index_file(1))
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0x01
    open(path, "wb").write(bytes(data))
    assert main(["verify", out]) == 1


def test_verify_reports_a_finished_pack_without_manifest(pack, tmp_path, capsys):
    out = copy_pack(pack, tmp_path)
    os.remove(os.path.join(out, MANIFEST_NAME))
    report = verify_pack(out)
    [row] = [r for r in report.rows if r.check == "manifest"]
    assert not row.ok and "every stream is done" in row.detail and "prepack run" in row.detail
    assert main(["verify", out]) == 1


def record_byte_ranges(path: str, compression: str) -> list[tuple[int, int]]:
    """[start, end) of each record batch message in an Arrow IPC file, computed independently of
    the code under test: file magic (8 bytes), the schema message, then the batch messages."""
    data = open(path, "rb").read()
    reader = pa.ipc.open_file(pa.BufferReader(data))
    opts = Compression.parse(compression).write_options()

    def stream_len(batches) -> int:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, reader.schema, options=opts) as w:
            for b in batches:
                w.write_batch(b)
        return sink.getvalue().size

    header = stream_len([]) - 8  # minus the end-of-stream marker
    pos, ranges = 8 + header, []
    for i in range(reader.num_record_batches):
        n = stream_len([reader.get_batch(i)]) - header - 8
        assert data[pos : pos + 4] == b"\xff\xff\xff\xff", "not at an IPC message start"
        ranges.append((pos, pos + n))
        pos += n
    return ranges


def test_verify_names_file_and_record_after_a_flipped_byte(pack, tmp_path, capsys):
    out = copy_pack(pack, tmp_path)
    shard = next(sh for sh in indexes_of(out)[1].shards if len(sh.records) > 1)
    path = os.path.join(out, shard.file)
    ranges = record_byte_ranges(path, identity_of(out)["config"]["prepack"]["compression"])
    victim = len(ranges) - 1
    a, b = ranges[victim]
    data = bytearray(open(path, "rb").read())
    data[(a + b) // 2] ^= 0x5A
    open(path, "wb").write(bytes(data))

    report = verify_pack(out)
    assert not report.ok
    failed = report.failures()
    assert [r.target for r in failed] == [shard.file]
    assert "XXH3-128" in failed[0].detail and f"stream 1, record {shard.first_record}" in failed[0].detail
    # the loader (default check) names the very record
    with pytest.raises(PackIntegrityError, match=f"stream 1, record {shard.first_record + victim}: record content digest"):
        list(read_shard(Pack.open(out), shard))
    # every other file still verifies
    assert all(r.ok for r in report.rows if r.target != shard.file)
    assert main(["verify", out]) == 1
    text = capsys.readouterr().out
    assert shard.file in text and "FAIL" in text


def test_verify_checks_identity_metadata_and_lineage(pack, tmp_path):
    out = copy_pack(pack, tmp_path)
    ident = identity_of(out)
    ident["code_fingerprint"] = "0" * 16
    ident["config_hash"] = "f" * 64
    write_checked(out, PACK_INFO_NAME, ident)
    lineage = os.path.join(out, stream_lineage_file(1))
    table = pq.read_table(lineage)
    pq.write_table(table.slice(1), lineage)
    report = verify_pack(out)
    failed = {(r.check, r.target) for r in report.failures()}
    shards = {sh.file for ix in indexes_of(out) for sh in ix.shards}
    assert failed == {("shard", f) for f in shards} | {("lineage", stream_lineage_file(1)), ("config hash", PACK_INFO_NAME),
                                                     ("manifest", MANIFEST_NAME)}
    assert all("prepack.config_hash" in r.detail for r in report.failures() if r.check == "shard")


@pytest.mark.parametrize("old", [1, 2])
def test_old_format_is_refused_with_one_line(pack, tmp_path, capsys, old):
    out = copy_pack(pack, tmp_path)
    ident = identity_of(out)
    if old == 1:
        del ident["format_version"]
        ident["manifest_version"] = 1
    else:  # format 2: stream indexes without their seal
        ident["format_version"] = 2
    write_checked(out, PACK_INFO_NAME, ident)
    for cmd in (["verify", out], ["stats", out], ["audit", out], ["inspect", out, "--stream", "0", "--record", "0"]):
        assert main(cmd) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"on-disk format {old}" in err[0] and "Re-pack it" in err[0], err
    with pytest.raises(PackFormatError, match=f"reads format {FORMAT_VERSION}"):
        open_stream(out, 0)


# -- audit ----------------------------------------------------------------------------------------
def test_stored_config_round_trips(pack):
    identity = identity_of(pack)
    cfg = PackInfo.from_dict(identity).stored_config()
    assert cfg.content_hash() == identity["config_hash"]
    assert cfg == load_config(identity["config_path"])


def test_audit_passes_for_one_shard_every_shard_and_from_seeds(pack, tokenizer_and_special):
    indexes = indexes_of(pack)
    one = audit_pack(pack, stream=1, shard=1, tokenizer=tokenizer_and_special)
    assert one.ok, "\n".join(one.lines())
    assert [(r.check, r.target) for r in one.rows] == [("re-pack", indexes[1].shards[1].file),
                                                      ("checkpoint", checkpoint_file(1, 2))]
    every = audit_pack(pack, tokenizer=tokenizer_and_special)
    assert every.ok and sum(r.check == "re-pack" for r in every.rows) == sum(len(ix.shards) for ix in indexes)
    seeded = audit_pack(pack, all_streams=True, tokenizer=tokenizer_and_special)
    assert seeded.ok, "\n".join(seeded.lines())
    ckpts = [r.target for r in seeded.rows if r.check == "checkpoint"]
    assert ckpts == [checkpoint_file(ix.stream, k) for ix in indexes for k in range(len(ix.shards) + 1)]
    assert [r.target for r in seeded.rows if r.check == "budget"] == ["stream 0", "stream 1"]


def _swap_words(text: str) -> str:
    """Same words, two of them swapped: same token count, different token ids."""
    words = text.split(" ")
    j = next(j for j in range(2, len(words) - 1) if words[j] != words[1])
    words[1], words[j] = words[j], words[1]
    return " ".join(words)


def _edit_t2i_row(path: str, row_group: int, row: int) -> None:
    pf = pq.ParquetFile(path)
    sizes = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
    rows = pf.read().to_pylist()
    i = sum(sizes[:row_group]) + row
    caps = json.loads(rows[i]["captions"])
    rows[i]["captions"] = json.dumps({k: _swap_words(v) for k, v in caps.items()})
    pq.write_table(pa.Table.from_pylist(rows, schema=pf.schema_arrow), path, row_group_size=sizes[0])


def _edit_jsonl_line(path: str, line_no: int) -> None:
    lines = open(path, "rb").read().split(b"\n")
    item = json.loads(lines[line_no])
    for turn in item["conversations"]:
        if turn["from"] == "gpt":
            turn["value"] = _swap_words(turn["value"])
    lines[line_no] = json.dumps(item).encode()
    open(path, "wb").write(b"\n".join(lines))


def _buffered_at(out: str, stream: int, shard: int) -> set[tuple]:
    doc = json.load(open(os.path.join(out, checkpoint_file(stream, shard))))
    return {(s["origin"]["source_file"], s["origin"]["source_row_group"], s["origin"]["source_row"]) for s in doc["buffer"]}


@pytest.mark.parametrize("group", ["t2i_pretrain", "vlm_sft"])
@pytest.mark.slow  # packs and audits twice
def test_audit_names_record_and_field_after_a_source_row_is_edited(tmp_path, tokenizer_and_special, group):
    out = build_pack(str(tmp_path), tokenizer_and_special, seed=1)
    assert audit_pack(out, stream=0, tokenizer=tokenizer_and_special).ok
    index0 = indexes_of(out)[0]
    lineage = scan_lineage(out).collect().to_dicts()
    # a row of the group, packed in stream 0 after its first shard, not carried over in a checkpoint buffer
    shard_of = {sh.first_record + i: sh.shard for sh in index0.shards for i in range(len(sh.records))}
    for row in lineage:
        if row["stream"] != 0 or row["group"] != group or shard_of[row["record"]] == 0:
            continue
        key = (row["source_file"], row["source_row_group"], row["source_row"])
        hits = batches_with_row(out, key[0], key[2], key[1])
        first = hits.row(0, named=True)
        if first["record"] == row["record"] and key not in _buffered_at(out, 0, shard_of[row["record"]]):
            break
    else:
        pytest.fail("no suitable row in the test pack")
    if group == "t2i_pretrain":
        _edit_t2i_row(key[0], key[1], key[2])
    else:
        _edit_jsonl_line(key[0], key[2])
    record = first["record"]
    shard = index0.shards[shard_of[record]]

    for report in (audit_pack(out, stream=0, tokenizer=tokenizer_and_special),
                   audit_pack(out, stream=0, all_streams=True, tokenizer=tokenizer_and_special)):
        failed = report.failures()
        assert failed, "\n".join(report.lines())
        assert failed[0].target == shard.file and failed[0].check == "re-pack"
        assert failed[0].detail.startswith(f"stream 0 record {record} (#{record - shard.first_record} in shard): "
                                           "differs first in packed_text_ids[")
        # everything before the edited record still re-packs identically
        before = report.rows[: report.rows.index(failed[0])]
        assert before and all(r.ok for r in before)
    # the other stream reads other files or lines and is unaffected... only if it never packed the row
    if batches_with_row(out, key[0], key[2], key[1]).filter(stream=1).height == 0:
        assert audit_pack(out, stream=1, tokenizer=tokenizer_and_special).ok


@pytest.mark.slow  # re-packs every stream to audit
def test_audit_reports_a_tampered_checkpoint(pack, tmp_path, tokenizer_and_special):
    out = copy_pack(pack, tmp_path)
    path = os.path.join(out, checkpoint_file(0, 2))
    doc = json.load(open(path))
    doc["counters"]["samples_read"]["t2i_pretrain"] += 1
    write_json_atomic(out, checkpoint_file(0, 2), doc)
    seeded = audit_pack(out, stream=0, all_streams=True, tokenizer=tokenizer_and_special)
    damaged = f"{path}: checkpoint is damaged (sha256 differs from the stream index)"
    assert [(r.check, r.target, r.detail) for r in seeded.failures()] == [("checkpoint", checkpoint_file(0, 2), damaged)]
    # re-packing shard 1 alone ends at the (tampered) ckpt-2 and notices too; shard 2 refuses to start from it
    assert not audit_pack(out, stream=0, shard=1, tokenizer=tokenizer_and_special).ok
    from_it = audit_pack(out, stream=0, shard=2, tokenizer=tokenizer_and_special)
    assert [r.detail for r in from_it.failures()] == [damaged]
    # and a resume refuses it with one line naming the file
    with pytest.raises(DamagedFile, match="ckpt-00002.json: checkpoint is damaged"):
        read_checkpoint(resolve_location(out), indexes_of(out)[0], 2)


@pytest.mark.slow  # packs again and audits
def test_audit_refuses_when_fingerprints_or_data_differ(pack, tmp_path, tokenizer_and_special, capsys):
    out = copy_pack(pack, tmp_path)
    man = identity_of(out)
    for key, expected in (("tokenizer_fingerprint", "the tokenizer differs"), ("code_fingerprint", "the packing code differs")):
        changed = json.loads(json.dumps(man))
        changed[key] = "f" * 16
        write_checked(out, PACK_INFO_NAME, changed)
        with pytest.raises(AuditRefused, match=expected):
            audit_pack(out, tokenizer=tokenizer_and_special)
    # source data moved away: refused before anything is re-packed (and before loading a tokenizer)
    moved = copy.deepcopy(man)
    moved["config"]["groups"][0]["datasets"][0]["data_dir"] = str(tmp_path / "gone")
    cfg = PackInfo.from_dict(moved).stored_config()
    moved["config_hash"] = cfg.content_hash()
    write_checked(out, PACK_INFO_NAME, moved)
    with pytest.raises(AuditRefused, match="source data unreachable: t2i_pretrain/t2i data_dir"):
        audit_pack(out, tokenizer=tokenizer_and_special)
    assert main(["audit", out]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "source data unreachable" in err[0]
    write_checked(out, PACK_INFO_NAME, man)
    with pytest.raises(AuditRefused, match="no committed shard 99"):
        audit_pack(out, stream=0, shard=99, tokenizer=tokenizer_and_special)
    with pytest.raises(AuditRefused, match="takes no --shard"):
        audit_pack(out, shard=0, all_streams=True, tokenizer=tokenizer_and_special)


def test_first_difference_names_the_first_field_in_declaration_order():
    a = make_batch(3)
    assert first_difference(a, make_batch(3)) is None
    b = make_batch(3)
    b.packed_label_ids = b.packed_label_ids.copy()
    b.packed_label_ids[-1] += 1
    b.origins = [replace(o) for o in b.origins]
    b.origins[-1].source_row += 1
    n = len(b.packed_label_ids) - 1
    assert first_difference(a, b) == f"packed_label_ids[{n}]: stored {int(a.packed_label_ids[n])}, re-packed {int(b.packed_label_ids[n])}"
    b.packed_label_ids = a.packed_label_ids
    assert first_difference(a, b).startswith(f"origins[{len(a.origins) - 1}].source_row: ")
    b.packed_timesteps = np.append(a.packed_timesteps, np.float32(0))
    assert first_difference(a, b).startswith("packed_timesteps: shape")
