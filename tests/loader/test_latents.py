"""The loader's VAE latents (``vae_latents=``, ``loader/latents.py``): ``padded_latent`` is what the
recipe's ``vae.encode(padded_images)`` gives for the same noise, so a tiny BAGEL stage-2 training
step from latents equals the step from pixels; a shard without latents is refused in one line
naming it (``"prefer"``: pixels there); damaged latents are refused; resume and balance work, and
balancing leaves the VAE out of a batch's cost."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch

from loader import PackedShardDataset
from loader.balance import Balance
from loader.latents import noise_seed
from loader.reader import Pack, iter_records
from prepack.run.latents.vae_encoder import CPU_THREADS
from prepack.run.latents.stage import LatentsOptions, run_latents
from schemas.cost import CostModel
from schemas.errors import MissingLatents
from schemas.latents import LatentsFile, StreamLatents, crop_shape
from schemas.layout import shard_latents_file, stream_latents_file
from schemas.record import record_to_batch
from tests.helpers.fakepack import make_pack
from tests.helpers.plain_loop import FORWARD_KEYS
from tests.helpers.tiny_bagel import TinyBagel
from tests.helpers.recipe_noise import randn_like_from

Z = 16  # BAGEL's latent channels


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    """NeMo's autoencoder at BAGEL's real channel sizes, random weights, and its weights file."""
    from nemo_automodel.components.models.bagel.autoencoder import load_bagel_autoencoder
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ae, _ = load_bagel_autoencoder(None)
    path = str(tmp_path_factory.mktemp("vae") / "ae.safetensors")
    save_file({k: v.contiguous() for k, v in ae.state_dict().items()}, path)
    return ae.eval(), path


@pytest.fixture(scope="module")
def pack(tmp_path_factory, vae):
    """A small pack (two streams, several shards, tiny VAE pictures) and its latents."""
    out = str(tmp_path_factory.mktemp("latents") / "pack")
    make_pack(out, world_size=2, num_workers=1, lengths=[4, 3], shard_bytes=30 * 1024)
    run_latents(out, LatentsOptions(weights=vae[1], device="cpu", inline=True, bar=False))
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _both(pack: str):
    """``(stream, record, batch, the same batch with latents)`` of every record, rank s reading stream s."""
    for s in range(Pack.open(pack).num_streams):
        plain = PackedShardDataset(pack, rank=s, world_size=2)
        latent = PackedShardDataset(pack, rank=s, world_size=2, vae_latents=True)
        for i, (a, b) in enumerate(zip(plain, latent)):
            yield s, i, a, b


def _vae_records(out: str) -> list[tuple[int, int, object]]:
    p = Pack.open(out)
    return [(s, i, record_to_batch(r)) for s in range(p.num_streams) for i, r in iter_records(p, s)
            if len(record_to_batch(r).vae_image_ids)]


def _recipe_latent(ae, padded_images: torch.Tensor, moments_dtype: torch.dtype, shapes, seed: int) -> torch.Tensor:
    """NeMo's ``AutoEncoder.encode`` (its DiagonalGaussian draws ``torch.randn_like``), with that draw
    replaced by the loader's noise for the record (image after image, in the moments' dtype) at
    each image's latent rows: what the recipe computes when its noise is the loader's."""
    generator = torch.Generator().manual_seed(seed)
    eps = [torch.randn((Z, *crop_shape(s)), dtype=moments_dtype, generator=generator) for s in shapes]
    threads = torch.get_num_threads()
    torch.set_num_threads(CPU_THREADS)  # the stage's: float32 convolutions' last bits follow the thread count
    try:
        with randn_like_from(eps), torch.no_grad():
            return ae.encode(padded_images)
    finally:
        torch.set_num_threads(threads)


def test_padded_latent_is_the_recipes_encode_for_the_same_noise(pack, vae):
    ae, _ = vae
    records = {(s, i): b for s, i, b in _vae_records(pack)}
    assert records, "no record with VAE pictures: the test proves nothing"
    p = Pack.open(pack)
    seen = 0
    for s, i, a, b in _both(pack):
        if (s, i) not in records:
            assert "padded_latent" not in b.to_dict() and "padded_images" not in b.to_dict()
            continue
        da, db = a.to_dict(), b.to_dict()
        assert "padded_images" in da and "padded_images" not in db and "padded_latent" in db
        assert set(da) - {"padded_images"} == set(db) - {"padded_latent"}  # the rest of the batch is the same
        for key in set(da) - {"padded_images"}:
            assert _same(da[key], db[key]), key
        shapes = records[(s, i)].vae_latent_shapes.reshape(-1, 2).tolist()
        want = _recipe_latent(ae, da["padded_images"], torch.float32, shapes, noise_seed(p.record_digest(s, i), 0))
        got = db["padded_latent"]
        assert got.dtype == torch.float32 and got.shape == want.shape
        for k, shape in enumerate(shapes):  # the rows the model reads of each image
            h, w = crop_shape(shape)
            assert torch.equal(got[k, :, :h, :w], want[k, :, :h, :w])
        seen += 1
    assert seen >= 2


def test_the_noise_is_the_records_and_the_epochs(pack):
    def first_latent(epoch: int) -> torch.Tensor:
        ds = PackedShardDataset(pack, rank=0, world_size=2, vae_latents=True)
        ds.set_epoch(epoch)
        return next(b for b in ds if "padded_latent" in b.to_dict()).padded_latent

    assert torch.equal(first_latent(0), first_latent(0))  # deterministic: a resumed run draws the same
    assert not torch.equal(first_latent(0), first_latent(1))  # a new pass, new noise


def test_a_stage_2_training_step_from_latents_equals_the_step_from_pixels(pack, vae):
    """Tiny BAGEL at BAGEL's latent channels: one step's loss and gradients, from the recipe's encode of
    ``padded_images`` (the loader's noise) and from the loader's ``padded_latent``."""
    ae, _ = vae
    p = Pack.open(pack)
    steps = 0
    for s, i, a, b in _both(pack):
        da, db = a.to_dict(), b.to_dict()
        if "padded_images" not in da:
            continue
        shapes = [tuple(x) for x in a.patchified_vae_latent_shapes]
        da["padded_latent"] = _recipe_latent(ae, da.pop("padded_images"), torch.float32, shapes,
                                             noise_seed(p.record_digest(s, i), 0))
        results = []
        for data in (da, db):
            torch.manual_seed(3)
            model = TinyBagel(latent_channels=Z)
            out = model(**{k: v for k, v in data.items() if k in FORWARD_KEYS})
            loss = sum(out[k].mean() for k in ("ce", "mse") if out[k] is not None)
            loss.backward()
            grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
            assert grads["vae_in.weight"].abs().sum() > 0  # the latent is in the step
            results.append((loss.item(), list(grads.values())))
        (loss_a, grads_a), (loss_b, grads_b) = results
        assert loss_a == loss_b  # CPU, float32: the same arithmetic, bit for bit
        assert len(grads_a) == len(grads_b) and all(torch.equal(x, y) for x, y in zip(grads_a, grads_b))
        steps += 1
    assert steps >= 1, "no record with VAE pictures: the test proves nothing"


def test_a_shard_without_latents_is_refused_naming_it_unless_prefer(pack, tmp_path):
    out = str(tmp_path / "partial")
    shutil.copytree(pack, out)
    assert json.load(open(os.path.join(out, stream_latents_file(1))))["shards"]
    os.remove(os.path.join(out, stream_latents_file(1)))  # as if stream 1 had no latents yet
    with pytest.raises(MissingLatents, match=r"shard-00000\.latents\.arrow: no VAE latents for shard 0 of stream 1"):
        list(PackedShardDataset(out, rank=1, world_size=2, vae_latents=True))
    got = list(PackedShardDataset(out, rank=1, world_size=2, vae_latents="prefer"))
    assert any("padded_images" in b.to_dict() for b in got)  # pixels where there are no latents
    assert list(PackedShardDataset(out, rank=0, world_size=2, vae_latents=True))  # stream 0 still has them
    with pytest.raises(ValueError, match="vae_latents must be"):
        PackedShardDataset(out, rank=0, world_size=2, vae_latents="yes")


def test_damaged_or_foreign_latents_are_refused(pack, tmp_path):
    out = str(tmp_path / "damaged")
    shutil.copytree(pack, out)
    name = os.path.join(out, shard_latents_file(0, 0))
    data = bytearray(open(name, "rb").read())
    data[len(data) // 2] ^= 1
    open(name, "wb").write(bytes(data))
    with pytest.raises(MissingLatents, match="damaged or replaced"):
        list(PackedShardDataset(out, rank=0, world_size=2, vae_latents=True))
    # another shard's file (its listing entry moved along): its shard digest gives it away
    shutil.copy(os.path.join(pack, shard_latents_file(0, 1)), name)
    doc = StreamLatents.from_json(open(os.path.join(pack, stream_latents_file(0))).read())
    moved = doc.with_shard(dataclasses.replace(doc.get(1), shard=0))
    open(os.path.join(out, stream_latents_file(0)), "w").write(moved.to_json())
    with pytest.raises(MissingLatents, match="another shard"):
        list(PackedShardDataset(out, rank=0, world_size=2, vae_latents=True))


def test_resume_and_balance_with_latents(pack):
    def ids(batches):
        return [json.dumps(b.batch_data_indexes, sort_keys=True) for b in batches]

    full = list(PackedShardDataset(pack, rank=0, world_size=2, vae_latents=True))
    ds = PackedShardDataset(pack, rank=0, world_size=2, vae_latents=True)
    it = iter(ds)
    head = [next(it) for _ in range(2)]
    again = PackedShardDataset(pack, rank=0, world_size=2, vae_latents=True)
    again.load_state_dict(ds.state_dict())
    tail = list(again)
    assert ids(head + tail) == ids(full)
    for x, y in zip(head + tail, full):
        if "padded_latent" in y.to_dict():
            assert torch.equal(x.padded_latent, y.padded_latent)  # the same noise after a resume
    # latents x world-size change: every rank's state merged, resumed by one rank: each record's noise is
    # its digest's and the epoch's, not the rank's, so every latent is the one the two ranks would draw
    states = []
    by_record = {}
    for r in range(2):
        ds = PackedShardDataset(pack, rank=r, world_size=2, vae_latents=True)
        it = iter(ds)
        next(it)
        states.append(ds.state_dict())
        for b in PackedShardDataset(pack, rank=r, world_size=2, vae_latents=True):
            by_record[json.dumps(b.batch_data_indexes, sort_keys=True)] = b
    one = PackedShardDataset(pack, rank=0, world_size=1, vae_latents=True)
    one.load_state_dict(PackedShardDataset.merge_states(states))
    rest = list(one)
    assert rest and len(rest) == len(by_record) - 2
    for b in rest:
        want = by_record[json.dumps(b.batch_data_indexes, sort_keys=True)]
        if "padded_latent" in want.to_dict():
            assert torch.equal(b.padded_latent, want.padded_latent)
    bal = PackedShardDataset(pack, rank=0, world_size=2, vae_latents=True, balance=Balance(micro_batches=2))
    assert bal.balance.cost_model == CostModel.default().without("vae")  # the encode is not the training's
    both = [b for r in range(2) for b in PackedShardDataset(pack, rank=r, world_size=2, vae_latents=True,
                                                            balance=Balance(micro_batches=2))]
    plain = [b for r in range(2) for b in PackedShardDataset(pack, rank=r, world_size=2)]
    assert sorted(ids(both)) == sorted(ids(plain))
    assert all("padded_images" not in b.to_dict() for b in both)


def test_moments_are_stored_for_each_vae_image_and_nothing_else(pack):
    p = Pack.open(pack)
    for s in range(p.num_streams):
        for sh in p.index(s).shards:
            f = LatentsFile(open(os.path.join(pack, shard_latents_file(s, sh.shard)), "rb").read(), "x")
            for j, rec in enumerate(sh.records):
                batch = record_to_batch(next(r for i, r in iter_records(p, s, sh.first_record + j,
                                                                           stop=sh.first_record + j + 1)))
                moments = f.moments(j)
                assert [m.shape for m in moments] == [(2 * Z, *crop_shape(x))
                                                      for x in np.asarray(batch.vae_latent_shapes).reshape(-1, 2)]


def test_follow_waits_for_latents_still_being_encoded(pack, tmp_path):
    """``prepack latents --follow`` beside training: a followed loader waits for a shard's latents."""
    import threading
    import time

    out = str(tmp_path / "encoding")
    shutil.copytree(pack, out)
    listing = os.path.join(out, stream_latents_file(0))
    saved = open(listing, "rb").read()
    os.remove(listing)  # the stage has not reached stream 0 yet
    got, errors = [], []

    def read():
        try:
            ds = PackedShardDataset(out, rank=0, world_size=2, vae_latents=True, follow=True, poll_s=0.02,
                                    timeout_s=60)
            got.extend(b.to_dict().get("padded_latent") for b in ds)
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and not got and not errors  # waiting for the latents
    open(listing, "wb").write(saved)  # the stage commits stream 0's latents
    t.join(60)
    assert not errors and not t.is_alive()
    want = [b.to_dict().get("padded_latent") for b in PackedShardDataset(pack, rank=0, world_size=2, vae_latents=True)]
    assert len(got) == len(want) and all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want))


def test_latents_of_other_weights_in_one_training_are_refused(pack, tmp_path):
    """Streams (or a continuation's parent) encoded with other VAE weights: one training, one VAE."""
    from tests.helpers.latents import write_weights

    out = str(tmp_path / "mixed")
    shutil.copytree(pack, out)
    for name in os.listdir(os.path.join(out, "stream-00001")):
        if "latents" in name:
            os.remove(os.path.join(out, "stream-00001", name))
    other = write_weights(str(tmp_path / "other.safetensors"), seed=1)
    run_latents(out, LatentsOptions(weights=other, device="cpu", inline=True, bar=False, streams=(1,)))
    assert list(PackedShardDataset(out, rank=1, world_size=2, vae_latents=True))  # each stream alone is fine
    with pytest.raises(MissingLatents, match="encoded by .* with weights .*, but the latents read before"):
        list(PackedShardDataset(out, rank=0, world_size=1, vae_latents=True))
