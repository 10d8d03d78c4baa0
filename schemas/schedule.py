"""``prepack.schedule``: a planned mix change within one pack, as a config declares it.

Each step's config is the YAML document with its ``set`` and every earlier step's applied, parsed
as a config of its own (``schemas.config.parse_sections``); a step may set only keys of the dataset
block, and each step must be a mix change every earlier config allows (``schemas.mix_change``).
The steps live in ``PrepackConfig.schedule`` (``ScheduleStep``), parsed with the rest of a config by
``schemas.config_file``; a stream is packed under them by ``prepack.engine.schedule``.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from schemas.config import PrepackConfig, ScheduleStep, parse_sections
from schemas.config_checks import check_keys, load_mapping
from schemas.errors import ConfigError
from schemas.mix_change import mix_change_refusal

# What a schedule step may set: the dataset block (what a mix change may change is then checked
# by ``schemas.mix_change``); the streams, the seed, the tokenizer and the prepack section stay.
_STEP_SETTABLE = ("dataset",)


def parse_schedule(steps: Any, raw: Mapping[str, Any], base: PrepackConfig, base_dir: str, config_path: str,
                   check_files: bool) -> tuple[ScheduleStep, ...]:
    """``prepack.schedule``: a list of ``{after: N, set: {dotted.key: value}}``, ``after`` rising.

    Each step's config is the YAML document with its ``set`` and every earlier step's applied (a
    value of null removes the key, e.g. a group), parsed as a config of its own, so its paths and
    checks are a config's; each must be a mix change every earlier step's config allows."""
    if not isinstance(steps, list) or not steps:
        raise ConfigError("prepack.schedule must be a non-empty list of {after: N, set: {key: value}} steps")
    doc = copy.deepcopy(dict(raw))  # the steps' settings accumulate in this copy
    dataset = doc.get("dataset")
    if isinstance(dataset, dict):  # a mapping given by file is set in place like an inline one
        for key in ("grouped_datasets", "dataset_info"):
            if dataset.get(f"{key}_path") is not None:
                dataset[key] = load_mapping(base_dir, dataset, key)
                del dataset[f"{key}_path"]
    out: list[ScheduleStep] = []
    configs = [base]
    for i, step in enumerate(steps):
        where = f"prepack.schedule[{i}]"
        if not isinstance(step, Mapping):
            raise ConfigError(f"{where} must be a mapping {{after: N, set: {{key: value}}}}")
        check_keys(where, step, ["after", "set"])
        after = step.get("after")
        if isinstance(after, bool) or not isinstance(after, int) or after < 1:
            raise ConfigError(f"{where}.after must be a batch number of 1 or more, got {after!r}")
        if out and after <= out[-1].after:
            raise ConfigError(f"{where}.after must be above the step before it ({out[-1].after}), got {after}")
        settings = step.get("set")
        if not isinstance(settings, Mapping) or not settings:
            raise ConfigError(f"{where}.set must be a non-empty mapping of dotted keys to values "
                              "(e.g. dataset.grouped_datasets.vlm_sft.weight: 4)")
        for key, value in settings.items():
            _set_dotted(doc, str(key), value, f"{where}.set")
        try:
            cfg = parse_sections(doc, base_dir, config_path=config_path, check_files=check_files)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        for j, earlier in enumerate(configs):
            why = mix_change_refusal(earlier, cfg)
            if why:
                raise ConfigError(f"{where} cannot follow {'the config' if j == 0 else f'step {j - 1}'}: {why}")
        configs.append(cfg)
        out.append(ScheduleStep(after, cfg))
    return tuple(out)


def _set_dotted(doc: dict, key: str, value: Any, where: str) -> None:
    """``doc[a][b][c] = value`` for ``key`` "a.b.c" (None removes it); the mappings on the way must exist."""
    parts = key.split(".")
    if parts[0] not in _STEP_SETTABLE or len(parts) < 2 or not all(parts):
        raise ConfigError(f"{where}: '{key}': a step sets keys under {', '.join(k + '.' for k in _STEP_SETTABLE)} "
                          "(weights, is_mandatory, knobs, transforms, groups); the streams, seed, tokenizer and "
                          "prepack section are the whole pack's")
    node = doc
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: '{key}': the config has no mapping at "
                              f"'{'.'.join(parts[:depth + 1])}' to set it in")
        node = child
    if value is None:
        if parts[-1] not in node:
            raise ConfigError(f"{where}: '{key}' is null (remove) but the config has no such key")
        del node[parts[-1]]
    else:
        node[parts[-1]] = copy.deepcopy(value)
