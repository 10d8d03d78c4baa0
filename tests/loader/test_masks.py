"""Dense non-flex attention masks rebuilt by the loader (``loader.masks``) against the reference.

Oracle: the reference's ``prepare_attention_mask_per_sample(split_lens, attn_modes)`` (NeMo
AutoModel 0.7.0), called on each sample's own splits.  Ours goes through the path the loader
takes: ``row_bounds`` over the whole packed sequence (numpy arrays as stored in a record), then
``dense_mask`` on each sample's slice.  Comparison is bit for bit (float32 bit patterns, so
``-inf`` vs ``0`` and even ``-0.0`` vs ``0.0`` would be caught) plus dtype and shape.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.masks import dense_mask, row_bounds
from schemas.packed_batch import ATTN_MODE_CODES

reference = pytest.importorskip("nemo_automodel.components.datasets.multimodal.utils")

MODES = ("causal", "full", "noise")


def _packed(samples: list[list[tuple[int, str]]]):
    """The record's arrays for a list of samples, each a list of (split length, mode)."""
    split_lens = np.array([n for s in samples for n, _ in s], dtype=np.int32)
    modes = np.array([ATTN_MODE_CODES[m] for s in samples for _, m in s], dtype=np.int8)
    sample_num_splits = np.array([len(s) for s in samples], dtype=np.int32)
    sample_lens = np.array([sum(n for n, _ in s) for s in samples], dtype=np.int32)
    return sample_lens, sample_num_splits, split_lens, modes


def _ours(samples) -> list[torch.Tensor]:
    """Masks as the loader builds them: row bounds for the packed sequence, then one mask per sample."""
    sample_lens, sample_num_splits, split_lens, modes = _packed(samples)
    start, limit, keep = row_bounds(sample_lens, sample_num_splits, split_lens, modes)
    assert len(start) == len(limit) == len(keep) == int(sample_lens.sum())
    start_t, limit_t, keep_t = torch.from_numpy(start), torch.from_numpy(limit), torch.from_numpy(keep)
    out, pos = [], 0
    for n in sample_lens.tolist():
        out.append(dense_mask(start_t[pos : pos + n], limit_t[pos : pos + n], keep_t[pos : pos + n]))
        pos += n
    return out


def _assert_same(ours: torch.Tensor, ref: torch.Tensor, where: str = "") -> None:
    assert ours.dtype == ref.dtype == torch.float32, where
    assert ours.shape == ref.shape, where
    assert ours.device == ref.device, where
    # bit patterns: 0.0 and -inf exactly, no -0.0, no NaN
    assert torch.equal(ours.contiguous().view(torch.int32), ref.contiguous().view(torch.int32)), where


def _check(samples) -> None:
    masks = _ours(samples)
    assert len(masks) == len(samples)
    for k, (mask, sample) in enumerate(zip(masks, samples)):
        lens = [n for n, _ in sample]
        modes = [m for _, m in sample]
        ref = reference.prepare_attention_mask_per_sample(lens, modes)
        _assert_same(mask, ref, f"sample {k}: {sample}")


split = st.tuples(st.integers(0, 9), st.sampled_from(MODES))
sample = st.lists(split, min_size=1, max_size=7)


@settings(max_examples=100, deadline=None)
@given(st.lists(sample, min_size=1, max_size=5))
def test_random_layouts_equal_reference(samples):
    _check(samples)


@pytest.mark.parametrize(
    "samples",
    [
        pytest.param([[(7, "causal")]], id="single-causal-split"),
        pytest.param([[(5, "full")]], id="single-full-split"),
        pytest.param([[(6, "noise")]], id="single-noise-split"),
        pytest.param([[(3, "noise"), (4, "noise"), (2, "noise")]], id="all-noise"),
        pytest.param([[(0, "causal"), (4, "full"), (3, "noise"), (0, "causal")]], id="empty-text-splits"),
        pytest.param([[(4, "full"), (3, "noise")], [(5, "causal")]], id="image-only-then-text-only"),
        # the BAGEL layouts: text, ViT image (full), VAE image (noise), more text, and a CFG-dropped text
        pytest.param([[(9, "causal"), (6, "full"), (8, "noise"), (5, "causal")],
                      [(3, "causal"), (8, "noise"), (4, "full"), (8, "noise"), (2, "causal")],
                      [(1, "causal")]], id="bagel-like"),
        pytest.param([[(1, "noise"), (1, "causal"), (1, "noise"), (1, "full")]], id="length-one-splits"),
    ],
)
def test_edge_cases_equal_reference(samples):
    _check(samples)


def test_mask_semantics_by_hand():
    """An independent check of the rules, not via the reference: noise keys are hidden from every
    other split, causal rows see keys up to themselves, earlier splits are visible."""
    (mask,) = _ours([[(2, "causal"), (2, "noise"), (2, "full")]])
    ninf = float("-inf")
    expected = torch.tensor(
        [
            [0, ninf, ninf, ninf, ninf, ninf],
            [0, 0, ninf, ninf, ninf, ninf],
            [0, 0, 0, 0, ninf, ninf],
            [0, 0, 0, 0, ninf, ninf],
            [0, 0, ninf, ninf, 0, 0],
            [0, 0, ninf, ninf, 0, 0],
        ],
        dtype=torch.float32,
    )
    _assert_same(mask, expected)


def test_bounds_are_sample_local():
    """A sample's bounds do not depend on what was packed before it in the sequence."""
    tail = [(3, "causal"), (4, "noise"), (2, "full")]
    alone = _packed([tail])
    after = _packed([[(5, "full"), (6, "causal")], tail])
    a = row_bounds(*alone)
    b = row_bounds(*after)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y[11:])
    assert a[0].dtype == a[1].dtype == np.int32 and a[2].dtype == np.bool_


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda sl, ns, spl, m: (sl, ns, spl[:-1], m[:-1]), id="fewer-splits-than-counted"),
        pytest.param(lambda sl, ns, spl, m: (sl, ns, spl, m[:-1]), id="modes-shorter-than-splits"),
        pytest.param(lambda sl, ns, spl, m: (sl + np.array([0, 1], np.int32), ns, spl, m), id="lens-do-not-tile"),
    ],
)
def test_malformed_record_is_refused(bad):
    args = _packed([[(3, "causal"), (2, "full")], [(4, "noise"), (1, "causal")]])
    with pytest.raises(ValueError):
        row_bounds(*bad(*args))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dense_mask_on_cuda_equals_reference():
    """Built on the GPU (as ``SimpleCustomBatch.cuda`` does), the mask is still the reference's."""
    rng = np.random.RandomState(0)
    samples = [[(int(rng.randint(0, 40)), MODES[rng.randint(3)]) for _ in range(rng.randint(1, 8))] for _ in range(20)]
    sample_lens, sample_num_splits, split_lens, modes = _packed(samples)
    start, limit, keep = (torch.from_numpy(a).cuda() for a in row_bounds(sample_lens, sample_num_splits, split_lens, modes))
    pos = 0
    for n, s in zip(sample_lens.tolist(), samples):
        ours = dense_mask(start[pos : pos + n], limit[pos : pos + n], keep[pos : pos + n])
        assert ours.is_cuda
        ref = reference.prepare_attention_mask_per_sample([a for a, _ in s], [m for _, m in s], device="cuda")
        _assert_same(ours, ref, str(s))
        pos += n
