"""``prepack.schedule``: each step's config is the document with its ``set`` (and the earlier steps')
applied; what a mix change may not change is refused in one line naming the step and the key; the
schedule is stored with the config and is part of its identity, the budget is not."""

from __future__ import annotations

import copy
import os

import pytest
import yaml

from schemas.config import PrepackConfig
from schemas.config_file import parse_config
from schemas.errors import ConfigError
from tests.helpers.paths import REPO

DEMO = os.path.join(REPO, "configs", "demo.yaml")


def demo_raw() -> dict:
    with open(DEMO) as f:
        return yaml.safe_load(f)


def parse(raw: dict) -> PrepackConfig:
    return parse_config(raw, os.path.dirname(DEMO), config_path=DEMO, check_files=False)


def scheduled(*steps: tuple[int, dict]) -> dict:
    raw = demo_raw()
    raw["prepack"]["batches_per_stream"] = 100
    raw["prepack"]["schedule"] = [{"after": a, "set": s} for a, s in steps]
    return raw


def test_each_step_applies_its_settings_on_the_earlier_ones():
    cfg = parse(scheduled((10, {"dataset.grouped_datasets.vlm_sft.weight": 4, "dataset.expected_num_tokens": 5000}),
                          (20, {"dataset.grouped_datasets.t2i_pretrain.is_mandatory": True,
                                "dataset.grouped_datasets.unified_edit": None})))
    plain = parse(demo_raw())
    assert [st.after for st in cfg.schedule] == [10, 20]
    weights = [{g.name: g.weight for g in cfg.step_config(i).groups} for i in range(3)]
    assert weights[0] == {g.name: g.weight for g in plain.groups}
    assert weights[1]["vlm_sft"] == 4 and weights[2]["vlm_sft"] == 4  # kept by the later step
    assert "unified_edit" in weights[1] and "unified_edit" not in weights[2]  # removed by null
    assert [cfg.step_config(i).knobs.expected_num_tokens for i in range(3)] == [6144, 5000, 5000]
    assert [g.is_mandatory for g in cfg.step_config(2).groups if g.name == "t2i_pretrain"] == [True]
    assert all(not cfg.step_config(i).schedule for i in range(3))
    # which step packs a batch, and which made the state after n batches
    assert [cfg.step_of(b) for b in (0, 9, 10, 19, 20, 99)] == [0, 0, 1, 1, 2, 2]
    assert cfg.packed_under(10) == cfg.step_config(0) and cfg.packed_under(11) == cfg.step_config(1)
    assert cfg.packed_under(0) == cfg.step_config(0)


def test_the_schedule_is_stored_and_is_part_of_the_identity_the_budget_is_not():
    raw = scheduled((10, {"dataset.grouped_datasets.vlm_sft.weight": 4}))
    cfg = parse(raw)
    back = PrepackConfig.from_dict(copy.deepcopy(cfg.to_dict()), DEMO)
    assert back == cfg and back.content_hash() == cfg.content_hash()
    bigger = copy.deepcopy(raw)
    bigger["prepack"]["batches_per_stream"] = 500  # an extension
    assert parse(bigger).content_hash() == cfg.content_hash()
    other = copy.deepcopy(raw)
    other["prepack"]["schedule"][0]["after"] = 11
    assert parse(other).content_hash() != cfg.content_hash()
    # a config without a schedule stores none: its stored config and hash are what they were before schedules
    plain = parse(demo_raw())
    assert "schedule" not in plain.to_dict()
    assert PrepackConfig.from_dict(plain.to_dict(), DEMO) == plain


@pytest.mark.parametrize("schedule, says", [
    ("not a list", "prepack.schedule must be a non-empty list"),
    ([], "prepack.schedule must be a non-empty list"),
    ([{"after": 0, "set": {"dataset.max_buffer_size": 2}}], "prepack.schedule[0].after must be a batch number of 1"),
    ([{"after": 5, "set": {"dataset.max_buffer_size": 2}}, {"after": 5, "set": {"dataset.max_buffer_size": 3}}],
     "prepack.schedule[1].after must be above the step before it (5)"),
    ([{"after": 5, "sets": {}}], "unknown key 'sets' in prepack.schedule[0]"),
    ([{"after": 5, "set": {}}], "prepack.schedule[0].set must be a non-empty mapping"),
    ([{"after": 5, "set": {"prepack.batches_per_stream": 9}}], "'prepack.batches_per_stream': a step sets keys under"),
    ([{"after": 5, "set": {"seed": 1}}], "'seed': a step sets keys under dataset."),
    ([{"after": 5, "set": {"dataset.grouped_datasets.nope.weight": 2}}],
     "the config has no mapping at 'dataset.grouped_datasets.nope'"),
    ([{"after": 5, "set": {"dataset.no_such_knob": None}}], "is null (remove) but the config has no such key"),
    ([{"after": 5, "set": {"dataset.data_seed": 7}}], "prepack.schedule[0] cannot follow the config: dataset.data_seed"),
    ([{"after": 5, "set": {"dataset.grouped_datasets.vlm_sft.num_used_data": [20]}}],
     "dataset.grouped_datasets.vlm_sft.num_used_data changed"),
    ([{"after": 5, "set": {"dataset.grouped_datasets.vlm_sft.weight": "heavy"}}], "prepack.schedule[0]: "),
])
def test_a_wrong_schedule_is_refused_in_one_line(schedule, says):
    raw = demo_raw()
    raw["prepack"]["schedule"] = schedule
    with pytest.raises(ConfigError) as e:
        parse(raw)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_later_step_is_checked_against_every_earlier_config_not_only_the_one_before():
    """Removing a group and adding it back with other data moves its data order against step 0."""
    raw = demo_raw()
    vlm = copy.deepcopy(raw["dataset"]["grouped_datasets"]["vlm_sft"])
    vlm["num_used_data"] = [20]
    raw["prepack"]["schedule"] = [{"after": 5, "set": {"dataset.grouped_datasets.vlm_sft": None}},
                                  {"after": 9, "set": {"dataset.grouped_datasets.vlm_sft": vlm}}]
    with pytest.raises(ConfigError, match=r"prepack.schedule\[1\] cannot follow the config: .*vlm_sft.num_used_data"):
        parse(raw)


def test_a_step_sets_keys_of_a_mapping_the_config_gives_by_file(tmp_path):
    raw = demo_raw()
    groups = tmp_path / "groups.yaml"
    groups.write_text(yaml.safe_dump(raw["dataset"].pop("grouped_datasets")))
    raw["dataset"]["grouped_datasets_path"] = str(groups)
    raw["prepack"]["schedule"] = [{"after": 5, "set": {"dataset.grouped_datasets.vlm_sft.weight": 4}}]
    cfg = parse(raw)
    assert [g.weight for g in cfg.step_config(1).groups if g.name == "vlm_sft"] == [4]
    assert cfg.step_config(0) == parse({**raw, "prepack": {k: v for k, v in raw["prepack"].items() if k != "schedule"}})
