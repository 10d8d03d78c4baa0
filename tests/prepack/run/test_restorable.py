"""A trim never deletes the only copy: a shard goes only while a restore could pack it again.

Each shard records the sources it read (``shard-k.sources.json``).  What must hold:

- the record is complete: with every source file it does not list removed (and the parts of the
  parquet files it does not list zeroed), each shard still restores byte for byte;
- a source deleted, or rewritten with the same size, keeps the shards that read it (named, the
  others trimmed and restorable), ``verify --restorable`` lists trimmed shards it can no longer
  restore, and ``restore`` refuses in one line naming the file before doing any work.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from loader import PackedShardDataset
from loader.reader import Pack
from prepack.cli import main
from prepack.run.bounded.checkpoint_ladder import nearest_kept
from prepack.run.bounded.restore import restore
from prepack.run.bounded.trim import trim_shards
from prepack.run.bounded.trim_policy import trim_pack
from prepack.tools.verify import verify_pack
from schemas.errors import PackRefused
from schemas.layout import shard_sources_file
from schemas.manifest import TrimmedShards
from schemas.sources import LISTING, ShardSources
from tests.helpers.packs import KNOBS, make_video_dataset, pack_in_process, small_dataset

pytestmark = pytest.mark.slow


def _everything(out: str) -> dict:
    ds = PackedShardDataset(out, rank=0, world_size=1)
    for _ in ds:
        pass
    return json.loads(json.dumps(ds.state_dict()))


def _pack(root: str, tokenizer_and_special, video: bool) -> dict:
    if video:
        ds = make_video_dataset(root)
        config = ds.config(knobs=KNOBS, num_workers=2, prepack={"batches_per_stream": 6, "shard_bytes": 120_000})
    else:
        config = small_dataset(root, batches=8, shard_bytes=150_000, edit=True)
    out = pack_in_process(config, os.path.join(root, "out"), tokenizer_and_special)
    return {"root": root, "data": os.path.join(root, "data"), "out": out}


@pytest.fixture(scope="module", params=["images", "video"])
def original(request, tmp_path_factory, tokenizer_and_special):
    return _pack(str(tmp_path_factory.mktemp(f"restorable-{request.param}")), tokenizer_and_special,
                 request.param == "video")


@pytest.fixture
def pack(original, tmp_path):
    """A copy of the pack and of its data (the data is changed by the tests, then put back)."""
    out = str(tmp_path / "out")
    shutil.copytree(original["out"], out)
    backup = str(tmp_path / "data-backup")
    shutil.copytree(original["data"], backup)
    yield out
    shutil.rmtree(original["data"])
    shutil.copytree(backup, original["data"])


def _shards(out: str) -> list[tuple[int, object]]:
    p = Pack.open(out)
    return [(s, sh) for s in range(p.num_streams) for sh in p.index(s).shards]


def _data_files(data: str) -> list[str]:
    return sorted(os.path.join(d, n) for d, _, names in os.walk(data) for n in names)


def _keep_only_what_is_listed(data: str, sources: ShardSources) -> int:
    """Remove every data file the record does not list (inside listed folders: zero it, same size, so
    the listing stays), and zero the bytes of listed files outside the parts listed.  Files changed."""
    parts: dict[str, list[tuple[int, int]]] = {}
    listed_dirs = set()
    for ident in sources.sources:
        if ident.kind == LISTING:
            listed_dirs.add(os.path.normpath(ident.path))
        else:
            parts.setdefault(os.path.normpath(ident.path), []).append((ident.offset, ident.length))
    changed = 0
    for path in _data_files(data):
        spans = parts.get(os.path.normpath(path))
        if spans is None and os.path.dirname(path) not in listed_dirs:
            os.remove(path)
            changed += 1
            continue
        size = os.path.getsize(path)
        keep = bytearray(size)
        for offset, length in spans or []:
            end = size if length < 0 else offset + length
            keep[offset:end] = b"\1" * (end - offset)
        if all(keep):
            continue
        with open(path, "r+b") as f:
            data_bytes = bytearray(f.read())
            for i in range(size):
                if not keep[i]:
                    data_bytes[i] = 0
            f.seek(0)
            f.write(data_bytes)
        changed += 1
    return changed


def test_each_shard_restores_from_the_sources_it_lists_alone(original, pack, tokenizer_and_special):
    p = Pack.open(pack)
    backup = os.path.join(os.path.dirname(pack), "data-backup")
    changed = 0
    for stream, sh in _shards(pack):
        sources = ShardSources.read(p.location, stream, sh.shard)
        assert sources is not None and sources.tokenizer_fingerprint == p.info.tokenizer_fingerprint
        original_bytes = open(os.path.join(pack, sh.file), "rb").read()
        trim_shards(p, stream, [sh])
        changed += _keep_only_what_is_listed(original["data"], sources)
        done = restore(pack, {stream: (p.switch(stream) + sh.first_record,) * 2}, tokenizer=tokenizer_and_special)
        assert done == {stream: [sh.shard]}
        assert open(os.path.join(pack, sh.file), "rb").read() == original_bytes
        shutil.rmtree(original["data"])
        shutil.copytree(backup, original["data"])
    assert changed > 0, "no shard's record left any data file out: the test proves nothing"


def _readers(out: str, path: str, at: "int | None" = None) -> set[tuple[int, int]]:
    """The shards whose record lists ``path`` (reading byte ``at`` of it, when given)."""
    p = Pack.open(out)
    got = set()
    for stream, sh in _shards(out):
        for ident in ShardSources.read(p.location, stream, sh.shard).sources:
            if ident.kind == LISTING or os.path.normpath(ident.path) != os.path.normpath(path):
                continue
            end = ident.size if ident.length < 0 else ident.offset + ident.length
            if at is None or ident.offset <= at < end:
                got.add((stream, sh.shard))
    return got


def _victim(out: str, data: str, pick, change) -> tuple[str, set[tuple[int, int]]]:
    """A data file ``pick`` accepts whose ``change`` some shards' restores read and others' do not;
    the shards that read it.  ``change``: ``_delete`` or ``_rewrite_same_size`` (its middle byte)."""
    total = len(_shards(out))
    for path in _data_files(data):
        at = None if change is _delete else os.path.getsize(path) // 2
        got = _readers(out, path, at)
        if pick(path) and 0 < len(got) < total:
            return path, got
    raise AssertionError("no data file is read by some shards only")


def _delete(path: str) -> None:
    os.remove(path)


def _rewrite_same_size(path: str) -> None:
    st = os.stat(path)
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        middle = len(data) // 2
        data[middle] ^= 0xFF
        f.seek(0)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its modification time put back


CHANGES = {
    "image deleted": (lambda p: p.endswith((".jpg", ".png", ".mp4")), _delete),
    "image rewritten, same size": (lambda p: p.endswith((".jpg", ".png", ".mp4")), _rewrite_same_size),
    "parquet rewritten, same size": (lambda p: p.endswith(".parquet"), _rewrite_same_size),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_source_keeps_the_shards_that_read_it(original, pack, tokenizer_and_special, change, caplog):
    pick, how = CHANGES[change]
    try:
        victim, readers = _victim(pack, original["data"], pick, how)
    except AssertionError:
        pytest.skip(f"this dataset has no such file read by some shards only ({change})")
    how(victim)
    result = trim_pack(pack, [_everything(pack)], Pack.open(pack).info.tokenizer_fingerprint)
    assert set(result.kept) == readers
    assert all(victim in why for why in result.kept.values())
    assert sum(victim in r.getMessage() for r in caplog.records) == 1  # said once, naming the source
    trimmed = {(s, k) for s, ks in result.shards.items() for k in ks}
    assert trimmed == {(s, sh.shard) for s, sh in _shards(pack)} - readers
    rep = verify_pack(pack, metadata_only=True, restorable=True)
    assert rep.ok, [r for r in rep.rows if not r.ok]  # what was trimmed can be packed again
    restore(pack, {s: (0, None) for s in range(Pack.open(pack).num_streams)}, tokenizer=tokenizer_and_special)
    assert verify_pack(pack).ok  # restored byte for byte


def test_restore_refuses_and_verify_names_what_a_changed_source_broke(original, pack, tokenizer_and_special,
                                                                     capsys):
    trim_pack(pack, [_everything(pack)])
    p = Pack.open(pack)
    assert all(TrimmedShards.read(p.location, s).shards for s in range(p.num_streams))
    victim, readers = _victim(pack, original["data"], lambda path: True, _rewrite_same_size)
    _rewrite_same_size(victim)
    report = verify_pack(pack, metadata_only=True, restorable=True)
    bad = [r for r in report.rows if not r.ok]
    # a shard whose checkpoint the trim dropped is packed again from the nearest kept one: the shards between count
    broken = set()
    for s in range(p.num_streams):
        dropped = set(TrimmedShards.read(p.location, s).checkpoints)
        broken |= {(s, k) for k in TrimmedShards.read(p.location, s).shards
                   if any((s, m) in readers for m in range(nearest_kept(k, dropped), k + 1))}
    assert broken >= readers
    assert not report.ok and {r.target for r in bad} == {Pack.open(pack).index(s).shards[k].file for s, k in broken}
    assert all(victim in r.detail and "content changed" in r.detail for r in bad)
    stream, shard = min(readers)
    with pytest.raises(PackRefused, match="cannot be restored: source .*content changed"):
        restore(pack, {stream: (0, None)}, tokenizer=tokenizer_and_special)
    assert not os.path.exists(os.path.join(pack, p.index(stream).shards[shard].file))  # no work was done
    assert main(["restore", pack, "--streams", str(stream)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and victim in err[0]
    assert main(["verify", pack, "--metadata-only", "--restorable"]) == 1
    shutil.rmtree(original["data"])  # the source put back: everything restores
    shutil.copytree(os.path.join(os.path.dirname(pack), "data-backup"), original["data"])
    restore(pack, {s: (0, None) for s in range(p.num_streams)}, tokenizer=tokenizer_and_special)
    assert verify_pack(pack, restorable=True).ok


@pytest.mark.parametrize("kind", [".jpg", ".parquet"])
def test_an_object_overwritten_on_the_store_keeps_its_shards(s3, tmp_path, tokenizer_and_special, kind):
    from tests.helpers.s3server import config_on_s3

    root = str(tmp_path)
    config = small_dataset(root, batches=6, shard_bytes=150_000, edit=True)
    data = os.path.join(root, "data")
    uri = s3.new_prefix("restorable")
    s3.upload(data, uri)
    out = pack_in_process(config_on_s3(config, data, uri, s3), os.path.join(root, "out"), tokenizer_and_special)
    victim, readers = _victim_uri(out, kind)
    fs = s3.filesystem()
    key = victim.split("://", 1)[1]
    with fs.open_input_stream(key) as f:
        body = bytearray(f.read())
    body[len(body) // 2] ^= 0xFF
    with fs.open_output_stream(key) as f:  # the same size, other bytes
        f.write(bytes(body))
    result = trim_pack(out, [_everything(out)])
    assert set(result.kept) == readers and all(victim in why for why in result.kept.values())
    assert result.shards, "the shards that did not read it are trimmed"
    assert verify_pack(out, metadata_only=True, restorable=True).ok
    restore(out, {s: (0, None) for s in range(Pack.open(out).num_streams)}, tokenizer=tokenizer_and_special)
    assert verify_pack(out).ok


def _victim_uri(out: str, kind: str) -> tuple[str, set[tuple[int, int]]]:
    """An object of ``kind`` whose middle byte some shards' restores read and others' do not."""
    p = Pack.open(out)
    readers: dict[str, set[tuple[int, int]]] = {}
    for stream, sh in _shards(out):
        for ident in ShardSources.read(p.location, stream, sh.shard).sources:
            end = ident.size if ident.length < 0 else ident.offset + ident.length
            if ident.kind != LISTING and ident.path.endswith(kind) and ident.offset <= ident.size // 2 < end:
                readers.setdefault(ident.path, set()).add((stream, sh.shard))
    total = len(_shards(out))
    picks = sorted((path, got) for path, got in readers.items() if 0 < len(got) < total)
    assert picks, f"no {kind} object is read by some shards only"
    return picks[0]


def test_a_damaged_or_missing_record_of_sources_is_named_and_keeps_its_shard(original, pack):
    p = Pack.open(pack)
    (s0, first), (s1, second) = _shards(pack)[0], _shards(pack)[-1]
    damaged = os.path.join(pack, shard_sources_file(s0, first.shard))
    with open(damaged, "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 1]))
    os.remove(os.path.join(pack, shard_sources_file(s1, second.shard)))
    report = verify_pack(pack)
    bad = {r.target: r.detail for r in report.rows if not r.ok}
    assert set(bad) == {shard_sources_file(s0, first.shard), shard_sources_file(s1, second.shard)}, bad
    assert "missing" in bad[shard_sources_file(s1, second.shard)]
    result = trim_pack(pack, [_everything(pack)], p.info.tokenizer_fingerprint)
    assert {(s0, first.shard), (s1, second.shard)} <= set(result.kept)
    assert "damaged" in result.kept[(s0, first.shard)] and "no record" in result.kept[(s1, second.shard)]
