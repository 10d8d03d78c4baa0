"""``loader.nemo`` against NeMo AutoModel 0.7.0's real code: the recipe class and config resolve
through NeMo's CLI and config loader, ``build`` matches NeMo's signature, and the loader state
goes through NeMo's checkpointer (``weights_only=True``).  Training itself: test_training.py."""

from __future__ import annotations

import ast
import inspect
import dataclasses
import logging
import os
import subprocess
import sys

import pytest
import torch
import yaml
from tests.helpers.fakepack import batch_id, make_pack
from tests.helpers.paths import REPO
from tests.helpers.readme import readme_tested_blocks

pytest.importorskip("nemo_automodel")
pytest.importorskip("einops")  # NeMo's multimodal recipe module imports it

from nemo_automodel.components.datasets.multimodal.loader import BagelDataloaderConfig  # noqa: E402
from nemo_automodel.recipes._typed_config import RecipeConfig  # noqa: E402

from loader import PackedShardDataset  # noqa: E402
from loader.nemo import (  # noqa: E402
    PackedBagelDataloaderConfig,
    PackedRecipeConfig,
    _check_identity,
    packed_recipe_config,
)
from schemas.errors import ConfigError  # noqa: E402

SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "start_of_image": 3, "end_of_image": 4}


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pack"))
    make_pack(out, world_size=1, num_workers=2, lengths=[4, 5], shard_bytes=40 * 1024)
    return out


def _node(d: dict):
    from nemo_automodel.components.config.loader import ConfigNode

    return ConfigNode(d)


def test_import_loader_brings_no_nemo_ray_pil_transformers_polars_or_packer():
    heavy = ("nemo_automodel", "ray", "PIL", "transformers", "polars", "prepack")
    code = f"import sys, loader; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
    for name in os.listdir(os.path.join(REPO, "loader")):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(REPO, "loader", name)).read())
            imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            assert not imported & {"prepack", "ray", "PIL", "transformers", "polars"}, name


def test_build_has_nemos_keyword_signature():
    ours = inspect.signature(PackedBagelDataloaderConfig.build).parameters
    nemo = inspect.signature(BagelDataloaderConfig.build).parameters
    assert [(n, p.kind) for n, p in ours.items()] == [(n, p.kind) for n, p in nemo.items()]


def test_nemo_refuses_packed_dir_ours_reads_it_and_falls_back_to_nemo(pack):
    cfg = _node({"dataset": {"packed_dir": pack}, "dataloader": {"num_workers": 2, "prefetch_factor": 4}})
    with pytest.raises(TypeError, match="packed_dir"):
        RecipeConfig(cfg).bagel_dataloader  # why a recipe subclass is needed
    ours = PackedRecipeConfig(cfg).bagel_dataloader
    assert ours == PackedBagelDataloaderConfig(packed_dir=pack, num_workers=2, prefetch_factor=4)
    online = _node({"dataset": {"grouped_datasets": {}, "dataset_info": {}}, "dataloader": {"num_workers": 3}})
    assert isinstance(PackedRecipeConfig(online).bagel_dataloader, BagelDataloaderConfig)


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"dataset": {"packed_dir": "x", "grouped_datasets": {}}}, "grouped_datasets not used with packed_dir"),
        ({"dataset": {"packed_dir": "x"}, "dataloader": {"batch_size": 2}}, "unexpected field"),
    ],
)
def test_mistakes_are_one_clear_error(raw, match):
    with pytest.raises(ConfigError, match=match):
        PackedRecipeConfig(_node(raw)).bagel_dataloader


def test_recipe_config_swap_is_scoped():
    from nemo_automodel.recipes.multimodal import finetune

    with pytest.raises(RuntimeError):
        with packed_recipe_config():
            assert finetune.RecipeConfig is PackedRecipeConfig
            raise RuntimeError("setup failed")
    assert finetune.RecipeConfig is RecipeConfig


def test_build_returns_nemos_shape_and_checks(pack, caplog):
    cfg = PackedBagelDataloaderConfig(packed_dir=pack, num_workers=0)
    built = cfg.build(tokenizer=None, special_tokens=SPECIAL, rank=0, world_size=1, batch_size=1, global_seed=42)
    assert isinstance(built.dataset, PackedShardDataset) and built.dataloader.dataset is built.dataset
    with pytest.raises(ConfigError, match="local_batch_size must be 1"):
        cfg.build(tokenizer=None, special_tokens=SPECIAL, rank=0, world_size=1, batch_size=2, global_seed=42)
    identity = dataclasses.replace(built.dataset.pack.info, special_tokens=SPECIAL, config={"seed": 7})
    with pytest.raises(ConfigError, match="eos_token_id: tokenizer 9, pack 2"):
        _check_identity(identity, {**SPECIAL, "eos_token_id": 9}, 7)
    with caplog.at_level(logging.WARNING, logger="loader.nemo"):
        _check_identity(identity, SPECIAL, 42)
    assert "made with seed 7" in caplog.text


def test_readme_recipe_resolves_through_nemos_cli(tmp_path, pack):
    from nemo_automodel.cli.utils import load_yaml, resolve_recipe_name
    from nemo_automodel.components.config._arg_parser import parse_args_and_load_config
    from nemo_automodel.components.launcher.interactive import resolve_recipe_cls
    from nemo_automodel.recipes.multimodal.pretrain import PretrainRecipeForMultimodal

    config = yaml.safe_load(readme_tested_blocks()[0])
    config["dataset"]["packed_dir"] = pack
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    cls = resolve_recipe_cls(resolve_recipe_name(load_yaml(path)["recipe"]))
    assert issubclass(cls, PretrainRecipeForMultimodal)
    recipe = cls(parse_args_and_load_config(str(path), argv=[]))
    with packed_recipe_config():
        from nemo_automodel.recipes.multimodal import finetune

        assert finetune.RecipeConfig(recipe.cfg).bagel_dataloader.packed_dir == pack


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_state_through_nemos_checkpointer(pack, tmp_path, workers):
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer, CheckpointingConfig

    def make():
        cfg = PackedBagelDataloaderConfig(packed_dir=pack, num_workers=workers, pin_memory=False)
        built = cfg.build(tokenizer=None, special_tokens={}, rank=0, world_size=1, batch_size=1, global_seed=0)
        return built.dataloader

    full = [batch_id(b) for b in make()]
    ckpt = Checkpointer(
        config=CheckpointingConfig(enabled=True, checkpoint_dir=str(tmp_path), model_save_format="torch_save",
                                   model_cache_dir="", model_repo_id="", save_consolidated=False),
        dp_rank=0, tp_rank=0, pp_rank=0, moe_mesh=None,
    )  # fmt: skip
    assert ckpt.config.allow_legacy_pickle_restore is False  # so the load below is weights_only=True
    loader = make()
    it = iter(loader)
    head = [batch_id(next(it)) for _ in range(3)]
    ckpt.save_on_dp_ranks(loader, "dataloader", str(tmp_path))
    del it
    resumed = make()
    ckpt.load_on_dp_ranks(resumed, "dataloader", str(tmp_path))
    assert head + [batch_id(b) for b in resumed] == full
    assert torch.load(tmp_path / "dataloader" / "dataloader_dp_rank_0.pt", weights_only=True)


def test_dataset_progress_publishes_each_checkpoint(pack, tmp_path):
    """``dataset.progress: P`` in the recipe: the loader NeMo's checkpointer saves publishes the rank's
    checkpoint to P each time its ``state_dict()`` is taken (what a bounded pack trims behind)."""
    from schemas.progress import ProgressFolder

    progress = str(tmp_path / "progress")
    cfg = PackedRecipeConfig(_node({"dataset": {"packed_dir": pack, "progress": progress},
                                    "dataloader": {"num_workers": 0}})).bagel_dataloader
    assert cfg.progress == progress
    built = cfg.build(tokenizer=None, special_tokens=SPECIAL, rank=0, world_size=1, batch_size=1, global_seed=42)
    it = iter(built.dataloader)
    for _ in range(3):
        next(it)
    state = built.dataloader.state_dict()
    read = ProgressFolder(progress).read()
    assert read.packs == {built.dataset.fingerprint}
    positions = state["dataset_state"]["positions"]
    assert [read.checkpoints[s][-1].positions[s] for s in built.dataset.streams] == positions
    assert sum(positions) == 3


def test_dataset_balance_takes_the_recipes_gradient_accumulation(pack, tmp_path):
    """``dataset.balance: true``: micro-batches per rank and step default to NeMo's grad_acc_steps
    (global_batch_size // (local_batch_size x world size); its default global batch size is 8)."""
    from loader.balance import Balance
    from schemas.cost import CostModel

    def build(dataset: dict, steps: dict | None = None, world_size: int = 2, rank: int = 0):
        raw = {"dataset": {"packed_dir": pack, **dataset}, "dataloader": {"num_workers": 0}}
        cfg = PackedRecipeConfig(_node({**raw, **({"step_scheduler": steps} if steps else {})})).bagel_dataloader
        return cfg.build(tokenizer=None, special_tokens=SPECIAL, rank=rank, world_size=world_size, batch_size=1,
                         global_seed=42).dataset

    ds = build({"balance": True}, {"global_batch_size": 4, "local_batch_size": 1})
    assert ds.balance == Balance(2, "lockstep", CostModel.default())  # FSDP's lockstep unless told otherwise
    assert build({"balance": {"sync": "lockstep"}}).balance == Balance(4, "lockstep", CostModel.default())  # 8 / 2
    assert build({"balance": {"sync": "step", "micro_batches": 3}}, {"global_batch_size": 4}).balance.micro_batches == 3
    model = tmp_path / "cost.json"
    model.write_text('{"tokens": 1.0, "vae_canvas_pixels": 2.0}')
    assert build({"balance": {"cost_model": str(model)}}).balance.cost_model == CostModel.from_mapping(
        {"tokens": 1.0, "vae_canvas_pixels": 2.0})
    assert build({"balance": {"sync": "step"}}).balance.sync == "step"
    assert build({}, {"global_batch_size": 4}).balance is None  # off by default: the reference order
    with pytest.raises(ConfigError, match="global_batch_size 1 is less than"):
        build({"balance": True}, {"global_batch_size": 1})
    with pytest.raises(ConfigError, match="dataset.balance: sync must be one of lockstep, step"):
        build({"balance": {"sync": "ddp"}})
    with pytest.raises(ConfigError, match="dataset.balance: expected true or a mapping"):
        build({"balance": "yes"})
    with pytest.raises(ConfigError, match="cost_model not used with packed_dir"):
        build({"cost_model": str(model)})
    with pytest.raises(ConfigError, match="global_batch_size not used with packed_dir"):
        PackedRecipeConfig(_node({"dataset": {"packed_dir": pack, "global_batch_size": 4}})).bagel_dataloader
    # both ranks read every batch of the pack once, M per step
    got = [batch_id(b) for r in range(2) for b in build({"balance": True}, {"global_batch_size": 4}, rank=r)]
    assert sorted(got) == sorted(batch_id(b) for r in range(2) for b in build({}, rank=r))
