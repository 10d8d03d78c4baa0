"""Property tests of the packer's invariants (hypothesis).

Layout: index sets disjoint and covering the sequence, lengths consistent, labels equal to the
next token at each loss position, position ids per split, split sums.  Packer: every sample read
is packed or counted, and a stream resumed from a checkpoint at any batch continues identically.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prepack.engine.state_codec import state_from_payload, state_to_payload
from schemas.checkpoint import CheckpointDoc
from prepack.engine.sequence import SequenceBuilder
from prepack.engine.packer import StreamPacker
from prepack.engine.sample import PlanItem, Sample, SampleImage
from schemas.config import PackingKnobs
from schemas.config_file import load_config
from schemas.packed_batch import ATTN_MODES, SampleOrigin
from schemas.record import batch_to_record, record_digest

SPECIAL = SimpleNamespace(bos_token_id=1, eos_token_id=2, start_of_image=3, end_of_image=4)
NORM = (0.5, 0.5, 0.5, 0.5, 0.5, 0.5)


@st.composite
def samples(draw):
    plan, texts, images = [], [], []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["text", "vit_image", "vae_image"]))
        cfg = draw(st.integers(0, 1))
        loss = draw(st.integers(0, 1))
        if kind == "text":
            texts.append(draw(st.lists(st.integers(10, 1000), min_size=0, max_size=12)))
            plan.append(PlanItem("text", enable_cfg=cfg, loss=loss))
        else:
            p = 14 if kind == "vit_image" else 16
            h, w = draw(st.integers(1, 4)) * p, draw(st.integers(1, 4)) * p
            images.append(SampleImage(None, w, h, NORM, pixels=np.zeros((h, w, 3), np.uint8)))
            plan.append(PlanItem(kind, enable_cfg=cfg, loss=loss if kind == "vae_image" else 0))
    origin = SampleOrigin("g", "d", 0, [0], True, "f", -1, 0)
    return Sample(plan, texts, images, 0, origin)


@settings(max_examples=150, deadline=None)
@given(st.lists(samples(), min_size=1, max_size=6), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1),
       st.integers(0, 2**32 - 1), st.booleans())
def test_layout_invariants(batch_samples, p_text, p_vit, p_vae, seed, interpolate):
    knobs = PackingKnobs(text_cond_dropout_prob=p_text, vit_cond_dropout_prob=p_vit, vae_cond_dropout_prob=p_vae,
                         interpolate_pos=interpolate)
    b_ = SequenceBuilder(knobs, SPECIAL, random.Random(seed), np.random.RandomState(seed))
    for s in batch_samples:
        b_.add(s)
    b = b_.build()
    n = b.sequence_length
    text, vit, vae = (set(b.packed_text_indexes.tolist()), set(b.packed_vit_token_indexes.tolist()),
                      set(b.packed_vae_token_indexes.tolist()))
    # disjoint and covering
    assert len(text) == len(b.packed_text_indexes) and not text & vit and not text & vae and not vit & vae
    assert text | vit | vae == set(range(n))
    # lengths
    assert len(b.packed_text_ids) == len(b.packed_text_indexes)
    assert len(b.packed_position_ids) == n == int(b.sample_lens.sum()) == int(b.split_lens.sum())
    assert len(b.attn_modes) == len(b.split_lens) == int(b.sample_num_splits.sum())
    pos = 0
    for k, (lens, modes) in enumerate(b.sample_splits()):
        assert sum(lens) == b.sample_lens[k]
        assert all(m in ATTN_MODES for m in modes)
        pos += sum(lens)
    assert int(b.vit_token_seqlens.sum()) == len(b.packed_vit_token_indexes) == len(b.packed_vit_position_ids)
    assert len(b.packed_latent_position_ids) == len(b.packed_vae_token_indexes) == len(b.packed_timesteps)
    assert len(b.vae_latent_shapes) == len(b.vae_image_ids)
    assert sum(int(h) * int(w) for h, w in b.vae_latent_shapes) == len(b.packed_vae_token_indexes)
    # labels: the next token of the sequence at every text loss position
    seq = np.full(n + 1, -1, np.int64)
    seq[b.packed_text_indexes] = b.packed_text_ids
    assert len(b.packed_label_ids) == len(b.ce_loss_indexes) == len(b.ce_loss_weights)
    assert set(b.ce_loss_indexes.tolist()) <= text
    assert np.array_equal(b.packed_label_ids, seq[b.ce_loss_indexes + 1])
    assert np.all(b.ce_loss_weights > 0) and np.all(b.ce_loss_weights <= 1)
    # timesteps: finite exactly at MSE positions
    mse = set(b.mse_loss_indexes.tolist())
    assert mse <= vae
    order = b.packed_vae_token_indexes.tolist()
    for t, i in zip(b.packed_timesteps.tolist(), order):
        assert (i in mse) == np.isfinite(t)
    # position ids: +1 steps inside text (causal) splits, one rope id per image split
    ids = b.packed_position_ids
    start = 0
    for lens, modes in b.sample_splits():
        for length, mode in zip(lens, modes):
            part = ids[start : start + length]
            if mode == "causal":
                assert np.array_equal(part, part[0] + np.arange(length))
            else:
                assert np.all(part == part[0])
            start += length


@pytest.fixture(scope="module")
def small_mixed(tmp_path_factory):
    from tests.helpers import datagen as dg

    root = str(tmp_path_factory.mktemp("props"))
    rs = np.random.RandomState(11)
    ds = dg.Dataset(root)
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 5, 5 * i) for i in range(2)])
    dg.add_edit(ds, [dg.good_edit_rows(rs, 3, 3 * i) for i in range(2)])
    lines, files = dg.good_sft(rs, 12)
    dg.add_sft(ds, lines, files)
    return ds


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(expected=st.integers(300, 1500), extra=st.integers(0, 600), prefer=st.integers(0, 2500),
       buffer_size=st.integers(0, 6), cut=st.integers(1, 9), mandatory=st.sampled_from([None, "t2i_pretrain"]))
def test_packer_accounts_for_every_sample_and_resumes_anywhere(small_mixed, tokenizer_and_special, tmp_path_factory,
                                                               expected, extra, prefer, buffer_size, cut, mandatory):
    from tests.helpers import datagen as dg

    root = str(tmp_path_factory.mktemp("cfg"))
    ds = dg.Dataset(root, groups=json.loads(json.dumps(small_mixed.groups)), info=small_mixed.info)
    if mandatory:
        ds.groups[mandatory]["is_mandatory"] = True
    knobs = dict(expected_num_tokens=expected, max_num_tokens=expected + extra, max_num_tokens_per_sample=1200,
                 prefer_buffer_before=prefer, max_buffer_size=buffer_size, use_flex=False)
    cfg = load_config(ds.config(knobs=knobs, prepack={"batches_per_stream": 10}))
    tok, special = tokenizer_and_special

    p = StreamPacker(cfg, 0, tok, special)
    batches = list(p)
    full = [record_digest(batch_to_record(b)) for b in batches]
    c = p.final_counters()
    read, packed = sum(c.samples_read.values()), sum(c.samples_packed.values())
    packer_drops = sum(v for k, v in c.drops.items() if ":" not in k and k != "batch_refused_over_max_num_tokens")
    assert read == packed + packer_drops, (c.drops, read, packed)
    assert packed == sum(b.num_samples for b in batches)
    # resume from a checkpoint taken after `cut` batches (serialised through JSON + Arrow)
    q = StreamPacker(cfg, 0, tok, special)
    it = iter(q)
    head = [record_digest(batch_to_record(next(it))) for _ in range(min(cut, len(full)))]
    doc, pixels = state_to_payload(q.state())
    r = StreamPacker(cfg, 0, tok, special, state=state_from_payload(CheckpointDoc.from_json(doc.to_json()), pixels))
    assert head + [record_digest(batch_to_record(b)) for b in r] == full
