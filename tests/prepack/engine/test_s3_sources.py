"""Sources on an object store: the same data read from ``s3://`` packs the same batches.

The demo dataset (t2i parquet, edit parquet + ``parquet_info``, SFT JSONL with single and
multiple images, mp4 videos and frame folders) is uploaded to a real S3 server and the demo
config pointed at it.  Every batch of two streams, through the record and the loader, equals
the batch packed from the local copy (which ``tests/parity`` holds equal to the reference), and
the samples' origins name the same files under the URI.  The JSONL path safety policy holds on
an object store too: nothing outside the data directory is read.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from prepack.engine.packer import StreamPacker
from schemas.config import load_config
from tests.helpers import datagen as dg
from tests.helpers.compare import diff_batches
from tests.helpers.parity import ours_via_record
from tests.helpers.ray_helpers import make_demo
from tests.helpers.s3server import config_on_s3

pytestmark = pytest.mark.slow  # needs the S3 server (started once per session)

BATCHES = 6


def _batches(config: str, stream: int, tok_special) -> tuple[list, float]:
    tok, special = tok_special
    t = time.perf_counter()
    out = []
    for b in StreamPacker(load_config(config), stream, tok, special):
        out.append(b)
        if len(out) == BATCHES:
            break
    return out, time.perf_counter() - t


def test_demo_data_on_s3_packs_the_same_batches(s3, tokenizer_and_special, tmp_path):
    config = make_demo(str(tmp_path))
    data_root = os.path.join(str(tmp_path), "demo-data")
    uri = s3.new_prefix("demo-data")
    s3.upload(data_root, uri)
    s3_config = config_on_s3(config, data_root, uri, s3)
    for stream in (0, 1):
        local, t_local = _batches(config, stream, tokenizer_and_special)
        remote, t_remote = _batches(s3_config, stream, tokenizer_and_special)
        print(f"stream {stream}: {BATCHES} batches, local {t_local / BATCHES * 1e3:.0f} ms/batch, "
              f"s3 {t_remote / BATCHES * 1e3:.0f} ms/batch")
        assert len(local) == len(remote) == BATCHES
        for i, (a, b) in enumerate(zip(local, remote)):
            diffs = diff_batches(ours_via_record(b), ours_via_record(a))
            assert not diffs, f"stream {stream} batch {i}: " + "; ".join(diffs[:5])
            assert [o.source_file.replace(data_root, uri, 1) for o in a.origins] == [o.source_file for o in b.origins]
            assert any(o.source_file.startswith("s3://") for o in b.origins)


def test_jsonl_media_paths_cannot_leave_the_data_dir_on_s3(s3, tokenizer_and_special, tmp_path):
    rs = np.random.RandomState(5)
    ds = dg.Dataset(str(tmp_path))
    (tmp_path / "secret.jpg").write_bytes(dg.jpeg(dg.photo(0, rs)))  # uploaded next to, not inside, the data dir
    uri = s3.new_prefix("unsafe")
    lines, files = dg.good_sft(rs, 8)
    conv = [{"from": "human", "value": "<image> look"}, {"from": "gpt", "value": "ok"}]
    unsafe = ["../../secret.jpg", "/secret.jpg", "~/secret.jpg", f"{uri}/secret.jpg", "a/../../../secret.jpg"]
    lines += [json.dumps({"image": p, "conversations": conv}) for p in unsafe]
    lines.append(json.dumps({"video": "../../clip.mp4", "conversations": conv}))
    dg.add_sft(ds, lines, files)
    s3.upload(str(tmp_path), uri)
    local_config = ds.config(knobs={"expected_num_tokens": 700, "max_num_tokens": 900, "max_num_tokens_per_sample": 700,
                                    "prefer_buffer_before": 500, "max_buffer_size": 3},
                             prepack={"batches_per_stream": 6})
    s3_config = config_on_s3(local_config, str(tmp_path), uri, s3)
    tok, special = tokenizer_and_special
    p = StreamPacker(load_config(s3_config), 0, tok, special)
    assert len(list(p)) == 6
    assert p.counters.drops.get("vlm_sft:unsafe_path_outside_data_dir", 0) >= len(unsafe) + 1, p.counters.drops
