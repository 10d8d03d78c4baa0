"""The config model: a NeMo AutoModel BAGEL recipe YAML plus a ``prepack:`` section.

Accepted unchanged from NeMo: ``seed``, ``tokenizer``, ``dataset`` (``grouped_datasets[_path]``,
``dataset_info[_path]`` and every packing knob of the reference ``BagelDatasetConfig`` with its
default), ``dataloader.num_workers``.  Other recipe sections (model, optimizer, ...) are ignored.
Relative paths resolve against the config file's folder.  Every mistake raises ``ConfigError``
with one line that names the key and, for a typo, the closest valid name.  Each section's dataclass
parses itself (``parse``) and rebuilds itself from its stored ``to_dict()`` (``from_dict``).
A config file is read, its ``prepack.schedule`` included, by ``schemas.config_file.load_config``.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping, TypeVar

from schemas.compression import Compression
from schemas.cost import CostModel
from schemas.config_checks import check_keys, closest, is_kind, load_mapping, resolve, typed
from schemas.errors import ConfigError
from schemas.kinds import KINDS, SourceKind
from schemas.streams import rank_and_worker, workers_per_rank

DEFAULT_MAX_IMAGE_PIXELS = 400_000_000  # the reference's effective limit: 2 x PIL.MAX_IMAGE_PIXELS(2e8)


def _optional(cls: type, d: Mapping[str, Any] | None) -> Any:
    """``cls.from_dict(d)`` for an optional section, None where it was not set."""
    return None if d is None else cls.from_dict(d)


_Section = TypeVar("_Section")


class _FlatSection:
    """A section stored as its fields' plain values (``asdict``), so rebuilt from them by keyword."""

    @classmethod
    def from_dict(cls: "type[_Section]", d: Mapping[str, Any]) -> "_Section":
        return cls(**d)


@dataclass(frozen=True)
class TransformArgs:
    """``ImageTransform`` arguments (NaViT resize + normalisation), reference defaults."""

    max_image_size: int
    min_image_size: int
    image_stride: int
    max_pixels: int = 14 * 14 * 9 * 1024
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def parse(cls, where: str, d: Any) -> "TransformArgs":
        if not isinstance(d, Mapping):
            raise ConfigError(f"{where} must be a mapping")
        valid = ["max_image_size", "min_image_size", "image_stride", "max_pixels", "image_mean", "image_std"]
        check_keys(where, d, valid)
        for req in valid[:3]:
            if req not in d:
                raise ConfigError(f"{where} is missing '{req}'")
        kw: dict[str, Any] = {}
        for k in valid[:4]:
            if k in d:
                kw[k] = typed(where, d[k], (int, float), k)
                if kw[k] <= 0:
                    raise ConfigError(f"{where}.{k} must be positive, got {d[k]!r}")
        kw["image_stride"] = int(kw["image_stride"])
        for k in ("image_mean", "image_std"):
            if k in d:
                v = d[k]
                if not isinstance(v, (list, tuple)) or len(v) != 3:
                    raise ConfigError(f"{where}.{k} must be a list of 3 numbers, got {v!r}")
                kw[k] = tuple(float(x) for x in v)
        return cls(**kw)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TransformArgs":
        """The inverse of ``asdict`` after a JSON round trip (lists back to tuples); not re-validated."""
        return cls(**{**d, "image_mean": tuple(d["image_mean"]), "image_std": tuple(d["image_std"])})


@dataclass(frozen=True)
class FrameSamplerArgs(_FlatSection):
    max_num_frames: int = -1
    min_num_frames: int = 8
    sample: str = "rand"

    @classmethod
    def parse(cls, where: str, d: Any) -> "FrameSamplerArgs":
        if not isinstance(d, Mapping):
            raise ConfigError(f"{where} must be a mapping")
        check_keys(where, d, ["max_num_frames", "min_num_frames", "sample"])
        out = cls(**d)
        if out.sample == "rand" or out.sample == "middle":
            if out.max_num_frames < out.min_num_frames:
                raise ConfigError(
                    f"{where}: max_num_frames ({out.max_num_frames}) must be >= min_num_frames ({out.min_num_frames})"
                )
        elif not str(out.sample).startswith("fps"):
            raise ConfigError(f"{where}.sample must be 'rand', 'middle' or 'fpsN', got {out.sample!r}")
        return out


@dataclass(frozen=True)
class DatasetInfo(_FlatSection):
    """One ``dataset_info[group][name]`` entry; paths are absolute after loading."""

    name: str
    data_dir: str
    jsonl_path: str | None = None
    parquet_info_path: str | None = None

    @classmethod
    def parse(cls, where: str, name: str, raw: Any, kind: SourceKind, base: str, check_files: bool) -> "DatasetInfo":
        """Paths resolve against ``base`` (the config's folder); ``check_files`` also requires them to exist."""
        if not isinstance(raw, Mapping) or "data_dir" not in raw:
            raise ConfigError(f"{where} must be a mapping with 'data_dir'")
        check_keys(where, raw, list(kind.dataset_keys))
        di = cls(
            name=name,
            data_dir=resolve(base, raw["data_dir"], f"{where}.data_dir"),
            jsonl_path=resolve(base, raw["jsonl_path"], f"{where}.jsonl_path") if "jsonl_path" in raw else None,
            parquet_info_path=(
                resolve(base, raw["parquet_info_path"], f"{where}.parquet_info_path")
                if "parquet_info_path" in raw
                else None
            ),
        )
        for need in kind.dataset_needs:
            if need.key not in raw:
                raise ConfigError(need.missing(where))
        if check_files:
            if not is_kind(di.data_dir, directory=True):
                raise ConfigError(f"{where}.data_dir: directory not found: {di.data_dir}")
            for label, p in (("jsonl_path", di.jsonl_path), ("parquet_info_path", di.parquet_info_path)):
                if p is not None and not is_kind(p, directory=False):
                    raise ConfigError(f"{where}.{label}: file not found: {p}")
        return di


@dataclass(frozen=True)
class GroupConfig:
    name: str  # also the group's kind (``schemas.kinds``): t2i_pretrain | vlm_sft | unified_edit
    datasets: tuple[DatasetInfo, ...]
    num_used_data: tuple[int, ...]
    weight: float = 0.0
    is_mandatory: bool = False
    image_transform: TransformArgs | None = None
    vit_image_transform: TransformArgs | None = None
    frame_sampler: FrameSamplerArgs | None = None
    shuffle_lines: bool = False
    shuffle_seed: int = 0

    @property
    def kind(self) -> SourceKind:
        return KINDS[self.name]

    @classmethod
    def parse(cls, name: str, raw: Any, infos: Mapping, base: str, check_files: bool) -> "GroupConfig":
        """One ``grouped_datasets`` entry, with its datasets looked up in ``infos`` (all of ``dataset_info``)."""
        where = f"dataset.grouped_datasets.{name}"
        kind = KINDS.get(name)
        if kind is None:
            raise ConfigError(f"unknown group name '{name}' in dataset.grouped_datasets{closest(name, list(KINDS))}")
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} must be a mapping")
        check_keys(where, raw, list(kind.group_keys))
        names = raw.get("dataset_names")
        if not isinstance(names, list) or not names:
            raise ConfigError(f"{where}.dataset_names must be a non-empty list")
        used = raw.get("num_used_data")
        if not isinstance(used, list) or len(used) != len(names):
            raise ConfigError(f"{where}.num_used_data must be a list with one count per dataset name ({len(names)})")
        for u in used:
            if isinstance(u, bool) or not isinstance(u, int) or u <= 0:
                raise ConfigError(f"{where}.num_used_data entries must be positive integers, got {u!r}")
        group_infos = infos.get(name)
        if not isinstance(group_infos, Mapping):
            raise ConfigError(f"dataset.dataset_info has no entry for group '{name}'")
        datasets = []
        for ds in names:
            if ds not in group_infos:
                raise ConfigError(
                    f"dataset.dataset_info.{name} has no dataset '{ds}'{closest(str(ds), list(group_infos))}"
                )
            iw = f"dataset.dataset_info.{name}.{ds}"
            datasets.append(DatasetInfo.parse(iw, str(ds), group_infos[ds], kind, base, check_files))
        weight = typed(where, raw.get("weight", 0.0), (int, float), "weight")
        if weight < 0:
            raise ConfigError(f"{where}.weight must be >= 0, got {weight!r}")
        img = (
            TransformArgs.parse(f"{where}.image_transform_args", raw["image_transform_args"])
            if "image_transform_args" in raw
            else None
        )
        vit = (
            TransformArgs.parse(f"{where}.vit_image_transform_args", raw["vit_image_transform_args"])
            if "vit_image_transform_args" in raw
            else None
        )
        frames = (
            FrameSamplerArgs.parse(f"{where}.frame_sampler_args", raw["frame_sampler_args"])
            if "frame_sampler_args" in raw
            else None
        )
        for need in kind.group_needs:
            if need.key not in raw:
                raise ConfigError(need.missing(where))
        return cls(
            name=name,
            datasets=tuple(datasets),
            num_used_data=tuple(int(u) for u in used),
            weight=weight,
            is_mandatory=bool(typed(where, raw.get("is_mandatory", False), bool, "is_mandatory")),
            image_transform=img,
            vit_image_transform=vit,
            frame_sampler=frames,
            shuffle_lines=bool(typed(where, raw.get("shuffle_lines", False), bool, "shuffle_lines")),
            shuffle_seed=int(typed(where, raw.get("shuffle_seed", 0), int, "shuffle_seed")),
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GroupConfig":
        return cls(**{
            **d,
            "datasets": tuple(DatasetInfo.from_dict(x) for x in d["datasets"]),
            "num_used_data": tuple(d["num_used_data"]),
            "image_transform": _optional(TransformArgs, d["image_transform"]),
            "vit_image_transform": _optional(TransformArgs, d["vit_image_transform"]),
            "frame_sampler": _optional(FrameSamplerArgs, d["frame_sampler"]),
        })


@dataclass(frozen=True)
class PackingKnobs(_FlatSection):
    """The reference ``BagelDatasetConfig`` knobs, same names and defaults."""

    expected_num_tokens: int = 32768
    max_num_tokens_per_sample: int = 16384
    max_num_tokens: int = 36864
    prefer_buffer_before: int = 16384
    max_buffer_size: int = 50
    interpolate_pos: bool = False
    use_flex: bool = False
    data_seed: int = 42
    text_cond_dropout_prob: float = 0.1
    vit_cond_dropout_prob: float = 0.4
    vae_cond_dropout_prob: float = 0.1
    vae_image_downsample: int = 16
    max_latent_size: int = 32
    vit_patch_size: int = 14
    max_num_patch_per_side: int = 70

    @classmethod
    def parse(cls, where: str, raw: Mapping[str, Any]) -> "PackingKnobs":
        """The knobs set in ``raw`` (the whole dataset block: the caller checks its keys), typed as their defaults."""
        kw = {}
        for f in fields(cls):
            if f.name in raw:
                typ = bool if isinstance(f.default, bool) else type(f.default)
                kw[f.name] = typed(where, raw[f.name], typ, f.name)
        knobs = cls(**kw)
        for k in ("text_cond_dropout_prob", "vit_cond_dropout_prob", "vae_cond_dropout_prob"):
            if not 0.0 <= getattr(knobs, k) <= 1.0:
                raise ConfigError(f"{where}.{k} must be in [0, 1], got {getattr(knobs, k)!r}")
        for k in ("expected_num_tokens", "max_num_tokens", "max_num_tokens_per_sample", "vit_patch_size",
                  "vae_image_downsample", "max_latent_size", "max_num_patch_per_side"):
            if getattr(knobs, k) <= 0:
                raise ConfigError(f"{where}.{k} must be positive, got {getattr(knobs, k)!r}")
        return knobs


@dataclass(frozen=True)
class PrepackSection(_FlatSection):
    world_size: int = 1
    batches_per_stream: int | None = None
    tokens_per_stream: int | None = None
    passes: int | None = None
    shard_bytes: int = 256 * 2**20
    compression: str = "zstd:1"
    strict: bool = False
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_consecutive_failures: int = 10000
    balance: str = "none"  # "samples": each step's samples re-split among its ranks (prepack.run.sample_balance)
    cost_model: "dict[str, float] | None" = None  # term -> ms per unit (schemas.cost.CostModel.from_mapping)

    def budget(self) -> dict[str, int]:
        """The stream budget as ``{key: value}`` for the keys that are set (see ``BUDGET_KEYS``)."""
        return {k: int(getattr(self, k)) for k in BUDGET_KEYS if getattr(self, k) is not None}

    @classmethod
    def parse(cls, where: str, raw: Any) -> "PrepackSection":
        """The ``prepack:`` section; absent or empty means the defaults, which lack the budget it needs."""
        raw = raw or {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} must be a mapping")
        check_keys(where, raw, [f.name for f in fields(cls)])
        for k, v in raw.items():
            if k in ("compression", "balance"):
                typed(where, v, str, k)
            elif k == "cost_model":
                if v is not None and v != {}:  # none or {}: the default model
                    _parse_cost_model(where, v)
            elif k == "strict":
                typed(where, v, bool, k)
            elif v is not None:
                typed(where, v, int, k)
                if v <= 0:
                    raise ConfigError(f"{where}.{k} must be positive, got {v!r}")
        section = cls(**raw)
        try:
            Compression.parse(section.compression)
        except ValueError as e:
            raise ConfigError(f"{where}.compression: {e}") from None
        if section.balance not in BALANCE_KINDS:
            raise ConfigError(f"{where}.balance must be one of {', '.join(BALANCE_KINDS)}, got {section.balance!r}")
        if section.balance == "samples" and section.world_size < 2:
            raise ConfigError(f"{where}.balance: samples re-splits each step among its ranks: it needs world_size >= 2")
        if section.cost_model is not None:  # an empty mapping is the default model, stored as none
            section = replace(section, cost_model={str(k): float(v) for k, v in section.cost_model.items()} or None)
        if section.batches_per_stream is None and section.tokens_per_stream is None and section.passes is None:
            raise ConfigError(f"{where} needs a budget: batches_per_stream, tokens_per_stream or passes")
        return section


BALANCE_KINDS = ("none", "samples")
# Left out of a stored config at their defaults, so every pack made before they existed keeps its bytes and hash.
_UNSTORED_DEFAULTS = {"balance": "none", "cost_model": None}


def _parse_cost_model(where: str, v: Any) -> None:
    """``prepack.cost_model``: the cost model's coefficients, checked by the model itself."""
    try:
        CostModel.from_mapping(v)
    except ConfigError as e:
        raise ConfigError(f"{where}.cost_model: {e}") from None


# Where a stream stops; a pack can be extended by raising these, so they are not part of its identity.
BUDGET_KEYS = ("batches_per_stream", "tokens_per_stream", "passes")


@dataclass(frozen=True)
class ScheduleStep:
    """``prepack.schedule``'s step: from the stream's batch ``after`` on, pack under ``config`` (the
    whole config with the step's ``set`` applied, and every earlier step's), continued from the
    stream's state there as a continuation is (``schemas.mix_change``)."""

    after: int
    config: "PrepackConfig"


@dataclass(frozen=True)
class PrepackConfig:
    seed: int
    tokenizer: str | dict
    num_workers: int
    groups: tuple[GroupConfig, ...]
    knobs: PackingKnobs
    prepack: PrepackSection
    config_path: str = ""
    schedule: tuple[ScheduleStep, ...] = field(default=())  # a planned mix change within one pack

    @property
    def world_size(self) -> int:
        return self.prepack.world_size

    @property
    def num_streams(self) -> int:
        return self.prepack.world_size * workers_per_rank(self.num_workers)

    def stream_rank_worker(self, stream: int) -> tuple[int, int]:
        if not 0 <= stream < self.num_streams:
            raise ConfigError(f"stream {stream} out of range: this config has {self.num_streams} streams (W*K)")
        return rank_and_worker(stream, self.num_workers)

    def stream_seed(self, stream: int) -> int:
        """The reference's per-iterator reseed value for stream s = r*K + w."""
        rank, worker = self.stream_rank_worker(stream)
        base = int(self.seed or self.knobs.data_seed or 0)  # reference: global_seed or data_seed
        seed = base * max(1, self.world_size) + rank
        seed = seed * max(1, self.num_workers) + worker
        return seed & 0xFFFFFFFF

    # -- a schedule (``prepack.schedule``) --------------------------------------------------------
    def step_of(self, batch: int) -> int:
        """Which step packs the stream's batch ``batch`` (0-based): 0 is the config itself."""
        return sum(1 for st in self.schedule if st.after <= batch)

    def step_config(self, step: int) -> "PrepackConfig":
        """The config step ``step`` packs under, without a schedule of its own."""
        return replace(self, schedule=()) if step == 0 else self.schedule[step - 1].config

    def packed_under(self, batches: int) -> "PrepackConfig":
        """The config whose packer made a stream's state after ``batches`` batches."""
        return self.step_config(self.step_of(max(batches - 1, 0)))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("config_path")
        d.pop("schedule")
        for k, default in _UNSTORED_DEFAULTS.items():
            if d["prepack"].get(k) == default:
                d["prepack"].pop(k)
        if self.schedule:  # absent without one: the stored configs (and hashes) of every other pack stay as they were
            d["schedule"] = [{"after": st.after, "config": st.config.to_dict()} for st in self.schedule]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], config_path: str = "") -> "PrepackConfig":
        """The inverse of ``to_dict``, also after a JSON round trip (as stored in a pack's pack.json).

        Not re-validated and no paths re-resolved: it rebuilds what a pack was made with, whose files
        may have moved since; check ``content_hash()`` against the stored hash.
        """
        return cls(**{
            **d,
            "groups": tuple(GroupConfig.from_dict(g) for g in d["groups"]),
            "knobs": PackingKnobs.from_dict(d["knobs"]),
            "prepack": PrepackSection.from_dict(d["prepack"]),
            "config_path": config_path,
            "schedule": tuple(ScheduleStep(int(st["after"]), cls.from_dict(st["config"], config_path))
                              for st in d.get("schedule", ())),
        })

    def content_hash(self) -> str:
        """Hash of everything that shapes the output (paths included) except the budget, for refusing
        mismatched resumes; a larger budget extends a pack, since every stream is a prefix of an
        endless one."""
        d = self.to_dict()
        for part in [d] + [st["config"] for st in d.get("schedule", ())]:
            for k in BUDGET_KEYS:
                part["prepack"].pop(k, None)
        blob = json.dumps(d, sort_keys=True, default=list)
        return hashlib.sha256(blob.encode()).hexdigest()


_KNOB_NAMES = list(PackingKnobs.__dataclass_fields__)
_DATASET_KEYS = ["grouped_datasets", "grouped_datasets_path", "dataset_info", "dataset_info_path"] + _KNOB_NAMES
_OUR_TOP_KEYS = ["seed", "tokenizer", "dataset", "dataloader", "prepack"]


def _parse_tokenizer(tok: Any, base_dir: str) -> str | dict:
    """A tokenizer name, path or mapping; what looks like a local path resolves against the config's folder."""
    if isinstance(tok, Mapping):
        if "pretrained_model_name_or_path" not in tok:
            raise ConfigError("tokenizer mapping needs 'pretrained_model_name_or_path'")
        tok = dict(tok)
        p = tok["pretrained_model_name_or_path"]
        if isinstance(p, str) and (p.startswith((".", "/", "~")) or os.path.exists(os.path.join(base_dir, p))):
            tok["pretrained_model_name_or_path"] = resolve(base_dir, p, "tokenizer.pretrained_model_name_or_path")
    elif isinstance(tok, str):
        if tok != "qwen2-offline" and (tok.startswith((".", "/", "~")) or os.path.exists(os.path.join(base_dir, tok))):
            tok = resolve(base_dir, tok, "tokenizer")
    else:
        raise ConfigError(f"tokenizer must be a path, a mapping or 'qwen2-offline', got {tok!r}")
    return tok


def _parse_num_workers(dl: Any) -> int:
    if not isinstance(dl, Mapping):
        raise ConfigError("dataloader must be a mapping")
    num_workers = dl.get("num_workers", 1)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"dataloader.num_workers must be an integer >= 0, got {num_workers!r}")
    return num_workers


def _parse_dataset(ds: Any, base_dir: str, check_files: bool) -> tuple[tuple[GroupConfig, ...], PackingKnobs]:
    """The NeMo dataset block: its groups (each with its ``dataset_info``) and the packing knobs beside them."""
    if not isinstance(ds, Mapping):
        raise ConfigError("the config needs a 'dataset' mapping (the NeMo dataset block)")
    check_keys("dataset", ds, _DATASET_KEYS)
    grouped = load_mapping(base_dir, ds, "grouped_datasets")
    infos = load_mapping(base_dir, ds, "dataset_info")
    if not grouped:
        raise ConfigError("dataset.grouped_datasets is empty")
    groups = tuple(GroupConfig.parse(str(n), g, infos, base_dir, check_files) for n, g in grouped.items())
    knobs = PackingKnobs.parse("dataset", ds)
    if sum(g.weight for g in groups) <= 0:
        raise ConfigError("all group weights are zero: set a positive 'weight' on at least one group")
    return groups, knobs


def parse_sections(raw: Mapping[str, Any], base_dir: str, *, config_path: str = "",
                   check_files: bool = True) -> PrepackConfig:
    """Validate a config mapping (as loaded from YAML, ``prepack.schedule`` taken out) into a
    ``PrepackConfig`` without a schedule.

    Each section parses itself (``PrepackSection.parse``, ``GroupConfig.parse``, ...); the order of the
    calls decides which of several mistakes is reported, so keep it.  A schedule's steps are configs
    parsed here, so the schedule is parsed above this module (``schemas.config_file.parse_config``).
    """
    if not isinstance(raw, Mapping):
        raise ConfigError("the config must be a YAML mapping")
    for key in raw:
        if key not in _OUR_TOP_KEYS:
            close = difflib.get_close_matches(str(key), _OUR_TOP_KEYS, n=1, cutoff=0.75)
            if close:  # other recipe sections are fine; a near-miss of ours is a typo
                raise ConfigError(f"unknown key '{key}' at top level; did you mean '{close[0]}'?")
    seed = raw.get("seed", 42)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    tok = _parse_tokenizer(raw.get("tokenizer", "qwen2-offline"), base_dir)
    num_workers = _parse_num_workers(raw.get("dataloader") or {})
    section = PrepackSection.parse("prepack", raw.get("prepack"))
    groups, knobs = _parse_dataset(raw.get("dataset"), base_dir, check_files)
    need = section.world_size * max(1, num_workers)
    for g in groups:
        if sum(g.num_used_data) < need:
            raise ConfigError(
                f"dataset.grouped_datasets.{g.name}.num_used_data sums to {sum(g.num_used_data)}, smaller than "
                f"world_size*num_workers = {need}: some stream would get no data"
            )
    return PrepackConfig(
        seed=seed,
        tokenizer=tok,
        num_workers=num_workers,
        groups=groups,
        knobs=knobs,
        prepack=section,
        config_path=config_path,
    )
