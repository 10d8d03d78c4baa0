"""Tests for prepack.demo.data: determinism, layout, and that the reference datasets read it cleanly."""

from __future__ import annotations

import io
import itertools
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from prepack.demo.data import DemoData, write_demo_data

REPO = Path(__import__("tests.helpers.paths", fromlist=["REPO"]).REPO)
DEMO_CONFIG = REPO / "configs" / "demo.yaml"


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(folder, name), root): Path(folder, name).read_bytes()
        for folder, _, names in os.walk(root)
        for name in names
    }


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> DemoData:
    return write_demo_data(tmp_path_factory.mktemp("demo") / "demo-data", seed=0)


@pytest.fixture(scope="module")
def vlm_rows(demo) -> list[dict]:
    with open(demo.vlm_jsonl) as handle:
        return [json.loads(line) for line in handle]


def _image(payload: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(payload))
    image.load()
    return image


@pytest.mark.slow  # writes the demo data again
def test_rerun_is_byte_identical(demo, tmp_path):
    root = Path(demo.root)
    first = _snapshot(root)
    assert sorted(os.path.join(demo.root, rel) for rel in first) == list(demo.files)
    again = write_demo_data(root, seed=0)
    assert again == demo
    second = _snapshot(root)
    assert second.keys() == first.keys()
    changed = [rel for rel in first if first[rel] != second[rel]]
    assert not changed, f"rewritten with different bytes: {changed[:5]}"

    # Elsewhere, only the absolute paths inside parquet_info.json differ.
    other = write_demo_data(tmp_path / "elsewhere", seed=0)
    third = _snapshot(Path(other.root))
    info_rel = os.path.relpath(demo.edit_parquet_info, demo.root)
    assert third.keys() == first.keys()
    assert [rel for rel in first if first[rel] != third[rel]] == [info_rel]
    moved = {os.path.relpath(k, other.root): v for k, v in json.loads(third[info_rel]).items()}
    assert moved == {os.path.relpath(k, demo.root): v for k, v in json.loads(first[info_rel]).items()}


@pytest.mark.slow  # writes the demo data again
def test_seed_changes_content(demo, tmp_path):
    other = write_demo_data(tmp_path / "seed1", seed=1)
    assert Path(other.vlm_jsonl).read_bytes() != Path(demo.vlm_jsonl).read_bytes()
    assert Path(other.t2i_files[0]).read_bytes() != Path(demo.t2i_files[0]).read_bytes()


def test_t2i_parquet(demo):
    assert [os.path.basename(p) for p in demo.t2i_files] == [f"part-{i:05d}.parquet" for i in range(4)]
    assert sorted(os.listdir(demo.t2i_dir)) == [os.path.basename(p) for p in demo.t2i_files]
    kinds, ratios = [], []
    for path in demo.t2i_files:
        meta = pq.ParquetFile(path)
        assert meta.num_row_groups == 2
        assert [meta.metadata.row_group(i).num_rows for i in range(2)] == [5, 5]
        assert meta.schema_arrow.field("image").type == pa.binary()
        assert meta.schema_arrow.field("captions").type == pa.string()
        table = meta.read()
        for payload, captions in zip(table["image"].to_pylist(), table["captions"].to_pylist()):
            image = _image(payload)
            kinds.append((image.format, image.mode))
            assert 200 <= min(image.size) and max(image.size) <= 900, image.size
            ratios.append(image.width / image.height)
            parsed = json.loads(captions)
            assert 1 <= len(parsed) <= 3
            assert list(parsed) == [f"caption_{i}" for i in range(len(parsed))]
            assert all(isinstance(v, str) and len(v.split()) >= 3 for v in parsed.values())
    assert len(kinds) == demo.num_t2i_rows == 40
    assert ("PNG", "RGBA") in kinds and ("PNG", "P") in kinds
    assert ("JPEG", "L") in kinds and kinds.count(("JPEG", "RGB")) >= 25
    assert min(ratios) < 0.8 and max(ratios) > 1.25


def test_edit_parquet(demo):
    assert [os.path.basename(p) for p in demo.edit_files] == [f"edit-{i:05d}.parquet" for i in range(4)]
    lengths = set()
    for path in demo.edit_files:
        meta = pq.ParquetFile(path)
        assert meta.num_row_groups == 2
        assert [meta.metadata.row_group(i).num_rows for i in range(2)] == [4, 4]
        assert meta.schema_arrow.field("image_list").type == pa.list_(pa.binary())
        assert meta.schema_arrow.field("instruction_list").type == pa.list_(pa.list_(pa.string()))
        for row in meta.read().to_pylist():
            images = [_image(b) for b in row["image_list"]]
            lengths.add(len(images))
            assert 2 <= len(images) <= 4
            assert all(im.format == "JPEG" for im in images)
            assert len(row["instruction_list"]) == len(images) - 1
            for phrasings in row["instruction_list"]:
                assert 1 <= len(phrasings) <= 3 and len(set(phrasings)) == len(phrasings)
                assert all(p.endswith(".") and len(p.split()) >= 2 for p in phrasings)
            for before, after in zip(row["image_list"], row["image_list"][1:]):
                assert before != after  # every step really edits the picture
    assert lengths == {2, 3, 4}


def test_parquet_info_keys_are_what_the_reference_looks_up(demo):
    with open(demo.edit_parquet_info) as handle:
        info = json.load(handle)
    data_dir = demo.edit_image_dir
    listed = {os.path.join(data_dir, name) for name in os.listdir(data_dir) if name.endswith(".parquet")}
    assert set(info) == listed == set(demo.edit_files)
    for key, value in info.items():
        assert os.path.isabs(key) and key == os.path.abspath(key)
        assert value == {"num_row_groups": pq.ParquetFile(key).num_row_groups}


def test_vlm_jsonl_rows(demo, vlm_rows):
    assert len(vlm_rows) == demo.num_vlm_rows == 40
    image_dir = demo.vlm_image_dir
    kinds = {"single": 0, "multi": 0, "multi_turn": 0, "text": 0, "video": 0, "frames": 0}
    long_answers = 0
    for row in vlm_rows:
        turns = row["conversations"]
        assert [t["from"] for t in turns] == ["human", "gpt"] * (len(turns) // 2) and len(turns) % 2 == 0
        human = " ".join(t["value"] for t in turns if t["from"] == "human")
        for turn in turns:
            if turn["from"] == "gpt":
                words = len(turn["value"].split())
                assert 1 <= words <= 260
                long_answers += words >= 75
        if "image" in row:
            images = row["image"] if isinstance(row["image"], list) else [row["image"]]
            for name in images:
                assert os.path.isfile(os.path.join(image_dir, name)), name
            assert human.count("<image>") == len(images)
            assert "<video>" not in human
            kind = "multi" if isinstance(row["image"], list) else ("multi_turn" if len(turns) > 2 else "single")
            kinds[kind] += 1
        elif "video" in row:
            path = os.path.join(image_dir, row["video"])
            assert turns[0]["from"] == "human" and "<video>" in turns[0]["value"]
            assert human.count("<video>") == 1 and "<image>" not in human
            if row["video"].endswith("/"):
                frames = sorted(os.listdir(path))
                assert 12 <= len(frames) <= 20
                assert frames == [f"frame_{i:05d}.jpg" for i in range(1, len(frames) + 1)]
                kinds["frames"] += 1
            else:
                assert row["video"].endswith(".mp4") and os.path.isfile(path)
                kinds["video"] += 1
        else:
            assert "<image>" not in human and "<video>" not in human
            kinds["text"] += 1
    assert kinds["video"] == 3 and kinds["frames"] == 2
    assert kinds["single"] >= 15 and kinds["multi"] >= 4 and kinds["multi_turn"] >= 3 and kinds["text"] >= 3
    assert long_answers >= 8
    assert sorted(p.name for p in Path(image_dir, "videos").iterdir()) == [f"clip_{i}.mp4" for i in range(3)]


def test_videos_decode_with_decord(demo):
    import decord

    assert len(demo.videos) == 3
    for path in demo.videos:
        reader = decord.VideoReader(path, num_threads=1)
        assert len(reader) >= 20
        assert reader.get_avg_fps() > 0
        frames = reader.get_batch([0, len(reader) // 2, len(reader) - 1]).asnumpy()
        height, width = frames.shape[1:3]
        assert 96 <= height <= 160 and 96 <= width <= 160
        assert not (frames[0] == frames[-1]).all()  # the camera pans


def test_demo_config_matches_layout(demo):
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    assert config["seed"] == 42 and config["tokenizer"] == "qwen2-offline"
    assert config["dataloader"] == {"num_workers": 2}
    assert config["prepack"] == {"world_size": 1, "batches_per_stream": 6, "shard_bytes": 16777216,
                                 "compression": "zstd:1"}
    dataset = config["dataset"]
    expected_root = (REPO / "demo-data").resolve()

    def mapped(rel: str) -> str:
        resolved = os.path.normpath(os.path.join(DEMO_CONFIG.parent, rel))
        inside = os.path.relpath(resolved, expected_root)
        assert not inside.startswith(".."), rel
        return os.path.join(demo.root, inside)

    info = dataset["dataset_info"]
    assert mapped(info["t2i_pretrain"]["t2i"]["data_dir"]) == demo.t2i_dir
    assert mapped(info["unified_edit"]["edit_data"]["data_dir"]) == demo.edit_image_dir
    assert mapped(info["unified_edit"]["edit_data"]["parquet_info_path"]) == demo.edit_parquet_info
    assert mapped(info["vlm_sft"]["vlm_data"]["data_dir"]) == demo.vlm_image_dir
    assert mapped(info["vlm_sft"]["vlm_data"]["jsonl_path"]) == demo.vlm_jsonl
    groups = dataset["grouped_datasets"]
    assert groups["t2i_pretrain"]["num_used_data"] == [len(demo.t2i_files)]
    assert groups["unified_edit"]["num_used_data"] == [len(demo.edit_files)]
    assert groups["vlm_sft"]["num_used_data"] == [demo.num_vlm_rows]
    assert all(g["is_mandatory"] is False and g["weight"] == 1 for g in groups.values())
    assert groups["vlm_sft"]["frame_sampler_args"] == {"max_num_frames": 8, "min_num_frames": 4}
    assert groups["vlm_sft"]["shuffle_lines"] is True
    for key, value in {"expected_num_tokens": 6144, "max_num_tokens": 8192, "max_num_tokens_per_sample": 6144,
                       "prefer_buffer_before": 4096, "max_buffer_size": 10, "use_flex": True, "data_seed": 42,
                       "vit_patch_size": 14, "max_num_patch_per_side": 70, "vae_image_downsample": 16,
                       "max_latent_size": 64, "text_cond_dropout_prob": 0.1, "vit_cond_dropout_prob": 0.3,
                       "vae_cond_dropout_prob": 0.3}.items():
        assert dataset[key] == value, key


class _CountingTokenizer:
    """Enough of a tokenizer for the reference datasets: one id per byte."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


@pytest.mark.slow  # the reference reads every demo row
def test_reference_datasets_read_every_row(demo):
    """One full pass of the reference's three dataset classes over the demo data, with nothing dropped."""
    from nemo_automodel.components.datasets.multimodal.datasets import SftJSONLIterableDataset, T2IIterableDataset
    from nemo_automodel.components.datasets.multimodal.interleave import UnifiedEditIterableDataset
    from nemo_automodel.components.datasets.multimodal.transforms import ImageTransform
    from nemo_automodel.components.datasets.multimodal.video import FrameSampler

    groups = yaml.safe_load(DEMO_CONFIG.read_text())["dataset"]["grouped_datasets"]
    tokenizer = _CountingTokenizer()
    with open(demo.edit_parquet_info) as handle:
        parquet_info = json.load(handle)
    datasets = [
        (T2IIterableDataset("t2i_pretrain", ImageTransform(**groups["t2i_pretrain"]["image_transform_args"]),
                            tokenizer, [demo.t2i_dir], [4], num_workers=1), demo.num_t2i_rows),
        (UnifiedEditIterableDataset("unified_edit", ImageTransform(**groups["unified_edit"]["image_transform_args"]),
                                    tokenizer, ImageTransform(**groups["unified_edit"]["vit_image_transform_args"]),
                                    [demo.edit_image_dir], [4], parquet_info, num_workers=1), demo.num_edit_rows),
        (SftJSONLIterableDataset("vlm_sft", ImageTransform(**groups["vlm_sft"]["image_transform_args"]), tokenizer,
                                 FrameSampler(**groups["vlm_sft"]["frame_sampler_args"]), [demo.vlm_jsonl],
                                 [demo.vlm_image_dir], [40], num_workers=1, shuffle_lines=True), demo.num_vlm_rows),
    ]
    for dataset, rows in datasets:
        samples = list(itertools.islice(iter(dataset), rows))
        assert dataset._drop_counters == {}, dataset.dataset_name
        assert len(samples) == rows
        assert all(s["num_tokens"] > 0 and s["sequence_plan"] for s in samples)
        if dataset.dataset_name == "vlm_sft":
            frames = [len(s["image_tensor_list"]) for s in samples if s["image_tensor_list"]]
            assert max(frames) >= 4  # the videos and frame folders became several images
