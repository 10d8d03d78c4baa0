"""Config validation: a NeMo recipe + prepack section loads; each mistake is one clear line."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import yaml

from schemas.config import BUDGET_KEYS, ConfigError, PrepackConfig
from schemas.config_file import load_config

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
    (lambda c: c["prepack"].update(balance="sample"), "prepack.balance must be one of none, samples"),
    (lambda c: c["prepack"].update(balance="samples", world_size=1), "it needs world_size >= 2"),
    (lambda c: c["prepack"].update(cost_model={"token": 1.0}), "prepack.cost_model: cost model: unknown term token"),
    (lambda c: c["prepack"].update(cost_model={"tokens": -1.0}), "prepack.cost_model"),
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


def _json_round_trip(cfg) -> dict:
    """``to_dict()`` as pack.json keeps it: tuples come back as lists."""
    return json.loads(json.dumps(cfg.to_dict()))


def _rebuilt_with_constructors(d: dict, config_path: str):
    """The former ``prepack.run.identity.config_from_identity``, kept here as the reference that
    ``PrepackConfig.from_dict`` replaced: built with the dataclass constructors only."""
    from schemas.config import (DatasetInfo, FrameSamplerArgs, GroupConfig, PackingKnobs, PrepackConfig,
                                PrepackSection, TransformArgs)

    def transform(t):
        return None if t is None else TransformArgs(**{**t, "image_mean": tuple(t["image_mean"]),
                                                          "image_std": tuple(t["image_std"])})

    groups = tuple(GroupConfig(**{
        **g,
        "datasets": tuple(DatasetInfo(**x) for x in g["datasets"]),
        "num_used_data": tuple(g["num_used_data"]),
        "image_transform": transform(g["image_transform"]),
        "vit_image_transform": transform(g["vit_image_transform"]),
        "frame_sampler": FrameSamplerArgs(**g["frame_sampler"]) if g["frame_sampler"] else None,
    }) for g in d["groups"])
    return PrepackConfig(**{**d, "groups": groups, "knobs": PackingKnobs(**d["knobs"]),
                            "prepack": PrepackSection(**d["prepack"]), "config_path": config_path})


def test_demo_config_hash_is_the_one_its_stored_dict_gives():
    """A pack stores ``config_hash`` and ``to_dict()``; the demo config read now, and rebuilt from its
    stored dict the way packs were always read back, must hash alike (no hash is hard-coded)."""
    c = load_config(os.path.join(REPO, "configs", "demo.yaml"), check_files=False)
    d = _json_round_trip(c)
    reference = _rebuilt_with_constructors(d, c.config_path)
    assert reference == c and reference.content_hash() == c.content_hash()
    assert PrepackConfig.from_dict(d, c.config_path).content_hash() == c.content_hash()
    for k in BUDGET_KEYS:  # the stored formula: sorted JSON of everything but the budget
        d["prepack"].pop(k)
    assert c.content_hash() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def test_from_dict_rebuilds_the_demo_config():
    c = load_config(os.path.join(REPO, "configs", "demo.yaml"), check_files=False)
    back = PrepackConfig.from_dict(_json_round_trip(c), c.config_path)
    assert back == c and back.content_hash() == c.content_hash() and back.config_path == c.config_path
    assert PrepackConfig.from_dict(_json_round_trip(c)).config_path == ""


@pytest.mark.parametrize("budget", [
    {"batches_per_stream": 10},
    {"tokens_per_stream": 50_000},
    {"passes": 2},
    {"batches_per_stream": 10, "tokens_per_stream": 50_000, "passes": 2},
])
def test_from_dict_rebuilds_every_optional_section(base, budget):
    tmp, cfg = base
    _with_edit(tmp, cfg, parquet_info_path="data/edit/info.json")
    groups = cfg["dataset"]["grouped_datasets"]
    groups["unified_edit"]["vit_image_transform_args"] = {
        "image_stride": 14, "max_image_size": 980, "min_image_size": 224, "max_pixels": 100_000,
        "image_mean": [0.1, 0.2, 0.3], "image_std": [1, 2, 3]}
    groups["vlm_sft"].update(shuffle_lines=True, shuffle_seed=5, weight=0.5,
                             frame_sampler_args={"max_num_frames": 4, "min_num_frames": 2, "sample": "fps2"})
    cfg["dataset"].update(expected_num_tokens=1000, max_num_tokens_per_sample=900, max_num_tokens=1200,
                          prefer_buffer_before=800, max_buffer_size=5, interpolate_pos=True, data_seed=3,
                          text_cond_dropout_prob=0, vit_cond_dropout_prob=0.5, vae_cond_dropout_prob=1,
                          vae_image_downsample=8, max_latent_size=16, vit_patch_size=16, max_num_patch_per_side=35)
    cfg["prepack"] = {"world_size": 2, "shard_bytes": 1 << 20, "compression": "zstd:3", "strict": True,
                      "max_image_pixels": 10**6, "max_consecutive_failures": 3, **budget}
    c = load_config(write(tmp, cfg))
    by_name = {g.name: g for g in c.groups}
    assert by_name["unified_edit"].vit_image_transform.image_std == (1.0, 2.0, 3.0)
    assert by_name["vlm_sft"].frame_sampler.sample == "fps2" and c.knobs.interpolate_pos
    back = PrepackConfig.from_dict(_json_round_trip(c), c.config_path)
    assert back == c  # dataclass equality: lists are back to tuples, every section to its class
    assert back.content_hash() == c.content_hash() and back.prepack.budget() == budget
    assert back == _rebuilt_with_constructors(_json_round_trip(c), c.config_path)


def test_balance_and_cost_model_stored_only_when_set(base):
    """A config without them stores and hashes as before they existed; set, they are stored and rebuilt."""
    tmp, cfg = base
    plain = load_config(write(tmp, cfg))
    assert "balance" not in plain.to_dict()["prepack"] and "cost_model" not in plain.to_dict()["prepack"]
    cfg["prepack"].update(balance="samples", cost_model={"tokens": 2e-4, "intercept": 3})
    c = load_config(write(tmp, cfg))
    assert c.content_hash() != plain.content_hash()
    back = PrepackConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back.prepack.balance == "samples" and back.prepack.cost_model == {"tokens": 2e-4, "intercept": 3.0}
    assert back.content_hash() == c.content_hash()
    cfg["prepack"].update(balance="none", cost_model={})
    assert load_config(write(tmp, cfg)).content_hash() == plain.content_hash()
