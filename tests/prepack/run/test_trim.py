"""Trimming shards behind training (``prepack trim``) and restoring them byte for byte (``prepack restore``).

A small real pack (2 streams, several shards each) is copied per test; trainings are real loader
states (``PackedShardDataset`` after some batches).  What must hold: nothing a state given may read
is trimmed, every tool and reader knows a trimmed shard from a damaged one, a restore gives the
original bytes, and packing goes on over a trimmed stream.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from loader import PackedShardDataset, open_stream
from loader.reader import Pack
from prepack.cli import main
from prepack.run.driver import RunOptions, run_pack
from prepack.run.bounded.checkpoint_ladder import ladder_keeps, nearest_kept
from prepack.run.bounded.replay import state_at
from prepack.run.bounded.restore import restore
from prepack.run.commit.checkpoint_files import state_files
from prepack.run.bounded.trim_policy import trim_pack
from prepack.tools.audit import audit_pack
from prepack.tools.stats import compute_stats, format_stats
from prepack.tools.verify import verify_pack
from schemas.config_file import load_config
from schemas.errors import PackRefused, ShardTrimmed
from schemas.layout import checkpoint_file
from schemas.manifest import TrimmedShards
from tests.helpers.packs import small_dataset, pack_in_process

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def original(tmp_path_factory, tokenizer_and_special):
    root = str(tmp_path_factory.mktemp("trim"))
    config = small_dataset(root, batches=8, shard_bytes=150_000)
    out = pack_in_process(config, os.path.join(root, "out"), tokenizer_and_special)
    assert all(len(Pack.open(out).index(s).shards) >= 3 for s in (0, 1)), "the pack needs several shards a stream"
    return {"config": config, "out": out}


@pytest.fixture
def pack(original, tmp_path):
    out = str(tmp_path / "out")
    shutil.copytree(original["out"], out)
    return out


def state_after(out: str, batches: int) -> dict:
    ds = PackedShardDataset(out, rank=0, world_size=1)
    it = iter(ds)
    for _ in range(batches):
        next(it)
    return json.loads(json.dumps(ds.state_dict()))


def files(out: str) -> dict[str, bytes]:
    got = {}
    for d, _, names in os.walk(out):
        for n in names:
            p = os.path.join(d, n)
            got[os.path.relpath(p, out)] = open(p, "rb").read()
    return got


def ids(batches) -> list:
    return [(b.sequence_length, repr(b.batch_data_indexes)) for b in batches]


def test_trim_then_restore_gives_the_original_bytes(original, pack, tokenizer_and_special):
    state = state_after(pack, 9)  # round robin: stream 0 has given 5 batches, stream 1 four
    positions = dict(zip(state["streams"], state["positions"]))
    result = trim_pack(pack, [state])
    p = Pack.open(pack)
    for s in (0, 1):
        trimmed = TrimmedShards.read(p.location, s).shards
        want = [sh.shard for sh in p.index(s).shards if sh.first_record + len(sh.records) <= positions[s]]
        assert trimmed == want and want, (s, trimmed, want)
        for sh in p.index(s).shards:
            assert os.path.exists(os.path.join(pack, sh.file)) == (sh.shard not in want)
    assert result.freed_bytes > 0 and "trimmed" in result.lines()[0]
    # verify: recorded, not damaged; every reader that needs a trimmed record says how to restore it
    report = verify_pack(pack)
    assert report.ok and any("trimmed" in r.detail for r in report.rows)
    with pytest.raises(ShardTrimmed, match=r"prepack restore .* --streams 0 --records 0-"):
        list(open_stream(pack, 0))
    # a training resumed from its state reads on, exactly what an untrimmed pack gives
    resumed = PackedShardDataset(pack, rank=0, world_size=1)
    resumed.load_state_dict(state)
    whole = ids(PackedShardDataset(original["out"], rank=0, world_size=1))
    assert ids(resumed) == whole[9:]
    # audit re-packs a trimmed shard from its checkpoint; stats count what is trimmed
    assert audit_pack(pack, stream=0, shard=0, tokenizer=tokenizer_and_special).ok
    st = compute_stats(pack)
    assert st.totals["batches"] == 16 and st.totals["trimmed"] > 0 and "trimmed:" in format_stats(st)
    # restore everything: byte for byte the original files, and nothing listed any more
    done = restore(pack, {0: (0, None), 1: (0, None)}, tokenizer=tokenizer_and_special)
    assert sorted(done) == [0, 1]
    assert files(pack) == {k: v for k, v in files(original["out"]).items()} | {
        f"stream-0000{s}/trimmed.json": files(pack)[f"stream-0000{s}/trimmed.json"] for s in (0, 1)}
    assert all(not TrimmedShards.read(p.location, s).shards for s in (0, 1))
    assert ids(PackedShardDataset(pack, rank=0, world_size=1)) == whole


def test_a_trim_drops_checkpoints_off_the_ladder_and_everything_replays_from_the_nearest_kept(
        original, pack, tokenizer_and_special, monkeypatch):
    trim_pack(pack, [state_after(pack, 16)])  # everything read: every shard trimmed
    p, cfg = Pack.open(pack), Pack.open(pack).info.stored_config()
    dropped_any = False
    for s in (0, 1):
        index, doc = p.index(s), TrimmedShards.read(p.location, s)
        assert doc.checkpoints == [k for k in range(1, len(index.shards)) if not ladder_keeps(k, len(index.shards))]
        dropped_any |= bool(doc.checkpoints)
        for k in range(len(index.shards) + 1):
            path = os.path.join(pack, checkpoint_file(s, k))
            assert os.path.exists(path) == (k not in doc.checkpoints)
        # the state at each dropped checkpoint, packed again from the nearest kept one, is that checkpoint
        for k in doc.checkpoints:
            got = state_at(p.location, index, cfg, index.shards[k].first_record, tokenizer_and_special)
            assert got.checkpoint == nearest_kept(k, set(doc.checkpoints)) < k and got.replayed > 0
            want = tuple(open(os.path.join(original["out"], checkpoint_file(s, k, ext)), "rb").read()
                         for ext in ("json", "arrow"))
            assert state_files(got.state) == want
    assert dropped_any, "the pack needs a checkpoint off the ladder"
    assert verify_pack(pack).ok
    s, k = next((s, TrimmedShards.read(p.location, s).checkpoints[-1]) for s in (0, 1)
                if TrimmedShards.read(p.location, s).checkpoints)
    # audit re-packs a shard whose start and end checkpoints were dropped (the end checked by its digests)
    assert audit_pack(pack, stream=s, shard=k, tokenizer=tokenizer_and_special).ok
    # a restore of that one shard gives its file and its checkpoint back, and unlists both
    index = p.index(s)
    restore(pack, {s: (p.switch(s) + index.shards[k].first_record,) * 2}, tokenizer=tokenizer_and_special)
    for rel in (index.shards[k].file, checkpoint_file(s, k, "json"), checkpoint_file(s, k, "arrow")):
        assert files(pack)[rel] == files(original["out"])[rel]
    doc = TrimmedShards.read(p.location, s)
    assert k not in doc.shards and k not in doc.checkpoints
    # a replay that does not give the pack's records back is refused, never continued from
    k2 = doc.checkpoints[0]
    monkeypatch.setattr(type(index), "record", lambda self, i: type(self.shards[0].records[0])("0" * 32, 0, 0))
    with pytest.raises(PackRefused, match="does not give its record"):
        state_at(p.location, index, cfg, index.shards[k2].first_record, tokenizer_and_special)


def test_nothing_a_kept_state_may_read_is_trimmed(original, pack, tokenizer_and_special):
    """Random consumption by two trainings, each keeping two checkpoints; trims at each point."""
    rng = random.Random(7)
    whole = ids(PackedShardDataset(pack, rank=0, world_size=1))
    taken = sorted(rng.sample(range(0, 17), 6))
    for i in range(2, len(taken)):  # (the states are taken on an untrimmed copy: the same pack)
        kept = [state_after(original["out"], n) for n in (taken[i - 2], taken[i - 1])]  # training A's checkpoints
        other = state_after(original["out"], taken[i] // 2)  # a slower training B
        trim_pack(pack, kept + [other])
        for st, n in zip(kept + [other], (taken[i - 2], taken[i - 1], taken[i] // 2)):
            ds = PackedShardDataset(pack, rank=0, world_size=1)
            ds.load_state_dict(st)
            assert ids(ds) == whole[n:]
    assert verify_pack(pack).ok


def test_refusals_and_the_cli(pack, tmp_path, tokenizer_and_special, capsys):
    state = state_after(pack, 6)
    one_rank = {**state, "streams": state["streams"][:1], "positions": state["positions"][:1],
                "firsts": state["firsts"][:1], "last": state["last"][:1]}
    with pytest.raises(PackRefused, match="lack streams"):
        trim_pack(pack, [one_rank])
    forged = {**state, "last": ["00" * 16] * 2}
    with pytest.raises(PackRefused, match="does not match stream"):
        trim_pack(pack, [forged])
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    assert main(["trim", pack, "--state", str(path)]) == 0
    assert "trimmed" in capsys.readouterr().out
    assert main(["restore", pack]) == 2  # neither --state nor --streams
    assert main(["restore", pack, "--streams", "1", "--records", "0"]) == 0  # only the shard holding record 0
    assert "restored 1 shard(s) of stream(s) 1" in capsys.readouterr().out
    assert TrimmedShards.read(Pack.open(pack).location, 1).shards[:1] != [0]
    assert main(["restore", pack, "--state", str(path)]) == 0  # everything the state reads: nothing trimmed there
    assert "none of those records was trimmed" in capsys.readouterr().out


def test_packing_goes_on_over_a_trimmed_stream(original, pack, tokenizer_and_special, tmp_path):
    trim_pack(pack, [state_after(pack, 10)])
    cfg = load_config(original["config"])
    bigger = cfg.__class__(**{**cfg.__dict__, "prepack": cfg.prepack.__class__(
        **{**cfg.prepack.__dict__, "batches_per_stream": 10})})
    run_pack(bigger, pack, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    fresh = str(tmp_path / "fresh")
    run_pack(bigger, fresh, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    for s in (0, 1):
        a = [r.digest for sh in Pack.open(pack).index(s).shards for r in sh.records]
        b = [r.digest for sh in Pack.open(fresh).index(s).shards for r in sh.records]
        assert a == b and len(a) == 10
    assert verify_pack(pack).ok
