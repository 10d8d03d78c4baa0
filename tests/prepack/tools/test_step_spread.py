"""The step spread (``prepack stats --world-size W --micro-batches M``, ``prepack plan``).

The pack's per-record compute terms come from its indexes; here every record is read back, its
terms counted from its arrays (``schemas.cost.terms_of``) and each rank's batches taken from a
real ``PackedShardDataset``, so the spread is checked against what a training would compute.
"""

from __future__ import annotations

import numpy as np
import pytest

from loader import PackedShardDataset
from loader.balance import assign_lockstep, assign_step, lockstep_bound, lockstep_time, rank_loads
from loader.dataset import streams_for_rank
from loader.reader import Pack, iter_records
from loader.stream import round_robin
from prepack.cli import main
from prepack.tools.step_spread import drawn_spread, pack_spread, spread_of_steps
from schemas.cost import CostModel, terms_of
from schemas.record import record_to_batch
from tests.helpers.packs import build_pack


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tokenizer_and_special):
    return build_pack(str(tmp_path_factory.mktemp("spread")), tokenizer_and_special, batches=8, edit=True)


def test_the_index_holds_each_records_terms(pack):
    p = Pack.open(pack)
    for s in range(p.num_streams):
        for i, record in iter_records(p, s):
            assert p.record_terms(s, i) == tuple(int(x) for x in terms_of(record_to_batch(record)))


@pytest.mark.parametrize("world_size,micro_batches", [(2, 2), (2, 1), (1, 3)])
def test_the_spread_is_that_of_the_ranks_own_batches(pack, world_size, micro_batches):
    model = CostModel.default()
    ranks = []
    for r in range(world_size):
        batches = list(PackedShardDataset(pack, rank=r, world_size=world_size))
        terms = np.array([terms_of(b) for b in _batches(pack, r, world_size)])
        assert len(terms) == len(batches)
        ranks.append(terms)
    steps = min(len(c) for c in ranks) // micro_batches
    step_terms = [np.concatenate([c[t * micro_batches:(t + 1) * micro_batches] for c in ranks]) for t in range(steps)]
    lock, got = pack_spread(pack, world_size, micro_batches)
    assert (lock.sync, got.sync) == ("lockstep", "step")
    # lockstep: the sum over micro-steps and segments of the slowest rank, over the mean rank's work
    seg = [model.segments(t) for t in step_terms]
    ref = np.mean([lockstep_time(c, world_size, micro_batches) / (c.sum() / world_size) for c in seg])
    assert lock.steps == steps > 0 and lock.reference == pytest.approx(ref)
    assert lock.ideal <= lock.balanced + 1e-12 <= lock.reference + 1e-12
    bal = sum(lockstep_time(c, world_size, micro_batches, assign_lockstep(c, world_size, micro_batches)) for c in seg)
    assert lock.balanced_time == pytest.approx(bal / sum(lockstep_time(c, world_size, micro_batches) for c in seg))
    assert lock.ideal_time == pytest.approx(sum(lockstep_bound(c, world_size, micro_batches) for c in seg)
                                            / sum(lockstep_time(c, world_size, micro_batches) for c in seg))
    want = [model.estimate(t) for t in step_terms]
    ref = np.mean([rank_loads(c, world_size, micro_batches).max() / (c.sum() / world_size) for c in want])
    assert got.steps == steps > 0 and got.reference == pytest.approx(ref)
    assert got.ideal <= got.balanced + 1e-12 <= got.reference + 1e-12
    bal = sum(rank_loads(c, world_size, micro_batches, assign_step(c, world_size, micro_batches)).max() for c in want)
    assert got.balanced_time == pytest.approx(bal / sum(rank_loads(c, world_size, micro_batches).max() for c in want))
    if micro_batches == 1:
        assert got.balanced == pytest.approx(got.reference)


def _batches(pack: str, rank: int, world_size: int):
    """The rank's records in the loader's order, as PackedBatch (what the terms are counted from)."""
    p = Pack.open(pack)
    streams = streams_for_rank(p.num_streams, p.world_size, p.num_workers, rank, world_size)
    records = {s: [record_to_batch(r) for _, r in iter_records(p, s)] for s in streams}
    return [records[streams[k]][i] for k, i in round_robin(lambda k, i: i < len(records[streams[k]]), len(streams))]


def test_a_step_spread_by_hand():
    costs = np.array([4.0, 1.0, 1.0, 4.0])  # rank 0: 4+1, rank 1: 1+4 -> even already
    even = spread_of_steps([costs], 2, 2)
    assert even.reference == pytest.approx(1.0) and even.balanced_time == pytest.approx(1.0)
    skewed = spread_of_steps([np.array([4.0, 4.0, 1.0, 1.0])], 2, 2)  # 8 vs 2: balanced 5 vs 5
    assert skewed.reference == pytest.approx(8 / 5) and skewed.balanced == pytest.approx(1.0)
    assert skewed.balanced_time == pytest.approx(5 / 8)
    rng = np.random.default_rng(0)
    terms = rng.integers(0, 40_000, (3, 9))
    lock, drawn = drawn_spread(terms, CostModel.default(), 4, 2, steps=50)
    assert drawn.drawn and drawn.steps == 50 and drawn.balanced <= drawn.reference
    assert lock.drawn and lock.sync == "lockstep" and lock.ideal <= lock.balanced <= lock.reference
    # lockstep by hand: micro-steps {0, 2} and {1, 3} each wait for a heavy VAE; grouped, one does
    seg = np.array([[10.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [10.0, 0.0, 1.0]])
    by_hand = spread_of_steps([seg], 2, 2, sync="lockstep")
    assert by_hand.reference == pytest.approx(22 / 12) and by_hand.balanced == pytest.approx(12 / 12)
    assert by_hand.balanced_time == pytest.approx(12 / 22) and by_hand.ideal_time == pytest.approx(12 / 22)


def test_stats_cli_prints_it_and_refuses_bad_values(pack, capsys):
    assert main(["stats", pack, "--world-size", "2", "--micro-batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "lockstep step spread (W=2, M=2" in out and "micro-steps balanced" in out
    assert "\nstep spread (W=2, M=2" in out and "balanced batches" in out
    assert main(["stats", pack, "--world-size", "2", "--micro-batches", "2", "--sync", "step"]) == 0
    out = capsys.readouterr().out
    assert "step spread (W=2, M=2" in out and "lockstep" not in out
    with pytest.raises(SystemExit) as exit_:
        main(["stats", pack, "--sync", "fsdp"])
    assert exit_.value.code == 2 and "invalid choice: 'fsdp'" in capsys.readouterr().err
    assert main(["stats", pack, "--world-size", "64"]) == 2
    assert "--world-size 64" in capsys.readouterr().err
    assert main(["stats", pack, "--micro-batches", "0"]) == 2
