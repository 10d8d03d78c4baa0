"""NeMo AutoModel's BAGEL recipe trained on a CPU, for the training tests (run as a subprocess).

    python -m tests.helpers.nemo_cpu CONFIG.yaml OUT_DIR [--hang-at-step K]

Everything that runs here is NeMo AutoModel 0.7.0's own code: the CLI's YAML loading and recipe
resolution (``parse_args_and_load_config``, ``resolve_recipe_name``, ``resolve_recipe_cls``), the
recipe class named in the YAML (ours subclasses NeMo's), its training loop
(``run_train_validation_loop`` -> ``_run_train_optim_step`` -> ``_forward_backward_step``: batch
``.to_dict()`` token counts, ``.cuda(device).to_dict()``, VAE encode of ``padded_images``, key
filtering, CE/MSE reductions, AdamW step), ``StepScheduler``, ``Checkpointer`` with
``BaseRecipe.save_checkpoint``/``load_checkpoint`` (dataloader state per DP rank, loaded with
``weights_only=True``), ``StatefulRNG`` and the metric logger, and the dataloader built by
``RecipeConfig(cfg).bagel_dataloader.build(...)``.

What cannot run on a CPU is ``recipe.setup()`` itself: its first line is
``torch.cuda.reset_peak_memory_stats()`` (needs a CUDA driver), it initialises NCCL, loads the
tokenizer with ``AutoTokenizer.from_pretrained`` and the model with
``NeMoAutoModelForMultimodalLM`` from a BAGEL checkpoint.  ``cpu_setup`` assigns the attributes
setup() builds, each with the NeMo API setup() uses, in setup()'s order; the BAGEL model and VAE
are ``tests.helpers.tiny_bagel``'s, the tokenizer the built-in ``qwen2-offline``.  The only other
substitution: ``torch.cuda.reset_peak_memory_stats`` (called by ``log_train_metrics``) is a no-op.

``--hang-at-step K`` blocks the model's forward of step K (0-based) forever after writing
``OUT_DIR/hung``: the checkpoint of step K-1 is on disk, the parent kills the process.
Outputs: ``OUT_DIR/losses.json`` (the loss of every step this process ran, from NeMo's metrics)
and ``OUT_DIR/final.pt`` (model state dict) when training finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import time
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import torch

SEED_MODEL = 1234
OPTIMIZER = {"_target_": "torch.optim.AdamW", "lr": 0.01, "betas": [0.9, 0.95], "eps": 1.0e-15, "weight_decay": 0.0}


def recipe_config(*, recipe: str, seed: int, dataset: dict, dataloader: dict, checkpoint_dir: str, max_steps: int,
                  ckpt_every_steps: int) -> dict:
    """A BAGEL recipe YAML (as a dict) for this CPU run: stage 2, one packed batch per step,
    no gradient clipping or warmup (so a plain loop can repeat the arithmetic exactly)."""
    return {
        "recipe": recipe,
        "seed": seed,
        "model": {"stage": 2},
        "step_scheduler": {"global_batch_size": 1, "local_batch_size": 1, "max_steps": max_steps,
                           "ckpt_every_steps": ckpt_every_steps, "log_remote_every_steps": 1},
        "optimizer": dict(OPTIMIZER),
        "clip_grad_norm": {"max_norm": 0},
        "checkpoint": {"enabled": True, "checkpoint_dir": checkpoint_dir},
        "dataset": dataset,
        "dataloader": dataloader,
    }  # fmt: skip


def _tokenizer():
    from nemo_automodel.components.datasets.multimodal import add_special_tokens

    from prepack.engine.tokenizer import load_tokenizer

    tokenizer, special, _ = add_special_tokens(load_tokenizer("qwen2-offline"))
    return tokenizer, special


def cpu_setup(recipe, out_dir: str, hang_at_step: int | None = None) -> None:
    """What ``FinetuneRecipeForMultimodal.setup()`` builds, on one CPU process (see module doc)."""
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer, CheckpointingConfig
    from nemo_automodel.components.loggers.metric_logger import build_metric_logger
    from nemo_automodel.components.training.rng import StatefulRNG
    from nemo_automodel.components.training.step_scheduler import StepScheduler
    from nemo_automodel.recipes.multimodal import finetune

    from loader.nemo import PackedSetupMixin, packed_recipe_config
    from tests.helpers.tiny_bagel import TinyBagel, TinyVAE

    torch.set_num_threads(1)
    cfg = recipe.cfg
    recipe.dist_env = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1, is_main=True)
    recipe.device_mesh = recipe.moe_mesh = recipe.mesh_context = None
    recipe.pp_enabled = False
    recipe.global_seed = int(cfg.get("seed", 4396))
    rank_seed = recipe.global_seed * recipe.dist_env.world_size + recipe.dist_env.rank
    random.seed(rank_seed)
    np.random.seed(rank_seed)
    torch.manual_seed(rank_seed)
    recipe.rng = StatefulRNG(seed=recipe.global_seed, ranked=True)
    recipe.tokenizer, recipe.special_tokens = _tokenizer()

    recipe.stage = int(cfg.get("model.stage", 1))
    recipe.vae_model = TinyVAE().eval()
    recipe.untrack_state("vae_model")
    torch.manual_seed(SEED_MODEL)
    model = TinyBagel()
    if hang_at_step is not None:
        _hang_at(model, hang_at_step, out_dir)
    recipe.model = model
    recipe.model_parts = [model]
    recipe.pp = None
    recipe.ema = None
    recipe.optimizer = [cfg.optimizer.instantiate(params=[p for p in model.parameters() if p.requires_grad])]
    recipe._use_lr_warmup, recipe.warmup_steps = False, 0
    recipe.base_lr = float(recipe.optimizer[0].param_groups[0]["lr"])

    # The dataloader exactly as setup() builds it; our recipe classes wrap setup() in packed_recipe_config().
    context = packed_recipe_config() if isinstance(recipe, PackedSetupMixin) else nullcontext()
    with context:
        build = finetune.RecipeConfig(cfg).bagel_dataloader.build(
            tokenizer=recipe.tokenizer,
            special_tokens=recipe.special_tokens,
            rank=recipe.dist_env.rank,
            world_size=recipe.dist_env.world_size,
            batch_size=cfg.get("step_scheduler.local_batch_size", 1),
            global_seed=recipe.global_seed,
        )
    recipe.dataloader = build.dataloader
    recipe._train_dataset = build.dataset
    recipe.untrack_state("_train_dataset")
    recipe.val_dataloader = None

    ss = dict(num_epochs=1, global_batch_size=8, local_batch_size=1, dp_size=1, ckpt_every_steps=500,
              log_remote_every_steps=10, dataloader=recipe.dataloader)  # fmt: skip
    ss.update(cfg.step_scheduler.to_dict())
    recipe.step_scheduler = StepScheduler(**ss)
    recipe._setup_garbage_collection(recipe.step_scheduler)

    recipe.peft_config = None
    ckpt = cfg.checkpoint.to_dict()
    ckpt.pop("restore_from", None)
    recipe.checkpointer = Checkpointer(
        config=CheckpointingConfig(**{**dict(enabled=True, model_save_format="torch_save", model_cache_dir="",
                                             model_repo_id="", save_consolidated=False, is_peft=False), **ckpt}),
        dp_rank=0, tp_rank=0, pp_rank=0, moe_mesh=None,
    )  # fmt: skip
    recipe.best_metric_key = "default"
    recipe.max_grad_norm = float(cfg.get("clip_grad_norm.max_norm", 1.0))
    recipe.lr_scheduler = None
    ckpt_dir = pathlib.Path(ckpt["checkpoint_dir"])
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    # flush=True: a killed run's metrics must reach the file (NeMo's default buffers 100 lines)
    recipe.metric_logger_train = build_metric_logger(str(ckpt_dir / "training.jsonl"), flush=True)
    recipe.metric_logger_valid = build_metric_logger(str(ckpt_dir / "validation.jsonl"), flush=True)
    recipe.load_checkpoint(cfg.get("checkpoint.restore_from", None))
    recipe.loss_fn = None


def _hang_at(model, step: int, out_dir: str) -> None:
    calls = {"n": 0}
    forward = model.forward

    def hanging_forward(**kwargs):
        if calls["n"] == step:
            pathlib.Path(out_dir, "hung").write_text(str(step))
            while True:
                time.sleep(3600)
        calls["n"] += 1
        return forward(**kwargs)

    model.forward = hanging_forward


def train(config_path: str, out_dir: str, hang_at_step: int | None = None) -> None:
    from nemo_automodel.cli.utils import load_yaml, resolve_recipe_name
    from nemo_automodel.components.config._arg_parser import parse_args_and_load_config
    from nemo_automodel.components.launcher.interactive import resolve_recipe_cls
    from nemo_automodel.components.loggers.metric_logger import MetricLogger

    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None  # CUDA-only call in log_train_metrics
    recipe_cls = resolve_recipe_cls(resolve_recipe_name(load_yaml(config_path)["recipe"]))
    recipe = recipe_cls(parse_args_and_load_config(config_path, argv=[]))
    cpu_setup(recipe, out_dir, hang_at_step)

    losses: dict[int, float] = {}
    log = MetricLogger.log

    def record(self, sample):  # NeMo's own metric values, kept in memory as the run goes
        if self is recipe.metric_logger_train:
            losses[int(sample.step)] = float(sample.metrics["loss"])
            pathlib.Path(out_dir, "losses.json").write_text(json.dumps(losses))
        return log(self, sample)

    MetricLogger.log = record
    recipe.run_train_validation_loop()
    torch.save(recipe.model.state_dict(), os.path.join(out_dir, "final.pt"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--hang-at-step", type=int, default=None)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    train(args.config, args.out, args.hang_at_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
