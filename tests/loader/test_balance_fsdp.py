"""Balanced steps leave an FSDP2 training unchanged: two ranks over gloo on CPU, the tiny BAGEL
(tests/helpers/tiny_bagel.py) under ``fully_shard`` (its layer and the root: tests/helpers/fsdp_training.py),
M=2 micro-batches per optimizer step with the gradients synced at every micro-batch (lockstep, as
NeMo's recipe trains), NeMo's loss normalization by the step's global token counts; with
``balance=Balance(micro_batches=2, sync="lockstep")`` and without: every step reads the same batches,
dealt otherwise, and the losses and final weights agree within float summation order."""

from __future__ import annotations


import pytest
import torch

from tests.helpers.fakepack import make_pack
from tests.helpers.balanced_training import check_balanced_against_reference, train_two_ways
from tests.helpers.fsdp_training import spawn_target

WORLD, M, STEPS = 2, 2, 5
# float32 sums in another order (SGD; FSDP2 reduce-scatters each micro-batch and accumulates the
# sharded gradients, so a step's micro-batches are summed in another grouping): measured
# 6.2e-8 relative on the losses and 3.0e-8 absolute on the weights (the same on every run: deterministic)
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 1e-6


@pytest.mark.slow
def test_balanced_fsdp_training_equals_the_reference(tmp_path):
    packed_dir = str(tmp_path / "pack")
    make_pack(packed_dir, world_size=2, num_workers=2, lengths=[6, 5, 6, 6], shard_bytes=40 * 1024)
    ref = train_two_ways(spawn_target, packed_dir, str(tmp_path), WORLD, M, STEPS, balance=False)
    bal = train_two_ways(spawn_target, packed_dir, str(tmp_path), WORLD, M, STEPS, balance=True)
    loss_diff, weight_diff = check_balanced_against_reference(ref, bal, STEPS)
    for r in range(WORLD):  # every rank ends with the same weights
        assert all(torch.equal(bal[r]["weights"][k], bal[0]["weights"][k]) for k in bal[0]["weights"])
    print(f"FSDP2 balanced vs reference: loss max relative difference {loss_diff:.3g}, weights max absolute "
          f"difference {weight_diff:.3g}")
    assert loss_diff <= LOSS_RTOL
    assert weight_diff <= WEIGHT_ATOL
