"""Sources on an object store: the same data read from ``s3://`` packs the same batches.

The demo dataset (t2i parquet, edit parquet + ``parquet_info``, SFT JSONL with single and
multiple images, mp4 videos and frame folders) is uploaded to a real S3 server and the demo
config pointed at it.  Every batch of two streams, through the record and the loader, equals
the batch packed from the local copy (which ``tests/parity`` holds equal to the reference), and
the samples' origins name the same files under the URI.  The JSONL path safety policy holds on
an object store too: nothing outside the data directory is read.

Read-ahead (sources on a store fetch a few objects ahead in I/O threads) changes nothing: the
same records and counts with it off, on, at depth 1 and at depth 32 with a 1 MiB byte bound;
a stream resumed from a checkpoint yields the same records; missing and damaged objects (a
JSONL row's image, a frame, a parquet file) are dropped by the same rule at the same point; a
stalled source stops the stream with the same error; and no I/O thread outlives its packer.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from prepack.engine.packer import PackerOptions, StreamPacker
from prepack.engine.sources.readahead import ReadAheadSettings
from schemas.config_file import load_config
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


# -- read-ahead: same bytes, same order, same drops, threads gone at the end -----------------------
def _io_threads(stream: int) -> list:
    import threading

    return [t for t in threading.enumerate() if t.name.startswith(f"prepack-io-s{stream}") and t.is_alive()]


def _run(config: str, stream: int, tok_special, settings, *, n: int = BATCHES, state=None):
    """(record digests, drops, warnings, whether I/O threads ran) of ``n`` batches of one stream."""
    from schemas.record import batch_to_record, record_digest

    tok, special = tok_special
    packer = StreamPacker(load_config(config), stream, tok, special, state=state, options=PackerOptions(read_ahead=settings))
    digests, threads_seen = [], False
    with packer:
        for b in packer:
            digests.append(record_digest(batch_to_record(b)))
            threads_seen = threads_seen or bool(_io_threads(stream))
            if len(digests) == n:
                break
    assert not _io_threads(stream), "I/O threads outlived the packer"
    return digests, dict(packer.counters.drops), dict(packer.counters.warnings), threads_seen, packer


OFF = ReadAheadSettings(depth=0)
SETTINGS = [ReadAheadSettings(), ReadAheadSettings(depth=1, threads=1),
            ReadAheadSettings(depth=32, max_bytes=1 << 20, threads=8)]


@pytest.fixture(scope="module")
def demo_s3(s3_server, tmp_path_factory):
    """The demo dataset uploaded once for this module: (local config, s3 config)."""
    root = str(tmp_path_factory.mktemp("demo-ra"))
    config = make_demo(root)
    data_root = os.path.join(root, "demo-data")
    uri = s3_server.new_prefix("demo-ra")
    s3_server.upload(data_root, uri)
    return config, config_on_s3(config, data_root, uri, s3_server)


def test_read_ahead_changes_no_byte_and_no_count(s3, demo_s3, tokenizer_and_special):
    local_config, s3_config = demo_s3
    for stream in (0, 1):
        local = _run(local_config, stream, tokenizer_and_special, ReadAheadSettings())
        assert not local[3], "a local source must not start I/O threads"
        off = _run(s3_config, stream, tokenizer_and_special, OFF)
        assert not off[3] and len(off[0]) == len(local[0]) == BATCHES  # (digests differ: origins name the URI)
        for settings in SETTINGS:
            on = _run(s3_config, stream, tokenizer_and_special, settings)
            assert on[3], f"{settings}: no read-ahead ran on an s3 source"
            assert on[:3] == off[:3], f"stream {stream}, {settings}: records or counts differ with read-ahead"


def test_a_resumed_stream_reads_ahead_from_its_cursor_and_yields_the_same_bytes(s3, demo_s3, tokenizer_and_special):
    from prepack.engine.state_codec import state_from_payload, state_to_payload

    _, s3_config = demo_s3
    whole = _run(s3_config, 0, tokenizer_and_special, ReadAheadSettings(), n=8)[0]
    for cut in (1, 3, 5):
        *_, first = _run(s3_config, 0, tokenizer_and_special, ReadAheadSettings(), n=cut)
        doc, pixels = state_to_payload(first.state())
        state = state_from_payload(doc, pixels)
        rest = _run(s3_config, 0, tokenizer_and_special, ReadAheadSettings(), n=8 - cut, state=state)[0]
        assert rest == whole[cut:], f"resumed after batch {cut}: different records"


def _damaged_dataset(root) -> dg.Dataset:
    rs = np.random.RandomState(3)
    ds = dg.Dataset(str(root))
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 6, i * 6) for i in range(3)], row_group_size=3)
    lines, files = dg.good_sft(rs, 16)
    frames = {f"clip/frame_{i:03d}.jpg": dg.jpeg(dg.photo(40 + i, rs)) for i in range(6)}
    conv = [{"from": "human", "value": "<video> what happens?"}, {"from": "gpt", "value": "a pan"}]
    lines += [json.dumps({"video": "clip/", "conversations": conv})] * 2
    dg.add_sft(ds, lines, {**files, **frames})
    dg.add_edit(ds, [dg.good_edit_rows(rs, 2, i * 2) for i in range(3)])
    return ds


def test_missing_and_damaged_objects_are_dropped_by_the_same_rule_at_the_same_point(s3, tokenizer_and_special, tmp_path,
                                                                                  monkeypatch):
    ds = _damaged_dataset(tmp_path)
    uri = s3.new_prefix("damaged")
    s3.upload(str(tmp_path), uri)
    fs = s3.filesystem()
    key = lambda rel: f"{uri}/{rel}".split("://", 1)[1]  # noqa: E731
    fs.delete_file(key("vlm/images/img_0_0.jpg"))  # a JSONL row's image is gone
    fs.delete_file(key("vlm/images/img_2_1.jpg"))  # the second image of a two-image row
    with fs.open_output_stream(key("vlm/images/img_6_0.jpg")) as f:
        f.write(b"not a jpeg")
    with fs.open_output_stream(key("vlm/images/clip/frame_002.jpg")) as f:  # one frame of a folder
        f.write(b"\xff\xd8 truncated")
    with fs.open_output_stream(key("t2i/part-00001.parquet")) as f:  # a whole parquet file
        f.write(b"PAR1 garbage PAR1")
    with fs.open_output_stream(key("edit/images/edit-00002.parquet")) as f:
        f.write(b"garbage")
    config = ds.config(knobs={"expected_num_tokens": 700, "max_num_tokens": 900, "max_num_tokens_per_sample": 700,
                              "prefer_buffer_before": 500, "max_buffer_size": 3},
                       prepack={"batches_per_stream": 40, "max_consecutive_failures": 50})
    s3_config = config_on_s3(config, str(tmp_path), uri, s3)
    off = _run(s3_config, 0, tokenizer_and_special, OFF, n=24)
    drops = off[1]
    for reason in ("t2i_pretrain:parquet_file_unreadable", "unified_edit:parquet_row_group_parse"):
        assert drops.get(reason, 0) > 0, drops
    assert sum(v for k, v in drops.items() if k.startswith("vlm_sft:")) >= 3, drops
    for settings in SETTINGS:
        on = _run(s3_config, 0, tokenizer_and_special, settings, n=24)
        assert on[:3] == off[:3], f"{settings}: drops, warnings or records differ with read-ahead"
    from prepack.engine.sources import files

    assert files.objects_and_key(uri)[0].name == "obstore"  # what read the store above
    monkeypatch.setenv("PREPACK_OBJECT_CLIENT", "pyarrow")
    assert files.objects_and_key(uri)[0].name == "pyarrow"
    on = _run(s3_config, 0, tokenizer_and_special, SETTINGS[0], n=24)
    assert on[:3] == off[:3], "drops, warnings or records differ between the obstore and pyarrow clients"


def test_a_stalled_source_stops_the_same_way_and_leaves_no_thread(s3, tokenizer_and_special, tmp_path):
    from schemas.errors import SourceStalled

    rs = np.random.RandomState(4)
    ds = dg.Dataset(str(tmp_path))
    lines, _ = dg.good_sft(rs, 12)
    lines = [ln for ln in lines if '"image"' in ln]  # rows that all need an image; none of their images exists
    dg.add_sft(ds, lines, {"unrelated.jpg": b"x"})
    uri = s3.new_prefix("stall")
    s3.upload(str(tmp_path), uri)
    s3_config = config_on_s3(ds.config(prepack={"batches_per_stream": 4}), str(tmp_path), uri, s3)
    tok, special = tokenizer_and_special
    outcomes = []
    for settings in (OFF, *SETTINGS):
        packer = StreamPacker(load_config(s3_config), 0, tok, special, options=PackerOptions(read_ahead=settings))
        with pytest.raises(SourceStalled) as err:
            list(packer)
        assert not _io_threads(0), f"{settings}: I/O threads outlived a failed stream"
        outcomes.append((str(err.value), dict(packer.counters.drops)))
    assert all(o == outcomes[0] for o in outcomes), outcomes
