"""Loader output == what the reference's own functions make from the same content; integrity checks."""

from __future__ import annotations

import os
import shutil
import types

import numpy as np
import pytest
import torch
from tests.helpers.fakepack import NORMS, BatchSpec, make_batch, make_pack
from PIL import Image

from loader import Pack, PackedShardDataset, PackIntegrityError, SimpleCustomBatch, open_stream
from loader.normalize import norm_table
from schemas.record import batch_to_record, record_to_batch

ref = pytest.importorskip("nemo_automodel.components.datasets.multimodal")
tv = pytest.importorskip("torchvision.transforms")


def reference_image(pixels: np.ndarray, norm: np.ndarray) -> torch.Tensor:
    """The reference ImageTransform after its resize: ToTensor + Normalize(inplace) on a PIL image."""
    tensor = tv.ToTensor()(Image.fromarray(np.ascontiguousarray(pixels), "RGB"))
    return tv.Normalize(mean=list(norm[:3]), std=list(norm[3:]), inplace=True)(tensor)


def _split(flat: np.ndarray, sizes) -> list[torch.Tensor]:
    return list(torch.from_numpy(flat.astype(np.int64)).split([int(n) for n in sizes]))


def reference_to_dict(pb) -> dict:
    """Reference ``SimpleCustomBatch(...).to_dict()`` built with the reference's own functions."""
    status = {
        "sample_lens": pb.sample_lens.tolist(),
        "packed_text_ids": pb.packed_text_ids.tolist(),
        "packed_text_indexes": pb.packed_text_indexes.tolist(),
        "packed_position_ids": pb.packed_position_ids.tolist(),
        "nested_attention_masks": [],
        "split_lens": [],
        "attn_modes": [],
        "vae_image_tensors": [reference_image(pb.image(i), pb.image_norm[i]) for i in pb.vae_image_ids],
        "vae_latent_shapes": [tuple(hw) for hw in pb.vae_latent_shapes.tolist()],
        "packed_latent_position_ids": _split(pb.packed_latent_position_ids, np.prod(pb.vae_latent_shapes, axis=1)),
        "packed_vae_token_indexes": pb.packed_vae_token_indexes.tolist(),
        "packed_vit_tokens": [
            ref.patchify(reference_image(pb.image(i), pb.image_norm[i]), pb.vit_patch_size) for i in pb.vit_image_ids
        ],
        "packed_vit_position_ids": _split(pb.packed_vit_position_ids, pb.vit_token_seqlens),
        "packed_vit_token_indexes": pb.packed_vit_token_indexes.tolist(),
        "vit_token_seqlens": pb.vit_token_seqlens.tolist(),
        "packed_timesteps": pb.packed_timesteps.tolist(),
        "mse_loss_indexes": pb.mse_loss_indexes.tolist(),
        "packed_label_ids": pb.packed_label_ids.tolist(),
        "ce_loss_indexes": pb.ce_loss_indexes.tolist(),
        "ce_loss_weights": pb.ce_loss_weights.tolist(),
    }
    for split_lens, modes in pb.sample_splits():
        if pb.use_flex:
            status["split_lens"] += split_lens
            status["attn_modes"] += modes
        else:
            status["nested_attention_masks"].append(ref.prepare_attention_mask_per_sample(split_lens, modes))
    owner = types.SimpleNamespace(use_flex=pb.use_flex, max_num_tokens=pb.max_num_tokens)
    data = ref.PackedDataset.to_tensor(owner, status)
    data["batch_data_indexes"] = [o.reference_dict() for o in pb.origins]
    return ref.SimpleCustomBatch([data]).to_dict()


def assert_same(ours, theirs, path="batch"):
    assert type(ours) is type(theirs), f"{path}: {type(ours)} != {type(theirs)}"
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype, f"{path}: dtype {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{path}: shape {tuple(ours.shape)} != {tuple(theirs.shape)}"
        assert torch.equal(ours.cpu(), theirs), f"{path}: values differ"
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), f"{path}: keys {list(ours)} != {list(theirs)}"
        for k in theirs:
            assert_same(ours[k], theirs[k], f"{path}.{k}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), f"{path}: length {len(ours)} != {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"


SPECS = [
    BatchSpec(use_flex=True),
    BatchSpec(use_flex=False),
    BatchSpec(use_flex=False, vae_targets=False),  # mse_loss_indexes empty -> float32 quirk
    BatchSpec(use_flex=True, vae_targets=False, labels=False),
    BatchSpec(use_flex=False, vit=False, vae=False),  # text only
    BatchSpec(use_flex=True, vit=False, labels=False, n_samples=1),
    BatchSpec(use_flex=False, vae=False, n_samples=3, max_side=6),
]


@pytest.mark.parametrize("spec_index", range(len(SPECS)))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_matches_reference(spec_index, seed):
    pb = record_to_batch(batch_to_record(make_batch(seed * 31 + spec_index, SPECS[spec_index])))
    assert_same(SimpleCustomBatch(pb).to_dict(), reference_to_dict(pb))


def test_edge_cases_are_exercised():
    """Guard for the test above: the specs really produce the presence/dtype edge cases."""
    dicts = [SimpleCustomBatch(make_batch(s * 31 + i, SPECS[i])).to_dict() for i in range(len(SPECS)) for s in range(3)]
    assert any(d.get("mse_loss_indexes") is not None and d["mse_loss_indexes"].dtype == torch.float32 for d in dicts)
    assert any("packed_label_ids" not in d for d in dicts)
    assert any("padded_images" not in d and "packed_vit_tokens" not in d for d in dicts)
    assert any("nested_attention_masks" in d for d in dicts) and any("split_lens" in d for d in dicts)
    modes = {m for d in dicts for m in d.get("attn_modes", [])}
    assert modes == {"causal", "full", "noise"}
    sizes = {tuple(d["padded_images"].shape[2:]) for d in dicts if "padded_images" in d}
    assert len(sizes) > 2


def test_attribute_access_and_presence_match_reference():
    pb = make_batch(5, BatchSpec(use_flex=False, vae_targets=False, labels=False))
    ours, theirs = SimpleCustomBatch(pb), ref.SimpleCustomBatch([reference_to_dict(pb)])
    for name in [
        "padded_images",
        "packed_vit_tokens",
        "packed_timesteps",
        "packed_label_ids",
        "split_lens",
        "nested_attention_masks",
    ]:
        assert hasattr(ours, name) == hasattr(theirs, name), name
    assert_same(ours.nested_attention_masks, theirs.nested_attention_masks)
    assert_same(ours.packed_text_ids, theirs.packed_text_ids)
    assert ours.use_flex == theirs.use_flex
    assert ours.packed_text_ids is ours.packed_text_ids  # built once, then cached


@pytest.mark.parametrize("norm", NORMS + [((0.1, 0.7, 0.33), (0.3, 0.9, 0.123))])
def test_norm_table_is_reference_arithmetic(norm):
    """Every (value, channel) of the table equals ToTensor + Normalize of an image holding it."""
    pixels = np.stack([np.arange(256, dtype=np.uint8)] * 3, axis=-1).reshape(16, 16, 3)
    expected = reference_image(pixels, np.array(norm[0] + norm[1])).reshape(3, 256)
    assert torch.equal(norm_table(norm).view(3, 256), expected)


def test_returned_tensors_are_writable_copies():
    pb = record_to_batch(batch_to_record(make_batch(3, BatchSpec(use_flex=True))))
    batch = SimpleCustomBatch(pb)
    before = pb.packed_timesteps.copy()
    batch.packed_timesteps.mul_(2)  # must not write through to the (read-only) record
    batch.ce_loss_weights.add_(1)
    assert np.array_equal(pb.packed_timesteps, before, equal_nan=True)


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pack"))
    make_pack(out, world_size=2, num_workers=2, lengths=[4, 6, 5, 3], shard_bytes=48 * 1024)
    return out


def test_open_stream_reads_every_batch_in_order(pack_dir):
    from tests.helpers.fakepack import stream_batches

    pack = Pack.open(pack_dir)
    assert any(len(pack.index(s).shards) > 1 for s in range(4)), "pack should span several shards"
    for stream in range(4):
        got = [b.to_dict() for b in open_stream(pack_dir, stream)]
        want = [SimpleCustomBatch(b).to_dict() for b in stream_batches(stream, [4, 6, 5, 3][stream])]
        assert_same(got, want)


def test_open_stream_can_be_dropped_midway(pack_dir):
    import threading

    before = threading.active_count()
    it = open_stream(pack_dir, 1)
    next(it)
    del it
    assert threading.active_count() == before


def _copy_pack(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _read_all(path, stream):
    return [b.sequence_length for b in open_stream(path, stream)]


def test_flipped_byte_is_caught(pack_dir, tmp_path):
    path = _copy_pack(pack_dir, tmp_path / "p")
    shard = os.path.join(path, "stream-00001", "shard-00000.arrow")
    data = bytearray(open(shard, "rb").read())
    raw = open(shard, "rb").read()
    # a byte inside the first record's body: right after the file magic + schema message
    pos = len(raw) // 3
    data[pos] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    with pytest.raises(PackIntegrityError, match=r"stream-00001/shard-00000\.arrow: stream 1, record \d"):
        _read_all(path, 1)


def test_truncated_shard_is_caught(pack_dir, tmp_path):
    path = _copy_pack(pack_dir, tmp_path / "p")
    shard = os.path.join(path, "stream-00002", "shard-00001.arrow")
    raw = open(shard, "rb").read()
    open(shard, "wb").write(raw[: len(raw) - 100])
    with pytest.raises(PackIntegrityError, match=r"stream-00002/shard-00001\.arrow: stream 2, record \d+: .*truncated"):
        _read_all(path, 2)
    # without verification the broken file is still reported, by name
    with pytest.raises(PackIntegrityError, match=r"shard-00001\.arrow"):
        [b for b in open_stream(path, 2, verify=False)]


def test_missing_shard_is_caught(pack_dir, tmp_path):
    path = _copy_pack(pack_dir, tmp_path / "p")
    os.remove(os.path.join(path, "stream-00000", "shard-00000.arrow"))
    with pytest.raises(
        PackIntegrityError, match=r"stream-00000/shard-00000\.arrow: stream 0, record 0: shard file is missing"
    ):
        _read_all(path, 0)


def _twin_pack(path, n=3):
    """One stream of n single-record shards, uncompressed and byte-for-byte the same size."""
    from tests.helpers.fakepack import write_pack

    base = make_batch(11, BatchSpec(use_flex=True))
    twins = []
    for i in range(n):
        b = make_batch(11, BatchSpec(use_flex=True))
        b.packed_text_ids = (base.packed_text_ids + i).astype(np.int32)
        b.image_pixels = np.roll(base.image_pixels, i)
        twins.append(b)
    write_pack(path, {0: twins}, world_size=1, num_workers=0, shard_bytes=1, compression="none")
    return base


def test_flipped_pixel_byte_is_caught_by_digest(tmp_path):
    path = str(tmp_path / "p")
    base = _twin_pack(path)
    shard = os.path.join(path, "stream-00000", "shard-00001.arrow")
    data = bytearray(open(shard, "rb").read())
    pos = bytes(data).find(np.roll(base.image_pixels, 1)[100:164].tobytes()) + 7
    assert pos > 7
    data[pos] ^= 0x01
    open(shard, "wb").write(bytes(data))
    with pytest.raises(
        PackIntegrityError, match=r"stream-00000/shard-00001\.arrow: stream 0, record 1: record content digest"
    ):
        _read_all(path, 0)


def test_swapped_shards_are_caught(tmp_path):
    path = str(tmp_path / "p")
    _twin_pack(path)
    d = os.path.join(path, "stream-00000")
    a, b = (os.path.join(d, f"shard-0000{k}.arrow") for k in (1, 2))
    assert os.path.getsize(a) == os.path.getsize(b)
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)
    with pytest.raises(
        PackIntegrityError, match=r"stream-00000/shard-00001\.arrow: stream 0, record 1: shard belongs elsewhere: "
        r"prepack.shard='2' \(expected '1'\)"
    ):
        _read_all(path, 0)


def test_file_level_verification_catches_corruption_outside_records(pack_dir, tmp_path, monkeypatch):
    path = _copy_pack(pack_dir, tmp_path / "p")
    shard = os.path.join(path, "stream-00003", "shard-00000.arrow")
    data = bytearray(open(shard, "rb").read())
    idx = data.find(b"fakepack")  # schema metadata: not part of any record's content
    data[idx] ^= 0x01
    open(shard, "wb").write(bytes(data))
    assert len(_read_all(path, 3)) == 3  # content is intact: default verification passes
    with pytest.raises(PackIntegrityError, match="XXH3-128"):
        [b for b in open_stream(path, 3, verify="file")]
    # "bytes": the file's digest too, and no record's (no pixel table is decompressed to check one)
    from loader import reader as reader_module
    from loader.reader import Pack, read_shard

    p = Pack.open(path)
    with pytest.raises(PackIntegrityError, match="XXH3-128"):
        list(read_shard(p, p.index(3).shards[0], verify="bytes"))
    open(shard, "wb").write(open(os.path.join(pack_dir, "stream-00003", "shard-00000.arrow"), "rb").read())
    calls = []
    real = reader_module.record_digest
    monkeypatch.setattr(reader_module, "record_digest", lambda r: calls.append(1) or real(r))
    assert len(list(read_shard(p, p.index(3).shards[0], verify="bytes"))) == 3 and not calls
    assert len(list(read_shard(p, p.index(3).shards[0], verify="file"))) == 3 and len(calls) == 3


def test_dataset_same_world_size_is_dataloader_order(pack_dir):
    """Rank r, same W/K: batch 0 of each of its K streams, then batch 1, ... (exhausted skipped)."""
    lengths = [4, 6, 5, 3]
    for rank in range(2):
        ds = PackedShardDataset(pack_dir, rank=rank, world_size=2)
        assert ds.streams == [2 * rank, 2 * rank + 1]
        got = [(b.batch_data_indexes, b.sequence_length) for b in ds]
        a, b = ds.streams
        order = [s for r in range(max(lengths)) for s in (a, b) if lengths[s] > r]
        from tests.helpers.fakepack import stream_batches

        batches = {s: stream_batches(s, lengths[s]) for s in (a, b)}
        pos = {a: 0, b: 0}
        want = []
        for s in order:
            pb = batches[s][pos[s]]
            pos[s] += 1
            want.append(([o.reference_dict() for o in pb.origins], int(pb.sequence_length)))
        assert got == want


def test_dataset_rank_defaults_from_env(pack_dir, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert PackedShardDataset(pack_dir).streams == [2, 3]
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert PackedShardDataset(pack_dir).streams == [0, 1, 2, 3]  # W'=1: s % 1 == 0
    with pytest.raises(ValueError, match="5 ranks but the pack has only 4 streams"):
        PackedShardDataset(pack_dir, rank=0, world_size=5)


@pytest.mark.parametrize("spec_index", [0, 1, 2])
def test_cuda_path_on_cpu_device_matches_reference(spec_index):
    """cuda(device) builds from the moved compact tensors; with device=cpu it runs here too."""
    pb = make_batch(100 + spec_index, SPECS[spec_index])
    batch = SimpleCustomBatch(pb)
    assert batch.packed_text_ids.device.type == "cpu"  # a tensor built before the move is rebuilt on the new device
    assert_same(batch.cuda("cpu").to_dict(), reference_to_dict(pb))
    assert batch.device == torch.device("cpu")


def test_prefetcher_reraises_and_stops():
    import threading

    from loader.prefetch import Prefetcher

    def produce():
        yield 1
        yield 2
        raise KeyError("boom")

    before = threading.active_count()
    it = Prefetcher(produce(), depth=1)
    assert [next(it), next(it)] == [1, 2]
    with pytest.raises(KeyError, match="boom"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert threading.active_count() == before

    def endless():
        n = 0
        while True:
            yield n
            n += 1

    it = Prefetcher(endless(), depth=2)
    assert next(it) == 0
    it.close()  # producer blocked on a full queue is released and joined
    assert threading.active_count() == before
