"""Differential tests: our packer + record + loader vs the real reference, tensor for tensor.

Each case packs the first N batches of several streams and compares, batch by batch, our
``SimpleCustomBatch.to_dict()`` (after a trip through the on-disk record format) with the
reference ``SimpleCustomBatch.to_dict()`` of the batch its DataLoader worker w of rank r yields:
every tensor with ``torch.equal`` and its dtype, every list exactly.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from tests.helpers import datagen as dg
from tests.helpers import oracle
from tests.helpers.compare import diff_batches
from tests.helpers.parity import assert_parity
from prepack.engine.packer import StreamPacker
from schemas.config_file import load_config

from tests.helpers.paths import REPO

# Slow (the reference runs for many batches), but for one short case in the fast lane (FAST_CASE).


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Three groups of crafted data from real photos: t2i, edit chains, SFT incl. multi-image."""
    root = str(tmp_path_factory.mktemp("mixed"))
    rs = np.random.RandomState(0)
    ds = dg.Dataset(root)
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 7, i * 7) for i in range(6)])
    dg.add_edit(ds, [dg.good_edit_rows(rs, 4, i * 4) for i in range(6)])
    lines, files = dg.good_sft(rs, 36)
    dg.add_sft(ds, lines, files, shuffle_lines=True)
    return ds


SMALL = dict(expected_num_tokens=1500, max_num_tokens=2000, max_num_tokens_per_sample=1500,
             prefer_buffer_before=1000, max_buffer_size=4, vit_cond_dropout_prob=0.3, vae_cond_dropout_prob=0.3)

CASES = {
    "flex_2x2": dict(knobs={**SMALL, "use_flex": True}, world_size=2, num_workers=2),
    "nonflex_1x3": dict(knobs={**SMALL, "use_flex": False}, world_size=1, num_workers=3),
    "interpolate_1x1": dict(knobs={**SMALL, "use_flex": True, "interpolate_pos": True}, world_size=1, num_workers=1),
    "dropout_one_in_process": dict(
        knobs={**SMALL, "text_cond_dropout_prob": 1.0, "vit_cond_dropout_prob": 1.0, "vae_cond_dropout_prob": 1.0},
        world_size=1, num_workers=0),
    "dropout_zero": dict(
        knobs={**SMALL, "text_cond_dropout_prob": 0.0, "vit_cond_dropout_prob": 0.0, "vae_cond_dropout_prob": 0.0},
        world_size=2, num_workers=1),
    # expected > max and a prefer_buffer_before above max: every buffered sample comes straight
    # back out and is discarded (the reference's silent drop, counted by us), batches flush early.
    "tiny_budget_flushes": dict(
        knobs={"expected_num_tokens": 1200, "max_num_tokens": 1100, "max_num_tokens_per_sample": 1000,
               "prefer_buffer_before": 4000, "max_buffer_size": 2, "use_flex": True}, world_size=1, num_workers=2),
    "mandatory_t2i": dict(knobs={**SMALL, "use_flex": False}, world_size=1, num_workers=2, mandatory="t2i_pretrain"),
}


FAST_CASE = "interpolate_1x1"  # one stream, 20 batches: the fast lane's parity check


@pytest.mark.parametrize("case", [c if c == FAST_CASE else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(CASES)])
def test_parity_crafted(case, mixed, tokenizer_and_special, tmp_path):
    spec = CASES[case]
    ds = dg.Dataset(str(tmp_path), groups={k: dict(v) for k, v in mixed.groups.items()}, info=mixed.info)
    if spec.get("mandatory"):
        ds.groups[spec["mandatory"]]["is_mandatory"] = True
    path = ds.config(knobs=spec["knobs"], num_workers=spec["num_workers"],
                     prepack={"world_size": spec["world_size"], "batches_per_stream": 20})
    cfg = load_config(path)
    streams = sorted({0, cfg.num_streams - 1})
    assert_parity(cfg, tokenizer_and_special, streams, 20)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from prepack.demo.data import write_demo_data

    root = tmp_path_factory.mktemp("demo")
    write_demo_data(str(root / "demo-data"), seed=0)
    os.makedirs(root / "configs")
    shutil.copy(os.path.join(REPO, "configs", "demo.yaml"), root / "configs" / "demo.yaml")
    return root


@pytest.mark.parametrize("flex", [True, False])
@pytest.mark.slow  # runs the reference for many batches
def test_parity_demo_with_video(flex, demo_dir, tokenizer_and_special):
    """The demo dataset (videos and frame folders in the SFT group) under the demo config."""
    cfg = load_config(str(demo_dir / "configs" / "demo.yaml"),
                      overrides={"dataset": {"use_flex": flex}, "prepack": {"batches_per_stream": 20}})
    assert any(g.frame_sampler for g in cfg.groups)
    assert_parity(cfg, tokenizer_and_special, [0, 1], 20)


@pytest.mark.parametrize("fast_resize", ["1", "0"], ids=["kernel", "pillow"])
@pytest.mark.slow  # runs the reference for many batches
def test_parity_with_the_resize_kernel_on_and_off(fast_resize, demo_dir, tokenizer_and_special, monkeypatch):
    """Every transform's resize (t2i, edit chains, SFT images, video frames) through the C kernel
    (numba where no compiler: asked for by name, so that a machine whose timed choice is Pillow
    still runs a kernel here) and once through Pillow (``PREPACK_FAST_RESIZE=0``): the same batches
    as the reference.  (The numba kernel equals Pillow in tests/prepack/engine/resize.)"""
    from PIL import Image

    from prepack.engine.resize import PINNED_PILLOW, default_resizer

    if fast_resize == "1":
        fast_resize = "native" if shutil.which("cc") or shutil.which("gcc") else "numba"
    monkeypatch.setenv("PREPACK_FAST_RESIZE", fast_resize)
    default_resizer.cache_clear()
    try:
        assert default_resizer().fast == (fast_resize != "0" and Image.__version__ == PINNED_PILLOW)
        cfg = load_config(str(demo_dir / "configs" / "demo.yaml"), overrides={"prepack": {"batches_per_stream": 12}})
        assert_parity(cfg, tokenizer_and_special, [0, 1], 12)
    finally:
        default_resizer.cache_clear()


@pytest.mark.slow  # runs the reference for many batches
def test_worker_emulation_matches_real_dataloader(mixed, tokenizer_and_special, tmp_path):
    """The oracle's in-process worker emulation equals a real 2-worker DataLoader's order."""
    import torch
    from nemo_automodel.components.datasets.multimodal import bagel_packed_collate_fn

    ds = dg.Dataset(str(tmp_path), groups=mixed.groups, info=mixed.info)
    cfg = load_config(ds.config(knobs=SMALL, num_workers=2, prepack={"world_size": 1, "batches_per_stream": 3}))
    tok, _ = tokenizer_and_special
    dataset = oracle.reference_dataset(cfg, 0, tok)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=2, collate_fn=bagel_packed_collate_fn,
                                         multiprocessing_context="fork")
    real = []
    for b in loader:
        real.append(b.to_dict())
        if len(real) == 6:
            break
    emulated = {s: oracle.reference_batches(cfg, s, tok, 3) for s in (0, 1)}
    for i, batch in enumerate(real):  # a K-worker DataLoader yields round-robin: worker i % K
        diffs = diff_batches(batch, emulated[i % 2][i // 2])
        assert not diffs, f"batch {i}: {diffs[:3]}"


@pytest.mark.parametrize("flex", [True, False])
@pytest.mark.slow  # runs the reference for many batches
def test_parity_through_shard_files_and_open_stream(flex, mixed, tokenizer_and_special, tmp_path):
    """Packed to disk by the stream job (small shards, so several per stream), read back with
    ``open_stream``: still the reference's batches, in order."""
    from loader import open_stream
    from prepack.run.driver import RunOptions, run_pack

    tok, special = tokenizer_and_special
    ds = dg.Dataset(str(tmp_path), groups=mixed.groups, info=mixed.info)
    cfg = load_config(ds.config(knobs={**SMALL, "use_flex": flex}, num_workers=2,
                                prepack={"batches_per_stream": 12, "shard_bytes": 400_000}))
    out = str(tmp_path / "out")
    summary = run_pack(cfg, out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    assert summary.manifest_written and all(e.num_shards > 1 for e in summary.streams)
    for s in range(cfg.num_streams):
        ref = oracle.reference_batches(cfg, s, tok, 12)
        ours = [b.to_dict() for b in open_stream(out, stream=s)]
        assert len(ours) == 12
        for i, (a, b) in enumerate(zip(ours, ref)):
            diffs = diff_batches(a, b)
            assert not diffs, f"stream {s} batch {i}: " + "; ".join(diffs[:5])


@pytest.mark.parametrize("sample", ["middle", "fps4"])
@pytest.mark.slow  # runs the reference for many batches
def test_parity_several_datasets_per_group_repeats_and_frame_rules(sample, tokenizer_and_special, tmp_path):
    """Two datasets in every group (two parquet_info files, two JSONL files), file lists repeated
    to num_used_data, and videos sampled with the 'middle' and 'fpsN' rules (mp4, frame folders)."""
    rs = np.random.RandomState(21)
    a, b = dg.Dataset(str(tmp_path / "a")), dg.Dataset(str(tmp_path / "b"))
    for ds, start in ((a, 0), (b, 40)):
        os.makedirs(ds.root)
        dg.add_t2i(ds, [dg.good_t2i_rows(rs, 4, start + 4 * i) for i in range(3)], num_used=5)
        dg.add_edit(ds, [dg.good_edit_rows(rs, 3, start + 3 * i) for i in range(2)])
        lines, files = dg.good_sft(rs, 10)
        frames = [np.asarray(dg.photo(i, rs, 96, 97).resize((96, 80))) for i in range(14)]
        files["clip.mp4"] = dg.mp4(frames)
        for i, f in enumerate(frames):
            files[f"frames/clip/frame_{i:05d}.jpg"] = dg.jpeg(dg.Image.fromarray(f))
        for video in ("clip.mp4", "frames/clip/"):
            lines.append(json.dumps({"video": video, "conversations": [
                {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": dg.sentence(rs, 8, 20)}]}))
        dg.add_sft(ds, lines, files, frames={"max_num_frames": 6, "min_num_frames": 3, "sample": sample},
                   shuffle_lines=True)
    merged = dg.Dataset(str(tmp_path))
    for group in a.groups:
        g = dict(a.groups[group])
        g["dataset_names"] = [f"{group}_a", f"{group}_b"]
        g["num_used_data"] = a.groups[group]["num_used_data"] + b.groups[group]["num_used_data"]
        merged.groups[group] = g
        (ia,), (ib,) = a.info[group].values(), b.info[group].values()
        merged.info[group] = {f"{group}_a": ia, f"{group}_b": ib}
    cfg = load_config(merged.config(knobs={**SMALL, "use_flex": True}, num_workers=2,
                                    prepack={"batches_per_stream": 20}))
    assert_parity(cfg, tokenizer_and_special, [0, 1], 20)


@pytest.mark.slow  # runs the reference for many batches
def test_parity_with_unnormalised_absolute_paths_and_relative_parquet_info_keys(tokenizer_and_special, tmp_path):
    """Absolute paths are used verbatim (the reference joins and matches the strings as given);
    relative parquet_info keys resolve against the config's folder like every relative path."""
    rs = np.random.RandomState(8)
    ds = dg.Dataset(str(tmp_path))
    dg.add_edit(ds, [dg.good_edit_rows(rs, 3, 3 * i) for i in range(4)])
    lines, files = dg.good_sft(rs, 8)
    dg.add_sft(ds, lines, files)
    info = ds.info["unified_edit"]["edit"]
    raw_dir = str(tmp_path) + "/./edit//images"  # an unusual but valid spelling
    info["data_dir"] = raw_dir
    with open(info["parquet_info_path"]) as f:
        entries = json.load(f)
    with open(info["parquet_info_path"], "w") as f:
        json.dump({os.path.join(raw_dir, os.path.basename(k)): v for k, v in entries.items()}, f)
    cfg = load_config(ds.config(knobs=SMALL, num_workers=2, prepack={"batches_per_stream": 6}))
    assert cfg.groups[0].datasets[0].data_dir == raw_dir
    assert_parity(cfg, tokenizer_and_special, [0, 1], 6)

    with open(info["parquet_info_path"], "w") as f:  # keys relative to the config's folder
        json.dump({os.path.join("edit", "images", os.path.basename(k)): v for k, v in entries.items()}, f)
    info["data_dir"] = "edit/images"
    cfg = load_config(ds.config(knobs=SMALL, num_workers=2, prepack={"batches_per_stream": 6}))
    tok, special = tokenizer_and_special
    p = StreamPacker(cfg, 0, tok, special)
    assert len(list(p)) == 6 and p.counters.samples_packed.get("unified_edit", 0) > 0
    assert "edit_file_missing_from_parquet_info" not in p.counters.warnings
