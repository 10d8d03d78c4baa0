"""Balanced samples (``prepack.engine.step_split``): a batch cut into its samples and joined again is
the same batch byte for byte; a step's re-split holds the same samples (a multiset), each with the
reference's tensors as the loader builds them, VAE samples in their reference batch, every batch
within its capacity and the costliest never costlier than the reference's."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from prepack.engine.resplit import samples_of
from loader.batch import SimpleCustomBatch
from prepack.engine.step_split import join_samples, split_batch, split_step
from schemas.cost import CostModel, terms_of
from schemas.anatomy import FIELD_KINDS, IMAGE, NOT_STORED, SAMPLE_ROWS, VALUE
from schemas.record import encode_record
from tests.helpers.fakepack import BatchSpec, make_batch
from tests.helpers.samples import same, sample_tensors

MODEL = CostModel.default()


def digest(batch) -> str:
    return encode_record(batch).digest


def step_of(seed: int, w: int = 6):
    """W batches: some with VAE samples, some ViT and text only (which may move), of unequal cost."""
    out = []
    for b in range(w):
        spec = BatchSpec(use_flex=True, n_samples=2 + (seed + b) % 5, vae=b % 3 == 0, max_side=3 + b % 3)
        batch = make_batch(seed * 1000 + b, spec)
        batch.max_num_tokens = int(batch.sequence_length) * 3 // 2  # room to move samples in
        out.append(batch)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_a_batch_cut_and_joined_is_itself(seed):
    batch = make_batch(seed, BatchSpec(use_flex=bool(seed % 2), n_samples=1 + seed % 4))
    samples = split_batch(batch)
    assert len(samples) == batch.num_samples
    assert sum(s.length for s in samples) == batch.sequence_length
    assert digest(join_samples(samples, batch)) == digest(batch)


@pytest.mark.parametrize("seed", range(12))
def test_cut_and_join_carry_every_field(seed):
    """Field by field as ``FIELD_KINDS`` lists them: a sample holds its rows of every field with rows
    per sample, split, position, token or image use; joined again each field is the batch's, its
    dtype and shape too, and the fields the record does not store are left empty."""
    spec = BatchSpec(use_flex=bool(seed % 2), n_samples=1 + seed % 4, vit=seed % 3 != 1, vae=seed % 3 != 2)
    batch = make_batch(seed, spec)
    batch.image_sources = [None] * len(batch.image_heights)
    samples = split_batch(batch)
    for s in samples:
        assert set(s.rows) == {name for name, k in FIELD_KINDS.items() if k.rows in SAMPLE_ROWS}
        assert all(set(img.rows) == {n for n, k in FIELD_KINDS.items() if (k.rows, k.values) == (IMAGE, VALUE)}
                   for img in s.images)
    joined = join_samples(samples, batch)
    for name, kind in FIELD_KINDS.items():
        want, got = getattr(batch, name), getattr(joined, name)
        if kind.values == NOT_STORED:
            assert got == [], name
        elif isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            assert got == want, name


def test_joined_in_another_order_changes_only_where_samples_lie():
    batch = make_batch(3, BatchSpec(n_samples=3))
    samples = split_batch(batch)
    other = join_samples(samples[::-1], batch)
    assert digest(other) != digest(batch)
    assert sorted(s.digest() for s in split_batch(other)) == sorted(s.digest() for s in samples)


@pytest.mark.parametrize("seed", range(8))
def test_a_step_re_split_keeps_its_samples_and_their_tensors(seed):
    step = step_of(seed)
    out = split_step(step, MODEL)
    assert len(out) == len(step)
    before = [split_batch(b) for b in step]
    after = [split_batch(b) for b in out]
    assert Counter(s.digest() for ss in before for s in ss) == Counter(s.digest() for ss in after for s in ss)
    home = {s.digest(): b for b, ss in enumerate(before) for s in ss}
    for b, ss in enumerate(after):
        assert sum(s.length for s in ss) <= max(step[b].max_num_tokens, step[b].sequence_length)
        for s in ss:
            if s.has_vae:
                assert home[s.digest()] == b, "a sample with a VAE image left its batch"
    cost = lambda bs: max(float(MODEL.estimate(terms_of(b))) for b in bs)  # noqa: E731
    assert cost(out) <= cost(step) + 1e-9
    assert [digest(b) for b in split_step(step, MODEL)] == [digest(b) for b in out]  # deterministic
    # each sample's tensors, as the loader builds them, are the reference's
    ref = {}
    for b in step:
        d = SimpleCustomBatch(b).to_dict()
        for i, s in enumerate(split_batch(b)):
            ref[s.digest()] = sample_tensors(d, i)
    for b in out:
        d = SimpleCustomBatch(b).to_dict()
        for i, s in enumerate(split_batch(b)):
            assert same(sample_tensors(d, i), ref[s.digest()])


def test_samples_move_when_that_evens_the_step():
    moved = 0
    for seed in range(8):
        step = step_of(seed)
        out = split_step(step, MODEL)
        moved += sum(digest(a) != digest(b) for a, b in zip(step, out))
        costs = lambda bs: [float(MODEL.estimate(terms_of(b))) for b in bs]  # noqa: E731
        assert max(costs(out)) <= max(costs(step)) + 1e-9
    assert moved > 0, "no step was re-split: the test data gives the balancer nothing to do"


def test_batch_costs_add_up_over_samples():
    step = step_of(5)
    for b in split_step(step, MODEL):
        samples, fixed = samples_of(b, MODEL)
        assert fixed + sum(s.cost for s in samples) == pytest.approx(float(MODEL.estimate(terms_of(b))), rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_a_re_split_of_framed_records_passes_their_frames_through_and_writes_the_same_bytes(seed, monkeypatch):
    """Balancing reads the reference's records with every picture its pixel index lists left as its
    compressed frame (``record_to_framed_batch``): the re-split moves frames, never decompresses or
    compresses them, and writes the records (digests and bytes) the decoded path writes."""
    from schemas import compression as compression_module
    from schemas.compression import Compression
    from schemas.pixel_table import image_digest
    from schemas.record import record_to_batch, record_to_framed_batch

    comp = Compression.parse("zstd:1")
    step = step_of(seed)
    records = [encode_record(b, comp) for b in step]
    decoded = [record_to_batch(r.record) for r in records]
    # the pixel index lists every picture but the first of each batch: that one is decompressed
    framed = [record_to_framed_batch(r.record, {i: image_digest(b.coded_image(i)) for i in range(1, len(b.image_heights))},
                                     comp.frame_format) for r, b in zip(records, decoded)]
    assert all(f.image_stored[i].frame is not None for f in framed for i in range(1, len(f.image_heights)))
    want = [encode_record(b, comp) for b in split_step(decoded, MODEL)]
    calls = []
    real = compression_module.decompress
    monkeypatch.setattr(compression_module, "decompress", lambda *a: calls.append(1) or real(*a))
    got = [encode_record(b, comp) for b in split_step(framed, MODEL)]
    assert not calls, "a frame passed through was decompressed"
    assert [g.digest for g in got] == [w.digest for w in want]
    assert all(g.record.equals(w.record) for g, w in zip(got, want))
