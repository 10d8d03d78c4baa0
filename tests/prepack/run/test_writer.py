"""StreamWriter: round trip, determinism, rollover, compression, commit protocol and crash recovery."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import xxhash
from tests.helpers.fakepack import BatchSpec, make_batch, stream_batches

from prepack.run.commit.atomic_files import AtomicFile, write_json_atomic
from prepack.run.commit.recovery import recover_stream
from prepack.run.commit.writer import Committing, ShardFormat, StreamWriter
from schemas.compression import Compression
from schemas.errors import DamagedFile
from schemas.layout import checkpoint_file
from schemas.location import resolve_location
from schemas.manifest import RecordEntry, ShardEntry, StreamIndex, chain_root, row_facts
from tests.helpers.fakepack import commit_entry
from schemas.packed_batch import batch_fields
from schemas.record import record_digest, record_to_batch

META = {"config_hash": "abc", "tokenizer": "qwen2"}


def write_stream(
    out, batches, stream=0, *, shard_bytes=40_000, compression="zstd:3", **kw
) -> tuple[list[ShardEntry], list[int]]:
    """Write batches; return the entries and the index of the append that returned each one."""
    w = StreamWriter(out, stream, ShardFormat(shard_bytes, compression, META), **kw)
    entries, at = [], []
    for i, b in enumerate(batches):
        e = w.append(b)
        if e is not None:
            entries.append(e)
            at.append(i)
    last = w.finish()
    if last is not None:
        entries.append(last)
        at.append(len(batches) - 1)
    return entries, at


def read_shard(path):
    with pa.OSFile(str(path)) as f:
        reader = pa.ipc.open_file(f)
        return reader.schema, [reader.get_batch(i) for i in range(reader.num_record_batches)]


def assert_batches_equal(a, b):
    for name in batch_fields():
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == np.asarray(y).dtype or name in ("image_norm", "vae_latent_shapes"), name
            assert np.array_equal(x, y), name
        else:
            assert x == y, name


def test_round_trip_and_shard_entries(tmp_path):
    batches = stream_batches(3, 7)
    entries, _ = write_stream(str(tmp_path), batches, stream=3, start=(0, 0))
    assert len(entries) > 1
    i = 0
    for k, e in enumerate(entries):
        path = tmp_path / e.file
        assert e.file == f"stream-00003/shard-{k:05d}.arrow" and (e.stream, e.shard, e.first_record) == (3, k, i)
        raw = path.read_bytes()
        assert e.nbytes == len(raw) and e.xxh3 == xxhash.xxh3_128(raw).hexdigest()
        schema, records = read_shard(path)
        assert schema.metadata[b"config_hash"] == b"abc" and schema.metadata[b"prepack.shard"] == str(k).encode()
        assert len(records) == len(e.records)
        for rec, entry in zip(records, e.records):
            assert entry.digest == record_digest(rec)
            assert (entry.num_tokens, entry.num_samples) == (batches[i].sequence_length, batches[i].num_samples)
            assert_batches_equal(record_to_batch(rec), batches[i])
            i += 1
    assert i == len(batches)
    assert not [f for f in os.listdir(tmp_path / "stream-00003") if f.endswith(".tmp")]
    assert not [f for f in os.listdir(tmp_path / "stream-00003") if f.endswith(".json")]  # caller writes indexes


def test_rollover_ends_a_shard_after_the_record_that_crossed(tmp_path):
    batches = stream_batches(0, 9)
    shard_bytes = 30_000
    entries, at = write_stream(str(tmp_path), batches, shard_bytes=shard_bytes)
    assert len(entries) >= 3
    for e in entries[:-1]:
        assert e.nbytes >= shard_bytes
        # bytes before the footer: under the threshold without the shard's last record, not with it
        schema, records = read_shard(tmp_path / e.file)
        sink = pa.BufferOutputStream()
        w = pa.ipc.new_file(sink, schema, options=Compression.parse("zstd:3").write_options())
        sizes = []
        for r in records:
            w.write_batch(r)
            sizes.append(sink.tell())
        w.close()
        assert sizes[-1] >= shard_bytes and (len(sizes) == 1 or sizes[-2] < shard_bytes)
    assert at[:-1] == [e.first_record + len(e.records) - 1 for e in entries[:-1]]


def test_deterministic_bytes(tmp_path):
    batches = stream_batches(1, 5)
    a, _ = write_stream(str(tmp_path / "a"), batches)
    b, _ = write_stream(str(tmp_path / "b"), stream_batches(1, 5))
    assert a == b
    for e in a:
        assert (tmp_path / "a" / e.file).read_bytes() == (tmp_path / "b" / e.file).read_bytes()


@pytest.mark.parametrize("spec", ["none", "zstd:1", "zstd:19", "zstd:-5", "lz4"])
def test_compression_levels_same_content(tmp_path, spec):
    batches = stream_batches(2, 3)
    ref, _ = write_stream(str(tmp_path / "ref"), batches, compression="zstd:3", shard_bytes=10**9)
    got, _ = write_stream(str(tmp_path / "x"), batches, compression=spec, shard_bytes=10**9)
    assert [r.digest for r in got[0].records] == [r.digest for r in ref[0].records]
    _, records = read_shard(tmp_path / "x" / got[0].file)
    for rec, b in zip(records, batches):
        assert_batches_equal(record_to_batch(rec), b)
    # only the pixel table is compressed, with the spec's codec; token arrays are stored as is
    assert np.ascontiguousarray(batches[0].packed_text_ids).tobytes() in (tmp_path / "x" / got[0].file).read_bytes()
    assert {rec.column("image_pixels_codec")[0].as_py() for rec in records} == {spec.split(":")[0]}


@pytest.mark.parametrize("spec", ["zstd", "gzip:3", "zstd:x", "zstd:99", "zstd:0", "", "ZSTD:3", "zstd:3 "])
def test_bad_compression_strings(tmp_path, spec):
    with pytest.raises(ValueError, match="compression|zstd level"):
        StreamWriter(str(tmp_path), 0, ShardFormat(100, spec, {}))


def test_uri_and_filesystem_outputs(tmp_path):
    batches = stream_batches(0, 2)
    local, _ = write_stream(str(tmp_path / "a"), batches)
    uri, _ = write_stream(f"file://{tmp_path}/b", batches)
    # a non-local pyarrow filesystem takes the generic path (output stream + move)
    sub = pafs.SubTreeFileSystem(str(tmp_path / "c"), pafs.LocalFileSystem())
    (tmp_path / "c").mkdir()
    other, _ = write_stream(resolve_location("", sub), batches)
    for x in (uri, other):
        assert x == local
    assert (tmp_path / "c" / local[0].file).read_bytes() == (tmp_path / "a" / local[0].file).read_bytes()
    write_json_atomic(f"file://{tmp_path}/b", "stream-00000/x.json", {"b": 1, "a": [1, 2]})
    assert json.loads((tmp_path / "b/stream-00000/x.json").read_text()) == {"a": [1, 2], "b": 1}


def test_stream_index_round_trip_and_chain(tmp_path):
    entries = write_stream(str(tmp_path), stream_batches(0, 6), shard_bytes=20_000)[0]
    index = StreamIndex(0, [])
    for e in entries:
        commit_entry(resolve_location(str(tmp_path)), index, e)
    back = StreamIndex.read(resolve_location(str(tmp_path)), 0)
    root = chain_root("", [], b"|")
    for e in entries:
        root = chain_root(root, [r.digest for r in e.records], row_facts(e))
    assert back == index and back.num_records == 6 and back.root == root and len(entries) > 1
    assert back.record(5).digest == entries[-1].records[-1].digest
    with pytest.raises(IndexError):
        back.record(6)
    assert sorted(os.listdir(tmp_path / "stream-00000")) == ["index.arrow"] + sorted(
        f"shard-0000{k}.{kind}" for k in range(len(entries)) for kind in ("arrow", "pixels.arrow"))


def test_damaged_index_is_refused_naming_it(tmp_path):
    out = str(tmp_path)
    entries = write_stream(out, stream_batches(0, 6), shard_bytes=20_000)[0]
    index = StreamIndex(0, [])
    for e in entries:
        commit_entry(resolve_location(out), index, e)
    path = tmp_path / "stream-00000" / "index.arrow"
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(DamagedFile, match=r"stream-00000/index\.arrow: not a readable stream index"):
        StreamIndex.read(resolve_location(out), 0)
    first = index.shards[0]
    forged = [RecordEntry("0" * 32, r.num_tokens, r.num_samples) for r in first.records]
    tampered = StreamIndex(0, [ShardEntry(**{**vars(first), "records": forged})] + index.shards[1:])
    path.write_bytes(tampered.to_bytes())
    with pytest.raises(DamagedFile, match="does not chain to its stored root"):
        StreamIndex.read(resolve_location(out), 0)


def test_abort_leaves_nothing(tmp_path):
    w = StreamWriter(str(tmp_path), 0, ShardFormat(10**9, "zstd:3", {}))
    assert w.append(make_batch(0)) is None
    assert os.listdir(tmp_path / "stream-00000") == ["shard-00000.arrow.tmp"]
    w.abort()
    assert os.listdir(tmp_path / "stream-00000") == []
    assert w.finish() is None


def test_recover_after_crash_then_resume_gives_identical_output(tmp_path):
    batches = stream_batches(4, 10)
    clean = str(tmp_path / "clean")
    full, _ = write_stream(clean, batches, stream=4, shard_bytes=30_000)
    assert len(full) >= 4

    out = str(tmp_path / "crash")
    loc = resolve_location(out)
    w = StreamWriter(out, 4, ShardFormat(30_000, "zstd:3", META))
    index, done, i = StreamIndex(4, []), [], 0
    while len(done) < 3:
        e = w.append(batches[i])
        i += 1
        if e is not None:
            done.append(e)
            write_json_atomic(out, checkpoint_file(4, e.shard + 1), {"state": e.shard + 1})
            if len(done) < 3:
                commit_entry(loc, index, e)
            # else: crash after the shard file rename and its ckpt, before the index lists it
    w.append(batches[i])  # a partial shard in progress ...
    sdir = tmp_path / "crash" / "stream-00004"
    (sdir / "ckpt-00003.arrow").write_bytes(b"x")
    (sdir / "index.arrow.tmp").write_bytes(b"{")
    # ... and the process dies here (no finish, no abort)

    assert (sdir / "shard-00002.pixels.arrow").exists()  # written with its shard, which the index never listed
    recovered = recover_stream(out, 4)
    assert len(recovered.shards) == 2 and recovered.num_records == full[2].first_record
    assert [c.records for c in recovered.shards] == [e.records for e in full[:2]]
    kept = ["ckpt-00001.json", "ckpt-00002.json", "index.arrow", "shard-00000.arrow", "shard-00000.pixels.arrow",
            "shard-00001.arrow", "shard-00001.pixels.arrow"]
    assert sorted(os.listdir(sdir)) == kept
    assert recover_stream(out, 4) == recovered  # idempotent

    rest, _ = write_stream(out, batches[recovered.num_records:], stream=4, shard_bytes=30_000,
                           start=(len(recovered.shards), recovered.num_records))
    assert [(e.shard, e.first_record, e.records, e.xxh3) for e in recovered.shards + rest] == \
        [(e.shard, e.first_record, e.records, e.xxh3) for e in full]
    for e in full:
        assert (tmp_path / "crash" / e.file).read_bytes() == (tmp_path / "clean" / e.file).read_bytes()


def test_recover_empty_and_damaged_streams(tmp_path):
    out = str(tmp_path)
    assert recover_stream(out, 7) == StreamIndex(7, [])
    entries, _ = write_stream(out, stream_batches(0, 6), shard_bytes=20_000)
    assert len(entries) >= 3
    index = StreamIndex(0, [])
    for e in entries:
        commit_entry(resolve_location(out), index, e)
    assert len(recover_stream(out, 0).shards) == len(entries)
    with open(tmp_path / entries[2].file, "r+b") as f:
        f.truncate(100)
    with pytest.raises(DamagedFile, match="shard-00002.arrow: committed shard file missing or not"):
        recover_stream(out, 0)


def test_empty_lists_round_trip(tmp_path):
    b = make_batch(3, BatchSpec(vit=False, vae=False, labels=False))
    assert len(b.image_pixels) == 0 and len(b.packed_label_ids) == 0
    e = write_stream(str(tmp_path), [b])[0][0]
    _, [rec] = read_shard(tmp_path / e.file)
    assert_batches_equal(record_to_batch(rec), b)


def test_write_bytes_atomic_replaces_whole_file(tmp_path):
    from prepack.run.commit.atomic_files import write_bytes_atomic

    write_bytes_atomic(str(tmp_path), "stream-00001/ckpt-00001.arrow", b"first version, longer")
    write_bytes_atomic(str(tmp_path), "stream-00001/ckpt-00001.arrow", b"second")
    assert (tmp_path / "stream-00001/ckpt-00001.arrow").read_bytes() == b"second"
    assert os.listdir(tmp_path / "stream-00001") == ["ckpt-00001.arrow"]


def test_a_committing_writer_makes_the_whole_commit(tmp_path):
    """Given the index and the state, the writer writes ckpt-00000, then per shard its lineage, its
    end checkpoint and the index row; leaving the block drops a shard in progress."""
    import hashlib

    import pyarrow.parquet as pq

    out, batches = str(tmp_path), stream_batches(5, 6)
    loc = resolve_location(out)
    states = iter(range(100))

    def state():
        n = next(states)
        return f'{{"state": {n}}}'.encode(), bytes([n])

    index = StreamIndex(5, [])
    with StreamWriter(out, 5, ShardFormat(20_000, "zstd:3", META), Committing(index, state)) as w:
        entries = [e for e in (w.append(b) for b in batches[:-1]) if e is not None]
        w.append(batches[-1])
    assert len(entries) >= 2 and StreamIndex.read(loc, 5) == index and index.shards == entries
    sdir = tmp_path / "stream-00005"
    assert not [f for f in os.listdir(sdir) if f.endswith(".tmp")]  # the last shard was dropped, not committed
    assert (sdir / "ckpt-00000.arrow").read_bytes() == bytes([0])
    for k, e in enumerate(entries):
        ckpt = (sdir / f"ckpt-{k + 1:05d}.json").read_bytes()
        assert (e.ckpt_json_sha256, e.ckpt_arrow_sha256) == (hashlib.sha256(ckpt).hexdigest(),
                                                              hashlib.sha256(bytes([k + 1])).hexdigest())
        lineage = (sdir / f"shard-{k:05d}.lineage.parquet").read_bytes()
        assert e.lineage_sha256 == hashlib.sha256(lineage).hexdigest()
        rows = pq.read_table(pa.BufferReader(lineage))
        assert rows.num_rows == e.lineage_rows == sum(r.num_samples for r in e.records)
        assert set(rows.column("record").to_pylist()) == set(range(e.first_record, e.first_record + len(e.records)))

    empty = StreamIndex(6, [])
    with StreamWriter(out, 6, ShardFormat(20_000, "zstd:3", META), Committing(empty, state)) as w:
        assert w.finish() is None
    assert StreamIndex.read(loc, 6) == empty and empty.ckpt0_json_sha256  # no record: the index still records ckpt-0


def test_two_writers_of_one_small_file_at_once_each_publish_a_whole_file(tmp_path):
    """Two jobs starting on one new output both write its pack.json: interleaved, each renames its
    own complete file into place (with one shared temporary name the second found it gone)."""
    loc = resolve_location(str(tmp_path))
    first, second = AtomicFile(loc, "pack.json"), AtomicFile(loc, "pack.json")
    first.raw.write(b'{"who": 1}')
    second.raw.write(b'{"who": 2}')
    first.commit()
    assert json.loads((tmp_path / "pack.json").read_bytes()) == {"who": 1}
    second.commit()
    assert json.loads((tmp_path / "pack.json").read_bytes()) == {"who": 2}
    assert os.listdir(tmp_path) == ["pack.json"]  # no temporary file left
