"""The sources as a whole: one implementation per declared kind, and one description of each
source's reads that both its walk and its read-ahead follow.

Read-ahead normally runs only for data on a store (``tests/prepack/engine/test_s3_sources.py``);
here it is forced on for local data, so the read-ahead machinery runs over every source's
description (parquet footers and row groups, failures thrown back into the description, end-of-row
and end-of-pass marks) on any machine: the same records, checkpoints and counts as reading in place.
"""

from __future__ import annotations

import numpy as np
import pytest

from prepack.engine.state_codec import state_from_payload, state_to_payload
from prepack.engine.packer import PackerOptions, StreamPacker
from prepack.engine.sources import SOURCES, implementations
from prepack.engine.sources.base import Source
from prepack.engine.sources.edit import EditSource
from prepack.engine.sources.readahead import ReadAheadSettings
from prepack.engine.sources.sft import SftSource
from prepack.engine.sources.t2i import T2ISource
from schemas.config_file import load_config
from schemas.kinds import KINDS, SourceKind
from schemas.record import batch_to_record, record_digest
from tests.helpers import datagen as dg


def test_each_declared_kind_has_exactly_one_implementation():
    assert list(SOURCES) == list(KINDS)
    for name, cls in SOURCES.items():
        assert cls.kind is KINDS[name]
    with pytest.raises(TypeError, match="two implementations"):
        implementations(T2ISource, SftSource, EditSource, T2ISource)
    with pytest.raises(TypeError, match="unified_edit.*no implementation"):
        implementations(T2ISource, SftSource)

    class Stray(Source):
        kind = SourceKind("t2i_pretrain", "a copy, not the declared kind", ())

    with pytest.raises(TypeError, match="does not declare"):
        implementations(Stray, SftSource, EditSource)


def _dataset(root: str) -> dg.Dataset:
    """Every source, with a file that does not open, a row group that does not read, rows that fail."""
    import json
    import os

    rs = np.random.RandomState(11)
    ds = dg.Dataset(root)
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 6, i * 6) for i in range(3)], row_group_size=3)
    with open(os.path.join(ds.info["t2i_pretrain"]["t2i"]["data_dir"], "zz-garbage.parquet"), "wb") as f:
        f.write(b"PAR1 not parquet PAR1")
    lines, files = dg.good_sft(rs, 12)
    frames = {f"clip/frame_{i:03d}.jpg": dg.jpeg(dg.photo(40 + i, rs)) for i in range(5)}
    conv = [{"from": "human", "value": "<video> what happens?"}, {"from": "gpt", "value": "a pan"}]
    lines += [json.dumps({"video": "clip/", "conversations": conv}), "{not json",
              json.dumps({"image": ["missing.jpg"], "conversations": conv})]
    dg.add_sft(ds, lines, {**files, **frames})
    dg.add_edit(ds, [dg.good_edit_rows(rs, 2, i * 2) for i in range(3)])
    return ds


def _pack(config: str, tok_special, *, read_ahead: bool, n: int, state=None):
    tok, special = tok_special
    packer = StreamPacker(load_config(config), 0, tok, special, state=state,
                          options=PackerOptions(read_ahead=ReadAheadSettings(depth=8 if read_ahead else 0, threads=2)))
    out, payloads = [], []
    with packer:
        for b in packer:
            doc, pixels = state_to_payload(packer.state())
            out.append((record_digest(batch_to_record(b)), doc.to_json(), pixels))
            payloads.append((doc, pixels))
            if len(out) == n:
                break
    packer.payloads = payloads
    return out, packer


def test_the_read_ahead_follows_the_description_the_walk_reads(tmp_path, tokenizer_and_special, monkeypatch):
    config = _dataset(str(tmp_path)).config(
        knobs={"expected_num_tokens": 700, "max_num_tokens": 900, "max_num_tokens_per_sample": 700,
               "prefer_buffer_before": 500, "max_buffer_size": 3},
        prepack={"batches_per_stream": 40, "max_consecutive_failures": 50})
    tok_special = tokenizer_and_special
    direct, plain = _pack(config, tok_special, read_ahead=False, n=16)
    started = []
    for cls in SOURCES.values():
        monkeypatch.setattr(cls, "_remote", lambda self: True)  # local data, read ahead all the same
    real_start = Source.start

    def start(self):
        real_start(self)
        started.append(self._ra is not None)

    monkeypatch.setattr(Source, "start", start)
    ahead, forced = _pack(config, tok_special, read_ahead=True, n=16)
    assert started and all(started), "the read-ahead did not run"
    assert len(direct) == 16 and ahead == direct  # records and every checkpoint (cursors, counts) alike
    assert forced.counters.to_json() == plain.counters.to_json()
    drops = plain.counters.drops
    for reason in ("t2i_pretrain:parquet_file_unreadable", "vlm_sft:jsonl_parse"):
        assert drops.get(reason, 0) > 0, drops
    # resumed from a checkpoint, the read-ahead starts at the restored cursor
    rest, _ = _pack(config, tok_special, read_ahead=True, n=10, state=state_from_payload(*plain.payloads[5]))
    assert rest == direct[6:]
