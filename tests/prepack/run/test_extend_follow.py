"""Issue-9 behaviour of the pack format: read while packing, several jobs, extend, follow.

Packs are made in-process (``RunOptions(inline=True)``, the driver without Ray); one test follows
a pack that another process is writing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from loader import PackedShardDataset, open_stream
from loader.reader import Pack
from prepack.run.driver import RunOptions, run_pack
from prepack.tools.verify import verify_pack
from schemas.errors import PackRefused
from schemas.layout import MANIFEST_NAME, done_file, shard_lineage_file, stream_lineage_file
from tests.helpers.packs import make_dataset, small_config
from tests.helpers.paths import REPO


def digests(out: str) -> dict[int, list[str]]:
    pack = Pack.open(out)
    return {s: [r.digest for sh in pack.index(s).shards for r in sh.records] for s in range(pack.num_streams)}


def read_ids(batches) -> list[tuple]:
    return [(b.sequence_length, repr(b.batch_data_indexes)) for b in batches]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def fresh12(data, tmp_path_factory, tokenizer_and_special) -> str:
    out = str(tmp_path_factory.mktemp("fresh") / "out")
    run_pack(small_config(data, shard_bytes=400_000, batches_per_stream=12), out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    return out


@pytest.mark.slow  # packs twice more and compares with the fresh pack
def test_extend_6_to_12_equals_a_fresh_12_pack(data, fresh12, tmp_path, tokenizer_and_special):
    out = str(tmp_path / "out")
    s6 = run_pack(small_config(data, shard_bytes=400_000, batches_per_stream=6), out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    assert s6.manifest_written and sum(s.num_records for s in s6.streams) == 12
    before = {p: open(os.path.join(out, p), "rb").read() for p in
              [f"stream-0000{s}/shard-0000{k}.arrow" for s in (0, 1) for k in range(len(Pack.open(out).index(s).shards))]}
    # a smaller budget, another kind of budget or another config: refused with one line
    for cfg, why in ((small_config(data, shard_bytes=400_000, batches_per_stream=4), "smaller than"),
                     (small_config(data, shard_bytes=400_000, tokens_per_stream=10_000), "changed kind"),
                     (small_config(data, shard_bytes=300_000, batches_per_stream=12), "config differs")):
        with pytest.raises(PackRefused, match=why):
            run_pack(cfg, out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    # loader states taken on the 6-batch pack by 2 ranks, merged (extend x world-size change)
    states = []
    for rank in (0, 1):
        ds = PackedShardDataset(out, rank=rank, world_size=2)
        it = iter(ds)
        for _ in range(4):
            next(it)
        states.append(json.loads(json.dumps(ds.state_dict())))
    merged = PackedShardDataset.merge_states(states)
    s12 = run_pack(small_config(data, shard_bytes=400_000, batches_per_stream=12), out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    assert s12.manifest_written and s12.packed_now[0] == 12
    assert digests(out) == digests(fresh12) and all(len(d) == 12 for d in digests(out).values())
    assert all(open(os.path.join(out, p), "rb").read() == b for p, b in before.items())  # kept their bytes
    assert verify_pack(out).ok
    for s in (0, 1):
        assert read_ids(open_stream(out, s)) == read_ids(open_stream(fresh12, s))
    # the merged state, taken on the 6-batch pack, applies to the extended one at another world size: one
    # rank reads the rest of both streams, as from the pack packed at 12 at once
    rest = []
    for pack in (out, fresh12):
        ds = PackedShardDataset(pack, rank=0, world_size=1)
        ds.load_state_dict(merged)
        rest.append(read_ids(ds))
    assert rest[0] == rest[1] and len(rest[0]) == 24 - 8
    again = run_pack(small_config(data, shard_bytes=400_000, batches_per_stream=12), out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    assert again.already_done


@pytest.mark.slow  # packs in two subprocess jobs
def test_partial_packs_are_readable_and_two_jobs_make_one_pack(data, fresh12, tmp_path, tokenizer_and_special):
    out = str(tmp_path / "out")
    cfg = small_config(data, shard_bytes=400_000, batches_per_stream=12)
    first = run_pack(cfg, out, RunOptions(streams=[1], inline=True, bar=False), tokenizer=tokenizer_and_special)
    assert not first.manifest_written
    # stream 1 reads in full right away; stream 0 has nothing committed yet
    assert read_ids(open_stream(out, 1)) == read_ids(open_stream(fresh12, 1))
    assert list(open_stream(out, 0)) == []
    ds = PackedShardDataset(out, rank=0, world_size=1)
    assert ds.num_batches() == 12 and len(list(ds)) == 12
    assert verify_pack(out).ok
    second = run_pack(cfg, out, RunOptions(streams=[0], inline=True, bar=False), tokenizer=tokenizer_and_special)
    assert second.manifest_written
    assert digests(out) == digests(fresh12)
    assert read_ids(PackedShardDataset(out, rank=0, world_size=1)) == read_ids(PackedShardDataset(fresh12, rank=0, world_size=1))


def test_damaged_stream_index_is_refused_by_the_loader(fresh12, tmp_path):
    import shutil

    from schemas.errors import DamagedFile

    out = str(tmp_path / "out")
    shutil.copytree(fresh12, out)
    path = os.path.join(out, "stream-00000", "index.arrow")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))
    with pytest.raises(DamagedFile, match=r"stream-00000/index\.arrow"):
        list(open_stream(out, 0))
    assert read_ids(open_stream(out, 1)) == read_ids(open_stream(fresh12, 1))


_WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from prepack.run.commit import writer
    from prepack.run.driver import RunOptions, run_pack
    from schemas.config_file import load_config

    slow = writer.write_index
    def paced(loc, index):  # commit one shard every 0.3 s, so the reader really waits
        time.sleep(0.3)
        slow(loc, index)
    writer.write_index = paced
    run_pack(load_config({config!r}), {out!r}, RunOptions(inline=True, bar=False, reuse={reuse!r}))
""")


@pytest.mark.slow  # follows a pack a subprocess writes
def test_follow_a_pack_while_another_process_writes_it(data, fresh12, tmp_path):
    out = str(tmp_path / "out")
    cfg = small_config(data, shard_bytes=400_000, batches_per_stream=12)
    writer = subprocess.Popen([sys.executable, "-c", _WRITER.format(repo=REPO, config=cfg.config_path, out=out, reuse=())],
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(out, "pack.json")):
            assert writer.poll() is None, writer.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ds = PackedShardDataset(out, rank=0, world_size=1, follow=True, poll_s=0.05, timeout_s=60)
        got = read_ids(ds)
        assert writer.wait(timeout=120) == 0, writer.stderr.read()
    finally:
        writer.kill()
    assert got == read_ids(PackedShardDataset(fresh12, rank=0, world_size=1))
    assert digests(out) == digests(fresh12)


@pytest.mark.slow  # packs, then extends in another process while a follower reads
def test_follow_an_extension_packed_with_reuse(data, fresh12, tmp_path, tokenizer_and_special):
    """A pack of 6 batches a stream extended to 12 by another process (with ``--reuse`` of the fresh
    12-batch pack: its pictures taken from there), followed from the moment pack.json says 12: the
    follower reads on to the new end, the fresh pack's batches."""
    out = str(tmp_path / "out")
    run_pack(small_config(data, shard_bytes=400_000, batches_per_stream=6), out, RunOptions(inline=True, bar=False),
             tokenizer=tokenizer_and_special)
    cfg = small_config(data, shard_bytes=400_000, batches_per_stream=12)
    writer = subprocess.Popen([sys.executable, "-c", _WRITER.format(repo=REPO, config=cfg.config_path, out=out,
                                                                   reuse=(fresh12,))], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while json.load(open(os.path.join(out, "pack.json")))["budget"] != {"batches_per_stream": 12}:
            assert writer.poll() is None, writer.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        got = read_ids(PackedShardDataset(out, rank=0, world_size=1, follow=True, poll_s=0.05, timeout_s=60))
        assert writer.wait(timeout=120) == 0, writer.stderr.read()
    finally:
        writer.kill()
    assert got == read_ids(PackedShardDataset(fresh12, rank=0, world_size=1))
    assert digests(out) == digests(fresh12)
    pack = Pack.open(out)
    assert sum(int(pack.done(s).reuse.get("reused", 0)) for s in range(pack.num_streams)) > 0


@pytest.mark.slow  # waits out the follow timeout
def test_follow_resumes_from_a_state_and_times_out(data, fresh12, tmp_path, tokenizer_and_special):
    from loader.reader import FollowTimeout

    out = str(tmp_path / "out")
    cfg = small_config(data, shard_bytes=400_000, batches_per_stream=12)
    run_pack(cfg, out, RunOptions(streams=[0], inline=True, bar=False), tokenizer=tokenizer_and_special)
    ds = PackedShardDataset(out, rank=0, world_size=1, follow=True, poll_s=0.05, timeout_s=0.5)
    it = iter(ds)
    head = [next(it)]  # stream 0's first batch; the next in the rank's order is stream 1's first
    state = ds.state_dict()
    with pytest.raises(FollowTimeout, match="stream 1: no new committed shard for 0.5 s"):
        next(it)  # stream 1 never gets a shard
    run_pack(cfg, out, RunOptions(streams=[1], inline=True, bar=False), tokenizer=tokenizer_and_special)
    resumed = PackedShardDataset(out, rank=0, world_size=1, follow=True, poll_s=0.05, timeout_s=5)
    resumed.load_state_dict(state)
    whole = read_ids(PackedShardDataset(fresh12, rank=0, world_size=1))
    assert read_ids(head) + read_ids(resumed) == whole


def test_rerun_removes_lineage_files_left_by_a_run_killed_after_done(data, fresh12, tmp_path, tokenizer_and_special):
    """done.json is written before the shard lineage files are deleted: a run killed in between
    leaves them; the next run over the finished pack removes them and changes nothing else."""
    out = str(tmp_path / "out")
    shutil.copytree(fresh12, out)
    before = {p: open(os.path.join(out, p), "rb").read() for p in _files(out)}
    leftovers = [shard_lineage_file(1, k) for k in range(2)]
    for rel in leftovers:
        with open(os.path.join(out, rel), "wb") as f:
            f.write(b"left by a killed run")
    again = run_pack(small_config(data, shard_bytes=400_000, batches_per_stream=12), out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    assert again.already_done
    assert not any(os.path.exists(os.path.join(out, rel)) for rel in leftovers)
    assert {p: open(os.path.join(out, p), "rb").read() for p in _files(out)} == before
    assert verify_pack(out).ok


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if not os.path.relpath(d, root).startswith(".prepack"))


def test_verify_a_stream_being_extended(fresh12, tmp_path):
    """Right after an extension starts (done.json and manifest.json removed), the earlier shards'
    lineage is in lineage/stream-S.parquet, not in shard files: verify checks it there."""
    out = str(tmp_path / "out")
    shutil.copytree(fresh12, out)
    os.remove(os.path.join(out, done_file(0)))
    os.remove(os.path.join(out, MANIFEST_NAME))
    report = verify_pack(out)
    assert report.ok, [r for r in report.rows if not r.ok]
    assert any(r.ok and r.target == stream_lineage_file(0) and r.check == "lineage rows" for r in report.rows)
    with open(os.path.join(out, stream_lineage_file(0)), "r+b") as f:  # damage: fewer rows than samples
        f.truncate(100)
    assert [r.target for r in verify_pack(out).rows if not r.ok] == [stream_lineage_file(0)]
