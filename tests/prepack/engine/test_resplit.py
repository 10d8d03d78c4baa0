"""prepack/engine/resplit.py: a step's samples re-split with VAE samples in place, every sample once
and no batch over its capacity; a batch's samples add up to its estimate."""

from __future__ import annotations

import numpy as np
import pytest

from prepack.engine.resplit import StepSample, balance_samples, samples_of
from schemas.cost import CostModel, terms_of
from schemas.errors import UsageError
from tests.helpers.fakepack import BatchSpec, make_batch


def _random_step(rng, w: int, vae_share: float = 0.4):
    batches, caps, fixed = [], [], []
    for _ in range(w):
        n = int(rng.integers(1, 12))
        samples = [StepSample(int(t), float(t) * (1 + 0.3 * rng.random()) + 1e-4 * float(t) ** 2,
                              bool(rng.random() < vae_share)) for t in rng.integers(50, 3000, n)]
        batches.append(samples)
        caps.append(int(sum(x.tokens for x in samples) * rng.uniform(0.97, 1.25)))  # some over capacity already
        fixed.append(float(rng.uniform(0, 500)) if any(x.has_vae for x in samples) else 0.0)
    return batches, caps, fixed


def _loads(batches, fixed, split):
    cost = [fixed[b] + sum(batches[i][s].cost for i, s in out) for b, out in enumerate(split)]
    tokens = [sum(batches[i][s].tokens for i, s in out) for out in split]
    return np.array(cost), np.array(tokens)


def _check_split(batches, caps, fixed, split):
    assert len(split) == len(batches)
    taken = [p for out in split for p in out]
    assert sorted(taken) == [(b, s) for b, samples in enumerate(batches) for s in range(len(samples))]
    assert all(out == sorted(out) for out in split)
    for b, out in enumerate(split):
        for i, s in out:
            if batches[i][s].has_vae:
                assert i == b, "a VAE sample moved"
        for s, x in enumerate(batches[b]):
            if x.has_vae:
                assert (b, s) in out
    cost, tokens = _loads(batches, fixed, split)
    ref_tokens = np.array([sum(x.tokens for x in samples) for samples in batches])
    assert (tokens <= np.maximum(caps, ref_tokens)).all()
    ref_cost = np.array([f + sum(x.cost for x in samples) for f, samples in zip(fixed, batches)])
    assert cost.max() <= ref_cost.max() * (1 + 1e-9)
    return cost, ref_cost


def test_balance_samples_keeps_every_sample_vae_in_place_and_capacity():
    rng = np.random.default_rng(3)
    gained = 0
    for w in (1, 2, 5, 16, 64):
        for _ in range(4):
            batches, caps, fixed = _random_step(rng, w)
            split = balance_samples(batches, caps, fixed)
            cost, ref = _check_split(batches, caps, fixed, split)
            assert split == balance_samples(batches, list(caps), list(fixed))  # deterministic
            gained += cost.max() < ref.max() * 0.99
    assert gained >= 8  # it does move samples where that helps


def test_balance_samples_by_hand():
    a = StepSample(100, 10.0, False)
    v = StepSample(100, 10.0, True)
    # batch 0 holds three movable samples and a VAE one; batch 1 one movable
    batches = [[a, a, a, v], [a]]
    # one movable sample moves (40, 10 -> 30, 20); of equal ones the first
    assert balance_samples(batches, [400, 400]) == [[(0, 1), (0, 2), (0, 3)], [(0, 0), (1, 0)]]
    # no room in batch 1: nothing moves
    assert balance_samples(batches, [400, 100]) == [[(0, 0), (0, 1), (0, 2), (0, 3)], [(1, 0)]]
    # VAE samples only: nothing moves
    only = [[v, v, v], [v]]
    assert balance_samples(only, [1000, 1000]) == [[(0, 0), (0, 1), (0, 2)], [(1, 0)]]
    # a fixed cost (the VAE canvas) sends samples away from its batch: 20, 45 -> 30, 35
    assert balance_samples([[a, a], [a, a]], [400, 400], [0.0, 25.0]) == [[(0, 0), (0, 1), (1, 0)], [(1, 1)]]
    assert balance_samples([[], []], [10, 10]) == [[], []]
    with pytest.raises(UsageError, match="capacities"):
        balance_samples([[a]], [1, 2])


def test_samples_of_adds_up_to_the_batch_estimate():
    model = CostModel.default()
    for i in range(16):
        b = make_batch(70 + i, BatchSpec(n_samples=1 + i % 4, vae=i % 3 != 0, max_side=3 + i % 4))
        samples, fixed = samples_of(b, model)
        assert len(samples) == len(b.sample_lens)
        assert [x.tokens for x in samples] == b.sample_lens.tolist()
        whole = float(model.estimate(terms_of(b)))
        assert fixed + sum(x.cost for x in samples) == pytest.approx(whole, rel=1e-12)
        assert (fixed > 0) == bool(len(b.vae_image_ids))  # the canvas stays with the batch
