"""Bad input is data, not a crash: every kind is a counted drop (or a counted warning) and the
stream goes on.  Where the reference tolerates the input, we also match it batch for batch."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.helpers import badgen as bg
from tests.helpers import datagen as dg
from prepack.engine.packer import StreamPacker
from prepack.engine.sources import SourceStalled
from schemas.config_file import load_config
from tests.helpers.parity import assert_parity

# The reference-comparing test is slow; the refusals and the other drop checks are quick.

KNOBS = dict(expected_num_tokens=1500, max_num_tokens=2000, max_num_tokens_per_sample=1500,
             prefer_buffer_before=1000, max_buffer_size=4, use_flex=True)


def _caps(rs):
    return json.dumps({"c0": dg.sentence(rs), "c1": dg.sentence(rs)})


def tolerated_dataset(root: str) -> dg.Dataset:
    """Good rows mixed with bad rows that the reference survives (drops or packs damaged)."""
    rs = np.random.RandomState(7)
    ds = dg.Dataset(root)
    bad_t2i = [
        {"image": bg.truncated_jpeg(rs), "captions": _caps(rs)},
        {"image": bg.png16(rs), "captions": _caps(rs)},
        {"image": bg.grey_alpha_png(rs), "captions": _caps(rs)},
        {"image": bg.palette_alpha_png(rs), "captions": _caps(rs)},
        {"image": bg.cmyk_jpeg(rs), "captions": _caps(rs)},
        {"image": bg.animated_gif(rs), "captions": _caps(rs)},
        {"image": bg.rgba_png(rs), "captions": _caps(rs)},
        {"image": bg.NOT_AN_IMAGE, "captions": _caps(rs)},
        {"image": b"", "captions": _caps(rs)},
        {"image": dg.jpeg(dg.photo(0, rs)), "captions": "{not json"},
        {"image": dg.jpeg(dg.photo(1, rs)), "captions": "{}"},
        {"image": dg.jpeg(dg.photo(2, rs)), "captions": json.dumps({"c": ""})},
    ]
    files = [dg.good_t2i_rows(rs, 4, 10 * i) + bad_t2i[3 * i : 3 * i + 3] for i in range(4)]
    # a fifth file lacks the captions column: every row is dropped (the reference: KeyError, caught)
    files.append([{"image": r["image"]} for r in dg.good_t2i_rows(rs, 3, 50)])
    files.append(dg.good_t2i_rows(rs, 4, 60))
    dg.add_t2i(ds, files)
    good_edit = dg.good_edit_rows(rs, 8)
    bad_edit = [
        {"image_list": [dg.jpeg(dg.photo(3, rs))], "instruction_list": [["x"]]},
        {"image_list": [dg.jpeg(dg.photo(3, rs)), dg.jpeg(dg.photo(4, rs))], "instruction_list": []},
        {"image_list": [dg.jpeg(dg.photo(3, rs)), bg.NOT_AN_IMAGE], "instruction_list": [["make it odd"]]},
        {"image_list": [dg.jpeg(dg.photo(5, rs)), dg.jpeg(dg.photo(6, rs))], "instruction_list": [[]]},
    ]
    dg.add_edit(ds, [good_edit[2 * i : 2 * i + 2] + [bad_edit[i]] for i in range(4)])
    lines, files = dg.good_sft(rs, 16)
    files["only_human.jpg"] = dg.jpeg(dg.photo(1, rs))
    long_text = " ".join(["word"] * 3000)
    lines += [
        "{this is not json",
        "",
        json.dumps({"image": "missing.jpg", "conversations": [{"from": "human", "value": "<image> hi"},
                                                              {"from": "gpt", "value": "x"}]}),
        json.dumps({"conversations": [{"from": "human", "value": "only a question"}]}),
        json.dumps({"image": "only_human.jpg", "conversations": [{"from": "human", "value": "no placeholder"},
                                                                 {"from": "gpt", "value": "an answer"}]}),
        json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": long_text}]}),
        '{"conversations": [{"from": "human", "value": "split\rby a bare carriage return"}]}',
    ]
    dg.add_sft(ds, lines, files)
    return ds


@pytest.mark.slow  # runs the reference over every bad row
def test_tolerated_bad_rows_match_reference_and_are_counted(tmp_path, tokenizer_and_special):
    ds = tolerated_dataset(str(tmp_path))
    cfg = load_config(ds.config(knobs=KNOBS, num_workers=2, prepack={"batches_per_stream": 12}))
    assert_parity(cfg, tokenizer_and_special, [0, 1], 12)
    tok, special = tokenizer_and_special
    drops, warns = {}, {}
    for s in range(cfg.num_streams):
        p = StreamPacker(cfg, s, tok, special)
        for _ in p:
            pass
        for d, src in ((drops, p.counters.drops), (warns, p.counters.warnings)):
            for k, v in src.items():
                d[k] = d.get(k, 0) + v
    # every kind of damage shows up under its own name
    for kind in ("truncated_image", "high_bit_depth_image_saturated", "alpha_dropped_without_composite",
                 "animated_image_first_frame_only", "t2i_no_caption_packed_as_space", "t2i_empty_caption",
                 "image_without_placeholder_counted_not_packed"):
        assert warns.get(kind, 0) >= 1, (kind, warns)
    assert drops.get("t2i_pretrain:t2i_caption_parse", 0) >= 3  # the file without a captions column
    for reason in ("t2i_pretrain:t2i_image_parse", "t2i_pretrain:t2i_caption_parse", "unified_edit:parquet_row_parse",
                   "vlm_sft:jsonl_parse", "vlm_sft:no_loss_labels", "overlength_sample"):
        assert drops.get(reason, 0) >= 1, (reason, drops)


def test_inputs_that_crash_the_reference_are_counted_drops(tmp_path, tokenizer_and_special):
    rs = np.random.RandomState(3)
    ds = dg.Dataset(str(tmp_path))
    bad = [
        {"image": dg.jpeg(dg.photo(1, rs)), "captions": json.dumps(["a", "list"])},
        {"image": dg.jpeg(dg.photo(2, rs)), "captions": json.dumps("a string")},
        {"image": dg.jpeg(dg.photo(3, rs)), "captions": json.dumps({"c": 5})},
    ]
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 3) + bad, dg.good_t2i_rows(rs, 3, 5)], num_used=3)
    tdir = ds.info["t2i_pretrain"]["t2i"]["data_dir"]
    with open(os.path.join(tdir, "zz-corrupt.parquet"), "wb") as f:
        f.write(b"PAR1 definitely not a parquet file")
    open(os.path.join(tdir, "zz-empty.parquet"), "wb").close()
    lines, files = dg.good_sft(rs, 8)
    lines += [
        b'{"conversations": [{"from": "human", "value": "caf\xe9"}, {"from": "gpt", "value": "latin-1 byte"}]}',
        "[1, 2, 3]",
        json.dumps({"no_conversations": True}),
        json.dumps({"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}),
        json.dumps({"image": "a.jpg", "conversations": [  # two turns each claim the one image
            {"from": "human", "value": "<image> first"}, {"from": "gpt", "value": "x"},
            {"from": "human", "value": "<image> again"}, {"from": "gpt", "value": "y"}]}),
        json.dumps({"video": "nothing.mp4", "conversations": [{"from": "human", "value": "<video> what?"},
                                                              {"from": "gpt", "value": "x"}]}),
    ]
    lines.append(json.dumps({"video": "broken.mp4", "conversations": [{"from": "human", "value": "<video> what?"},
                                                                       {"from": "gpt", "value": "x"}]}))
    files["broken.mp4"] = dg.mp4([np.zeros((32, 32, 3), np.uint8)] * 4)[:200]  # truncated container
    files["a.jpg"] = dg.jpeg(dg.photo(1, rs))
    files["b.jpg"] = dg.jpeg(dg.photo(2, rs))
    dg.add_sft(ds, lines, files)
    cfg = load_config(ds.config(knobs=KNOBS, num_workers=1, prepack={"batches_per_stream": 8}))
    tok, special = tokenizer_and_special
    p = StreamPacker(cfg, 0, tok, special)
    batches = list(p)
    assert len(batches) == 8
    d = p.counters.drops
    for reason in ("t2i_pretrain:t2i_caption_not_object", "t2i_pretrain:t2i_caption_not_string",
                   "t2i_pretrain:parquet_file_unreadable", "vlm_sft:jsonl_not_utf8", "vlm_sft:jsonl_not_object",
                   "vlm_sft:jsonl_bad_conversations", "vlm_sft:jsonl_parse",
                   "vlm_sft:more_image_placeholders_than_images"):
        assert d.get(reason, 0) >= 1, (reason, d)
    assert p.counters.warnings.get("parquet_file_choice_depends_on_listing_order", 0) >= 1


def test_unsafe_paths_and_pixel_bombs_are_refused_in_every_mode(tmp_path, tokenizer_and_special):
    rs = np.random.RandomState(5)
    ds = dg.Dataset(str(tmp_path))
    outside = tmp_path / "secret.jpg"
    outside.write_bytes(dg.jpeg(dg.photo(0, rs)))
    lines, files = dg.good_sft(rs, 8)
    conv = [{"from": "human", "value": "<image> look"}, {"from": "gpt", "value": "ok"}]
    lines += [
        json.dumps({"image": str(outside), "conversations": conv}),
        json.dumps({"image": "../../secret.jpg", "conversations": conv}),
        json.dumps({"video": "../clip.mp4", "conversations": conv}),
    ]
    dg.add_sft(ds, lines, files)
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 3) + [{"image": bg.pixel_bomb_png(), "captions": _caps(rs)}]])
    tok, special = tokenizer_and_special
    for strict in (False, True):
        cfg = load_config(ds.config(knobs=KNOBS, prepack={"batches_per_stream": 6, "strict": strict}))
        p = StreamPacker(cfg, 0, tok, special)
        list(p)
        d = p.counters.drops
        assert d.get("vlm_sft:unsafe_path_outside_data_dir", 0) >= 3, d
        assert d.get("t2i_pretrain:image_over_pixel_limit", 0) >= 1, d


def test_per_run_pixel_limit_and_no_pil_global_change(tmp_path, tokenizer_and_special):
    from PIL import Image, ImageFile

    before = (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES)
    rs = np.random.RandomState(1)
    ds = dg.Dataset(str(tmp_path))
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 6)])
    cfg = load_config(ds.config(knobs=KNOBS, prepack={"batches_per_stream": 1, "max_image_pixels": 100 * 100,
                                                      "max_consecutive_failures": 50}))
    tok, special = tokenizer_and_special
    with pytest.raises(SourceStalled, match="no sample"):
        list(StreamPacker(cfg, 0, tok, special))
    assert (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES) == before


def test_strict_mode_drops_damaged_input(tmp_path, tokenizer_and_special):
    ds = tolerated_dataset(str(tmp_path))
    cfg = load_config(ds.config(knobs=KNOBS, num_workers=2, prepack={"batches_per_stream": 12, "strict": True}))
    tok, special = tokenizer_and_special
    drops, warns = {}, {}
    for s in range(cfg.num_streams):
        p = StreamPacker(cfg, s, tok, special)
        list(p)
        for k, v in p.counters.drops.items():
            drops[k] = drops.get(k, 0) + v
        warns.update(p.counters.warnings)
    for reason in ("t2i_pretrain:strict_truncated_image", "t2i_pretrain:strict_high_bit_depth_image_saturated",
                   "t2i_pretrain:strict_t2i_no_caption", "vlm_sft:strict_image_without_placeholder"):
        assert drops.get(reason, 0) >= 1, (reason, drops)
    assert not {k for k in warns if k.startswith(("truncated", "high_bit", "t2i_no_caption"))}


def test_mandatory_group_that_never_loads_stops_with_a_clear_error(tmp_path, tokenizer_and_special):
    rs = np.random.RandomState(2)
    ds = dg.Dataset(str(tmp_path))
    dg.add_t2i(ds, [[{"image": bg.NOT_AN_IMAGE, "captions": _caps(rs)} for _ in range(5)]], mandatory=True)
    lines, files = dg.good_sft(rs, 8)
    dg.add_sft(ds, lines, files)
    cfg = load_config(ds.config(knobs=KNOBS, prepack={"batches_per_stream": 2}))
    tok, special = tokenizer_and_special
    with pytest.raises(SourceStalled, match="t2i_pretrain"):
        list(StreamPacker(cfg, 0, tok, special))


def test_mandatory_samples_over_max_tokens_are_refused_not_packed_with_negative_padding(tmp_path, tokenizer_and_special):
    rs = np.random.RandomState(4)
    ds = dg.Dataset(str(tmp_path))
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 6)], mandatory=True)
    dg.add_edit(ds, [dg.good_edit_rows(rs, 4)], mandatory=True)
    knobs = dict(KNOBS, max_num_tokens=60, expected_num_tokens=40, max_num_tokens_per_sample=1500)
    cfg = load_config(ds.config(knobs=knobs, prepack={"batches_per_stream": 3}))
    tok, special = tokenizer_and_special
    p = StreamPacker(cfg, 0, tok, special)
    from prepack.engine.sequence import PackingError

    with pytest.raises(PackingError, match="max_num_tokens"):
        for b in p:
            assert b.sequence_length <= 60  # nothing with negative flex padding is ever emitted
    assert p.counters.drops["batch_refused_over_max_num_tokens"] >= 100
