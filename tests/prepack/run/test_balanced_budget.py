"""``--disk-budget`` for a balanced-samples pack (``prepack.run.bounded.balanced_budget``): one budget for
OUT and its reference, kept by the job balancing OUT, beside real trainings.  Its refusals and the
run's stop where no trim can make room are in ``test_sample_balance.py``, beside the pack they use."""

from __future__ import annotations

import json
import os
import threading

import numpy as np

from loader import PackedShardDataset
from loader.reader import Pack
from prepack.run.bounded import balanced_budget
from prepack.run.bounded import trainings as trainings_module
from prepack.run.bounded.ahead import PACK_FILES_RESERVE, SHARD_FILES_SLACK, shard_most
from prepack.run.bounded.bound import BoundSpec
from prepack.run.commit.writer import StreamWriter
from prepack.run.driver import RunOptions, run_pack
from prepack.tools.verify import verify_pack
from schemas.config_file import load_config
from schemas.layout import REFERENCE_DIR
from tests.helpers import datagen as dg
from tests.helpers.packs import KNOBS
from tests.helpers.trainings import Trainer, run_beside_trainings

W, K = 2, 2


def _picture_heavy_config(root: str, batches: int) -> str:
    """t2i rows of 256-pixel pictures and long captions (they stay: VAE) with text-only SFT rows (they
    move): a balanced pack of a few hundred kB a batch at small-budget knobs."""
    rs = np.random.RandomState(5)
    ds = dg.Dataset(os.path.join(root, "data"))
    os.makedirs(ds.root)
    dg.add_t2i(ds, [dg.captioned_rows(rs, 120, 256, 150) for _ in range(W * K)], row_group_size=8)
    dg.add_sft(ds, [json.dumps({"conversations": [{"from": "human", "value": dg.sentence(rs, 20, 60)},
                                                  {"from": "gpt", "value": dg.sentence(rs, 20, 60)}]})
                    for _ in range(400)])
    return ds.config(knobs=dict(KNOBS, max_buffer_size=1), num_workers=K,
                     prepack={"batches_per_stream": batches, "shard_bytes": 150_000, "world_size": W,
                              "balance": "samples"})


def test_a_disk_budget_holds_a_balanced_pack_and_its_reference_beside_two_trainings(tmp_path, monkeypatch,
                                                                                      tokenizer_and_special):
    """bal-samples x --disk-budget: the job balancing OUT keeps one budget for OUT and its reference,
    grants each reference shard its room and takes each balanced step's most before writing it.
    The trainings hold after a few batches until the budget has held the pack back (it binds);
    every file of the pack, counted after each shard commit, stays under the budget, every batch
    is read once in the unbounded pack's order, and every shard is the unbounded pack's."""
    monkeypatch.setattr(trainings_module, "POLL_S", 0.05)
    cfg = load_config(_picture_heavy_config(str(tmp_path), batches=64))
    whole = str(tmp_path / "whole")
    run_pack(cfg, whole, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    budget = PACK_FILES_RESERVE + cfg.num_streams * 3 * (shard_most(cfg) + SHARD_FILES_SLACK)  # the least accepted
    out, progress = str(tmp_path / "out"), str(tmp_path / "progress")

    def on_disk() -> int:
        return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(out) for n in names
                   if os.path.exists(os.path.join(d, n)))

    assert sum(sh.nbytes for s in range(W * K) for sh in Pack.open(whole).index(s).shards) > budget, \
        "the budget must bind"
    peak, held = [0], threading.Event()
    real_commit, real_check = StreamWriter._commit, balanced_budget.BalancedBudget.check

    def measured_commit(self):  # the reference's shards and the balanced ones alike
        entry = real_commit(self)
        peak[0] = max(peak[0], on_disk())
        if peak[0] > budget:
            held.set()  # over: the test fails below, without waiting
        return entry

    def check(self, reference, balanced, ledger):
        if ledger.blocked:
            held.set()  # the budget held something back: the trainings go on
        return real_check(self, reference, balanced, ledger)

    monkeypatch.setattr(StreamWriter, "_commit", measured_commit)
    monkeypatch.setattr(balanced_budget.BalancedBudget, "check", check)
    bound = BoundSpec(None, (progress,), keep=2, disk_budget=budget)
    trainers = run_beside_trainings(
        lambda: run_pack(cfg, out, RunOptions(inline=True, bar=False, bound=bound), tokenizer=tokenizer_and_special),
        out, lambda: [Trainer(out, r, W, progress, every=3, pause_s=0.02, ahead=None, per_shard=0,
                              hold=(6, held)) for r in range(W)], timeout=300)
    assert held.is_set()
    assert 0 < peak[0] <= budget and on_disk() <= budget, (peak[0], budget)
    for r, t in enumerate(trainers):  # every batch once, in the unbounded pack's order
        assert [repr(b.batch_data_indexes) for b in t.seen] == \
            [repr(b.batch_data_indexes) for b in PackedShardDataset(whole, rank=r, world_size=W)]
    pack = Pack.open(out)
    for s in range(W * K):
        assert [sh.xxh3 for sh in pack.index(s).shards] == [sh.xxh3 for sh in Pack.open(whole).index(s).shards]
    assert any(pack.trimmed(s) for s in range(W * K)), "nothing was trimmed behind the trainings"
    grants = os.path.join(out, REFERENCE_DIR, ".prepack", "grants")
    assert not os.path.exists(grants) or not os.listdir(grants)  # withdrawn at the end
    assert verify_pack(out).ok
