"""A packed batch's anatomy (``schemas.anatomy``): every field has a kind, a field without one is
refused, and ``batch_anatomy`` gives each row of each field to the sample whose span holds it."""

from __future__ import annotations

import copy
from dataclasses import field, fields, make_dataclass

import numpy as np
import pytest

from schemas import anatomy
from schemas.anatomy import (FIELD_KINDS, POSITIONS, SAMPLE_ROWS, VAE, VAE_TOKEN, VIT, VIT_TOKEN, FieldKind,
                             batch_anatomy, check_field_kinds)
from schemas.errors import PackingError
from schemas.packed_batch import PackedBatch
from tests.helpers.fakepack import BatchSpec, make_batch


def test_every_field_has_a_kind():
    assert list(FIELD_KINDS) == [f.name for f in fields(PackedBatch)]
    check_field_kinds()


def test_a_field_without_a_kind_is_refused():
    grown = make_dataclass("Grown", [("extra", np.ndarray, field(default_factory=lambda: np.zeros(0)))],
                           bases=(PackedBatch,))
    with pytest.raises(TypeError, match="extra"):
        check_field_kinds(grown)


@pytest.mark.parametrize("name, kind", [("image_heights", FieldKind(anatomy.BATCH, anatomy.PIXELS)),
                                        ("origins", FieldKind("token", anatomy.VALUE)),
                                        ("image_sources", FieldKind(anatomy.IMAGE))])
def test_a_kind_the_cut_cannot_carry_is_refused(monkeypatch, name, kind):
    monkeypatch.setitem(FIELD_KINDS, name, kind)
    with pytest.raises(TypeError, match=name):
        check_field_kinds()


@pytest.mark.parametrize("seed", range(10))
def test_each_row_belongs_to_the_sample_whose_span_holds_it(seed):
    batch = make_batch(seed, BatchSpec(n_samples=1 + seed % 4, use_flex=bool(seed % 2)))
    body = batch_anatomy(batch)
    assert body.num_samples == batch.num_samples
    assert np.diff(body.starts).tolist() == batch.sample_lens.tolist()
    assert body.owners[anatomy.POSITION].tolist() == body.owner(np.arange(batch.sequence_length)).tolist()
    for name, kind in FIELD_KINDS.items():
        if kind.rows in SAMPLE_ROWS:
            assert len(getattr(batch, name)) == len(body.owners[kind.rows]), name
            assert sorted(np.concatenate([body.rows(kind.rows, i) for i in range(body.num_samples)]).tolist()) == \
                list(range(len(getattr(batch, name))))
        if kind.values == POSITIONS:  # a position's row is its sample's
            assert body.owner(getattr(batch, name)).tolist() == body.owners[kind.rows].tolist(), name
    # an image use, its tokens and its image's first position are the same sample's
    assert body.owners[VIT_TOKEN].tolist() == body.owner(batch.packed_vit_token_indexes).tolist()
    assert body.owners[VAE_TOKEN].tolist() == body.owner(batch.packed_vae_token_indexes).tolist()
    lengths = np.concatenate([batch.vit_token_seqlens, np.prod(batch.vae_latent_shapes, axis=1)])
    tokens = np.concatenate([batch.packed_vit_token_indexes, batch.packed_vae_token_indexes])
    assert body.use_first.tolist() == [min(run) for run in np.split(tokens, np.cumsum(lengths)[:-1]) if len(run)]
    first = body.image_first()
    assert len(first) == len(batch.image_heights)
    for img in range(len(first)):
        uses = body.use_first[body.use_images == img]
        assert first[img] == (uses.min() if len(uses) else -1)
    for use, ids in ((VIT, batch.vit_image_ids), (VAE, batch.vae_image_ids)):
        for u, img in enumerate(ids.tolist()):
            assert img in body.sample_images(int(body.owners[use][u])).tolist()
    for i in range(body.num_samples):
        images = body.sample_images(i)
        starts = [min(int(body.use_first[u]) for u in np.flatnonzero((body.use_owner == i) & (body.use_images == img)))
                  for img in images.tolist()]
        assert starts == sorted(starts)


@pytest.mark.parametrize("damage, match", [
    (lambda b: setattr(b, "sequence_length", b.sequence_length + 1), "samples span"),
    (lambda b: setattr(b, "packed_timesteps", b.packed_timesteps[:-1]), "packed_timesteps has"),
    (lambda b: setattr(b, "attn_modes", b.attn_modes[:-1]), "attn_modes has"),
    (lambda b: setattr(b, "origins", b.origins[:-1]), "origins has"),
    (lambda b: setattr(b, "ce_loss_indexes", b.ce_loss_indexes + b.sequence_length), "ce rows lie outside"),
    (lambda b: setattr(b, "vae_image_ids", b.vae_image_ids + len(b.image_heights)), "outside its table"),
])
def test_a_batch_whose_fields_disagree_is_refused(damage, match):
    batch = copy.copy(make_batch(7, BatchSpec(n_samples=3)))
    assert len(batch.ce_loss_indexes) and len(batch.vae_image_ids)
    damage(batch)
    with pytest.raises(PackingError, match=match):
        batch_anatomy(batch)
