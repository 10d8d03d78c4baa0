"""Config validation: a NeMo recipe + prepack section loads; each mistake is one clear line."""

from __future__ import annotations

import os

import pytest
import yaml

from schemas.config import ConfigError, load_config

from tests.helpers.paths import REPO


@pytest.fixture
def base(tmp_path):
    data = tmp_path / "data"
    (data / "t2i").mkdir(parents=True)
    (data / "vlm").mkdir()
    (data / "vlm" / "train.jsonl").write_text('{"conversations": []}\n' * 8)
    cfg = {
        "recipe": "PretrainRecipeForMultimodal",  # other NeMo sections are ignored
        "model": {"stage": 2},
        "seed": 4396,
        "tokenizer": {"pretrained_model_name_or_path": "qwen2-offline"},
        "dataloader": {"num_workers": 2, "pin_memory": True},
        "dataset": {
            "dataset_info": {
                "t2i_pretrain": {"t2i": {"data_dir": "data/t2i", "num_files": 8, "num_total_samples": 10}},
                "vlm_sft": {"vlm": {"data_dir": "data/vlm", "jsonl_path": "data/vlm/train.jsonl"}},
            },
            "grouped_datasets": {
                "t2i_pretrain": {"dataset_names": ["t2i"], "num_used_data": [4], "weight": 1, "is_mandatory": True,
                                 "image_transform_args": {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512}},
                "vlm_sft": {"dataset_names": ["vlm"], "num_used_data": [8], "weight": 2,
                            "image_transform_args": {"image_stride": 14, "max_image_size": 980, "min_image_size": 378},
                            "frame_sampler_args": {"max_num_frames": 12, "min_num_frames": 8}},
            },
            "use_flex": True,
        },
        "prepack": {"world_size": 2, "batches_per_stream": 10},
    }
    return tmp_path, cfg


def write(tmp_path, cfg) -> str:
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


def test_nemo_recipe_plus_prepack_loads_with_reference_defaults(base):
    tmp, cfg = base
    c = load_config(write(tmp, cfg))
    assert c.seed == 4396 and c.num_workers == 2 and c.world_size == 2 and c.num_streams == 4
    assert c.knobs.use_flex and c.knobs.expected_num_tokens == 32768 and c.knobs.vit_cond_dropout_prob == 0.4
    t2i = c.groups[0]
    assert t2i.is_mandatory and t2i.datasets[0].data_dir == str(tmp / "data" / "t2i")  # relative to the config
    assert t2i.image_transform.max_pixels == 14 * 14 * 9 * 1024 and t2i.image_transform.image_mean == (0.5, 0.5, 0.5)
    assert c.stream_seed(3) == ((4396 * 2 + 1) * 2 + 1) & 0xFFFFFFFF
    assert c.stream_rank_worker(3) == (1, 1)


def test_demo_config_is_valid_without_data():
    c = load_config(os.path.join(REPO, "configs", "demo.yaml"), check_files=False)
    assert {g.name for g in c.groups} == {"t2i_pretrain", "unified_edit", "vlm_sft"}


def test_seed_zero_falls_back_to_data_seed_like_the_reference(base):
    tmp, cfg = base
    cfg["seed"] = 0
    cfg["dataset"]["data_seed"] = 7
    assert load_config(write(tmp, cfg)).stream_seed(0) == 7 * 2 * 2


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c["dataset"].update(expected_num_token=1), "unknown key 'expected_num_token' in dataset; did you mean 'expected_num_tokens'?"),
    (lambda c: c.update(prepak={}), "did you mean 'prepack'"),
    (lambda c: c["prepack"].update(batches_per_strem=3), "did you mean 'batches_per_stream'"),
    (lambda c: c["dataset"]["grouped_datasets"].update(vlm_sfft=c["dataset"]["grouped_datasets"].pop("vlm_sft")),
     "unknown group name 'vlm_sfft' in dataset.grouped_datasets; did you mean 'vlm_sft'?"),
    (lambda c: c["dataset"]["dataset_info"]["t2i_pretrain"]["t2i"].update(data_dir="nowhere"), "directory not found"),
    (lambda c: c["dataset"]["dataset_info"]["vlm_sft"]["vlm"].update(jsonl_path="missing.jsonl"), "file not found"),
    (lambda c: c["dataset"]["grouped_datasets"]["t2i_pretrain"].update(num_used_data=[3]),
     "num_used_data sums to 3, smaller than world_size*num_workers = 4"),
    (lambda c: [g.update(weight=0) for g in c["dataset"]["grouped_datasets"].values()], "all group weights are zero"),
    (lambda c: c["dataset"].update(text_cond_dropout_prob=1.5), "text_cond_dropout_prob must be in [0, 1]"),
    (lambda c: c["prepack"].pop("batches_per_stream"), "needs a budget"),
    (lambda c: c["prepack"].update(compression="gzip"), "zstd:LEVEL"),
    (lambda c: c["dataset"]["grouped_datasets"]["vlm_sft"].pop("frame_sampler_args"), "frame_sampler_args"),
    (lambda c: c["dataset"]["grouped_datasets"]["vlm_sft"]["image_transform_args"].update(stride=14),
     "unknown key 'stride'"),
    (lambda c: c["dataloader"].update(num_workers=-1), "num_workers must be an integer >= 0"),
])
def test_each_mistake_is_one_clear_line(base, mutate, message):
    tmp, cfg = base
    mutate(cfg)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp, cfg))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_grouped_datasets_and_dataset_info_paths(base):
    tmp, cfg = base
    (tmp / "grouped.yaml").write_text(yaml.safe_dump(cfg["dataset"].pop("grouped_datasets")))
    (tmp / "info.json").write_text(__import__("json").dumps(cfg["dataset"].pop("dataset_info")))
    cfg["dataset"]["grouped_datasets_path"] = "grouped.yaml"
    cfg["dataset"]["dataset_info_path"] = "info.json"
    # paths inside dataset_info resolve against the config's folder, as inline ones do
    assert len(load_config(write(tmp, cfg)).groups) == 2


def test_config_hash_changes_with_content_only(base):
    tmp, cfg = base
    a = load_config(write(tmp, cfg)).content_hash()
    assert load_config(write(tmp, cfg)).content_hash() == a
    cfg["dataset"]["max_num_tokens"] = 40000
    assert load_config(write(tmp, cfg)).content_hash() != a


def _with_edit(tmp, cfg, **info):
    (tmp / "data" / "edit").mkdir(exist_ok=True)
    (tmp / "data" / "edit" / "info.json").write_text("{}")
    cfg["dataset"]["dataset_info"]["unified_edit"] = {"e": {"data_dir": "data/edit", **info}}
    cfg["dataset"]["grouped_datasets"]["unified_edit"] = {
        "dataset_names": ["e"], "num_used_data": [4], "weight": 1,
        "image_transform_args": {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512}}


@pytest.mark.parametrize("mutate, message", [
    (lambda t, c: c["dataset"]["grouped_datasets"]["t2i_pretrain"].pop("image_transform_args"),
     "dataset.grouped_datasets.t2i_pretrain needs 'image_transform_args'"),
    (lambda t, c: c["dataset"]["grouped_datasets"]["vlm_sft"].pop("frame_sampler_args"),
     "dataset.grouped_datasets.vlm_sft needs 'frame_sampler_args' (the reference requires a frame sampler)"),
    (lambda t, c: c["dataset"]["dataset_info"]["vlm_sft"]["vlm"].pop("jsonl_path"),
     "dataset.dataset_info.vlm_sft.vlm needs 'jsonl_path' (vlm_sft reads conversations from JSONL)"),
    (lambda t, c: _with_edit(t, c),
     "dataset.dataset_info.unified_edit.e needs 'parquet_info_path' (unified_edit reads row groups from it)"),
    (lambda t, c: _with_edit(t, c, parquet_info_path="data/edit/info.json"),
     "dataset.grouped_datasets.unified_edit needs 'vit_image_transform_args' (edit rows feed the ViT too)"),
])
def test_each_kind_says_what_it_needs(base, mutate, message):
    """What a kind needs is declared with the kind (``schemas.kinds``); the errors read as ever."""
    tmp, cfg = base
    mutate(tmp, cfg)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp, cfg))
    assert str(e.value) == message


def test_every_kind_is_declared_once_with_the_keys_it_accepts():
    from schemas.config import GroupConfig
    from schemas.kinds import KINDS

    assert list(KINDS) == ["t2i_pretrain", "vlm_sft", "unified_edit"]
    for name, kind in KINDS.items():
        assert kind.name == name and GroupConfig(name, (), ()).kind is kind
        assert {n.key for n in kind.group_needs} <= set(kind.group_keys)
        assert {n.key for n in kind.dataset_needs} <= set(kind.dataset_keys)
