"""A small real pack built in-process (pack_one_stream + finalize, no Ray), for tool tests."""

from __future__ import annotations

import os

import numpy as np

from prepack.engine.tokenizer import tokenizer_fingerprint
from prepack.run.driver import finalize
from prepack.run.identity import pack_identity, record_metadata
from prepack.run.stream_job import pack_one_stream
from prepack.run.writer import write_json_atomic
from schemas.config import load_config
from schemas.location import resolve_location
from schemas.manifest import PACK_INFO_NAME
from tests.helpers import datagen as dg

KNOBS = dict(expected_num_tokens=700, max_num_tokens=900, max_num_tokens_per_sample=700, prefer_buffer_before=500,
             max_buffer_size=3, use_flex=True, text_cond_dropout_prob=0.0, vit_cond_dropout_prob=0.0,
             vae_cond_dropout_prob=0.0)


def small_dataset(root: str, *, batches: int = 6, shard_bytes: int = 300_000, seed: int = 0,
                  edit: bool = False) -> str:
    """Data (t2i + sft [+ edit]) under ``root/data`` and its config (2 streams); returns the config path."""
    data = os.path.join(root, "data")
    os.makedirs(data)
    rs = np.random.RandomState(seed)
    ds = dg.Dataset(data)
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 6, i * 6) for i in range(2)], row_group_size=3)
    lines, files = dg.good_sft(rs, 10)
    dg.add_sft(ds, lines, files)
    if edit:
        dg.add_edit(ds, [dg.good_edit_rows(rs, 2, i * 2) for i in range(2)])
    return ds.config(knobs=KNOBS, num_workers=2, prepack={"batches_per_stream": batches, "shard_bytes": shard_bytes})


def pack_in_process(config: str, out: str, tokenizer_and_special) -> str:
    """Pack every stream of ``config`` into ``out`` (any location) in this process; returns ``out``."""
    tok, special = tokenizer_and_special
    cfg = load_config(config)
    identity = pack_identity(cfg, tokenizer_fingerprint(tok), special)
    loc = resolve_location(out)
    loc.fs.create_dir(loc.base, recursive=True)
    write_json_atomic(loc, PACK_INFO_NAME, identity)
    for s in range(cfg.num_streams):
        pack_one_stream(cfg, out, s, tok, special, record_metadata(identity))
    assert finalize(loc, cfg, identity)[0]
    return out


def build_pack(root: str, tokenizer_and_special, *, batches: int = 6, shard_bytes: int = 300_000, seed: int = 0,
               edit: bool = False) -> str:
    """A small real pack (t2i + sft [+ edit], 2 streams, several shards each) under ``root``; returns OUT."""
    config = small_dataset(root, batches=batches, shard_bytes=shard_bytes, seed=seed, edit=edit)
    return pack_in_process(config, os.path.join(root, "out"), tokenizer_and_special)
