"""Small real packs built in-process (``run_pack`` with ``RunOptions(inline=True)``: the driver without Ray), for tests."""

from __future__ import annotations

import os

import numpy as np

from prepack.run.driver import RunOptions, run_pack
from schemas.config_file import load_config
from schemas.layout import PACK_INFO_NAME
from schemas.location import resolve_location
from tests.helpers import datagen as dg

KNOBS = dict(expected_num_tokens=700, max_num_tokens=900, max_num_tokens_per_sample=700, prefer_buffer_before=500,
             max_buffer_size=3, use_flex=True, text_cond_dropout_prob=0.0, vit_cond_dropout_prob=0.0,
             vae_cond_dropout_prob=0.0)


def make_dataset(root: str, *, seed: int = 0, edit: bool = False) -> dg.Dataset:
    """Small real data under ``root``/data: t2i + sft [+ edit]."""
    data = os.path.join(root, "data")
    os.makedirs(data)
    rs = np.random.RandomState(seed)
    ds = dg.Dataset(data)
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 6, i * 6) for i in range(2)], row_group_size=3)
    lines, files = dg.good_sft(rs, 10)
    dg.add_sft(ds, lines, files)
    if edit:
        dg.add_edit(ds, [dg.good_edit_rows(rs, 2, i * 2) for i in range(2)])
    return ds


def small_config(ds: dg.Dataset, *, shard_bytes: int = 300_000, **budget):
    """2 streams (W=1, K=2) over ``ds`` with the small knobs; ``budget`` e.g. batches_per_stream=6."""
    return load_config(ds.config(knobs=KNOBS, num_workers=2, prepack={"shard_bytes": shard_bytes, **budget}))


def small_dataset(root: str, *, batches: int = 6, shard_bytes: int = 300_000, seed: int = 0,
                  edit: bool = False) -> str:
    """Data (t2i + sft [+ edit]) under ``root/data`` and its config (2 streams); returns the config path."""
    ds = make_dataset(root, seed=seed, edit=edit)
    return ds.config(knobs=KNOBS, num_workers=2, prepack={"batches_per_stream": batches, "shard_bytes": shard_bytes})


def pack_in_process(config: str, out: str, tokenizer_and_special) -> str:
    """Pack every stream of ``config`` into ``out`` (any location) in this process; returns ``out``."""
    summary = run_pack(load_config(config), out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    assert summary.manifest_written
    return out


def build_pack(root: str, tokenizer_and_special, *, batches: int = 6, shard_bytes: int = 300_000, seed: int = 0,
               edit: bool = False) -> str:
    """A small real pack (2 streams, several shards each) under ``root``, packed in-process; returns OUT."""
    return pack_in_process(small_dataset(root, batches=batches, shard_bytes=shard_bytes, seed=seed, edit=edit),
                           os.path.join(root, "out"), tokenizer_and_special)


def make_video_dataset(root: str) -> dg.Dataset:
    """t2i + an SFT group with mp4 videos and a frame folder among its image rows."""
    import json

    rs = np.random.RandomState(4)
    ds = dg.Dataset(os.path.join(root, "data"))
    os.makedirs(ds.root)
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 6, i * 6) for i in range(2)], row_group_size=3)
    lines, files = dg.good_sft(rs, 6)
    for v in range(2):
        frames = [np.asarray(dg.photo(10 * v + i, rs, 96, 97).resize((96, 80))) for i in range(12)]
        files[f"clip{v}.mp4"] = dg.mp4(frames)
        lines.append(json.dumps({"video": f"clip{v}.mp4", "conversations": [
            {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": dg.sentence(rs, 8, 20)}]}))
    for i, f in enumerate(frames):
        files[f"frames/clip/frame_{i:05d}.jpg"] = dg.jpeg(dg.Image.fromarray(f))
    lines.append(json.dumps({"video": "frames/clip/", "conversations": [
        {"from": "human", "value": "<video>\nAnd here?"}, {"from": "gpt", "value": dg.sentence(rs, 8, 20)}]}))
    dg.add_sft(ds, lines, files, frames={"max_num_frames": 5, "min_num_frames": 3, "sample": "middle"})
    return ds


def pack_in_background(config: str, out: str, tokenizer_and_special) -> "threading.Thread":
    """``config`` packing into ``out`` in a thread of this process, returned once ``out/pack.json`` exists
    (a reader may open the pack); join it to wait for the end."""
    import threading
    import time

    job = threading.Thread(target=run_pack, args=(load_config(config), out, RunOptions(inline=True, bar=False)),
                           kwargs={"tokenizer": tokenizer_and_special}, daemon=True)
    job.start()
    loc = resolve_location(out)  # a folder or an s3:// prefix
    for _ in range(600):
        if loc.fs.get_file_info(loc.path(PACK_INFO_NAME)).type.name == "File" or not job.is_alive():
            break
        time.sleep(0.05)
    return job
