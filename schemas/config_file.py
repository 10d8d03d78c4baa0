"""A config file read whole: its sections (``schemas.config``), then its ``prepack.schedule``
(``schemas.schedule``).

Why a module of its own: each step of a schedule is parsed as a config of its own and checked as a
mix change (``schemas.mix_change``), so the schedule depends on the config model; the model cannot
also parse the schedule.  This module stands above the three.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Mapping

from schemas.config import PrepackConfig, parse_sections
from schemas.errors import ConfigError
from schemas.schedule import parse_schedule


def parse_config(raw: Mapping[str, Any], base_dir: str, *, config_path: str = "",
                 check_files: bool = True) -> PrepackConfig:
    """Validate a config mapping (as loaded from YAML) into a ``PrepackConfig``, with its schedule's
    steps when it has ``prepack.schedule`` (sections first: their mistakes are reported first)."""
    prepack_raw = raw.get("prepack") if isinstance(raw, Mapping) else None
    steps = None
    if isinstance(prepack_raw, Mapping) and "schedule" in prepack_raw:
        steps = prepack_raw["schedule"]
        raw = {**raw, "prepack": {k: v for k, v in prepack_raw.items() if k != "schedule"}}
    cfg = parse_sections(raw, base_dir, config_path=config_path, check_files=check_files)
    if steps is None:
        return cfg
    return replace(cfg, schedule=parse_schedule(steps, raw, cfg, base_dir, config_path, check_files))


def load_config(path: str, *, overrides: Mapping[str, Any] | None = None, check_files: bool = True) -> PrepackConfig:
    """Load and validate a YAML config file; ``overrides`` patches top-level sections (tests, CLI)."""
    import yaml  # here: the loader-only install has no PyYAML, and `prepack --help` needs none

    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if overrides:
        raw = dict(raw or {})
        for k, v in overrides.items():
            if isinstance(v, Mapping) and isinstance(raw.get(k), Mapping):
                raw[k] = {**raw[k], **v}
            else:
                raw[k] = v
    return parse_config(raw, os.path.dirname(path), config_path=path, check_files=check_files)
