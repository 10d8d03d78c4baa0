"""Training does not change when it reads a pack, and resumes exactly after a real kill.

A small model that consumes every batch field (tests/helpers/tiny_bagel.py) trains for STEPS
steps on one CPU thread:
(a) NeMo AutoModel's own BAGEL recipe with its online packing DataLoader (2 workers);
(b) our recipe class from the README's YAML, reading the pack (NeMo's loop, checkpointer, ...);
(c) a plain loop over ``build_dataloader`` made by the README's upstream-BAGEL lines.
Every step's loss and the final weights must be bitwise equal.  Then run (b) is killed with
SIGKILL after NeMo wrote the checkpoint of step KILL_AT - 1, restarted from it by NeMo's
``load_checkpoint`` (model, optimizer, RNG, step scheduler, loader state with weights_only=True),
and must finish with the uninterrupted run's losses and weights.  What of NeMo runs on a CPU and
what not: tests/helpers/nemo_cpu.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
import yaml
from tests.helpers.nemo_cpu import recipe_config
from tests.helpers.oracle import reference_dataset_block
from tests.helpers.packs import build_pack
from tests.helpers.paths import REPO
from tests.helpers.readme import readme_tested_blocks

pytest.importorskip("nemo_automodel")
pytest.importorskip("einops")  # NeMo's multimodal recipe module imports it

STEPS, KILL_AT, WORKERS = 6, 3, 2
NEMO_RECIPE = "nemo_automodel.recipes.multimodal.pretrain.PretrainRecipeForMultimodal"


def _start(config: dict, work: str, name: str, hang_at: int | None = None) -> tuple[subprocess.Popen, str]:
    out = os.path.join(work, name)
    os.makedirs(out)
    path = os.path.join(out, "config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    cmd = [sys.executable, "-m", "tests.helpers.nemo_cpu", path, out]
    if hang_at is not None:
        cmd += ["--hang-at-step", str(hang_at)]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(os.path.join(out, "log.txt"), "w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), out


def _finish(proc: subprocess.Popen, out: str) -> tuple[list[float], dict]:
    assert proc.wait(timeout=600) == 0, open(os.path.join(out, "log.txt")).read()[-4000:]
    return _losses(out), torch.load(os.path.join(out, "final.pt"), weights_only=True)


def _losses(out: str) -> list[float]:
    by_step = {int(k): v for k, v in json.load(open(os.path.join(out, "losses.json"))).items()}
    assert sorted(by_step) == list(range(min(by_step), max(by_step) + 1))
    return [by_step[k] for k in sorted(by_step)]


def _same_weights(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _swap_ends(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[[0, -1]] = t[[-1, 0]]
    return t


def _first_wider(shapes):
    """One non-square latent transposed (where it still fits the padded latent)."""
    hmax, wmax = max(h for h, _ in shapes), max(w for _, w in shapes)
    k = next(i for i, (h, w) in enumerate(shapes) if h != w and w <= hmax and h <= wmax)
    return shapes[:k] + [(shapes[k][1], shapes[k][0])] + shapes[k + 1 :]


_CHANGES = {
    "packed_text_ids": lambda v: v + 1,
    "packed_text_indexes": _swap_ends,
    "packed_position_ids": lambda v: v + 1,
    "packed_vit_tokens": lambda v: v + 0.5,
    "packed_vit_position_ids": lambda v: v + 1,
    "packed_vit_token_indexes": _swap_ends,
    "vit_token_seqlens": lambda v: v.flip(0),
    "padded_images": lambda v: v + 0.5,
    "patchified_vae_latent_shapes": _first_wider,
    "packed_latent_position_ids": lambda v: v + 1,
    "packed_vae_token_indexes": _swap_ends,
    "packed_timesteps": lambda v: v + 0.3,
    "mse_loss_indexes": lambda v: v[:-1],
    "packed_label_ids": lambda v: v + 1,
    "ce_loss_indexes": _swap_ends,
    "ce_loss_weights": lambda v: torch.cat([v[:1] * 2, v[1:]]),
    "split_lens": lambda v: [v[0] + v[1]] + v[2:],  # two splits become one
    "attn_modes": lambda v: ["full" if m == "causal" else m for m in v],
    "nested_attention_masks": lambda v: [torch.zeros_like(m) for m in v],  # no masking at all
}


@pytest.mark.parametrize("use_flex", [True, False])
def test_the_model_consumes_every_field(use_flex):
    """Changing any one field of a batch changes the loss (else parity would prove less)."""
    from loader import SimpleCustomBatch
    from tests.helpers.fakepack import BatchSpec, make_batch
    from tests.helpers.plain_loop import fresh_model, train_steps

    # seed 1: three ViT images of different lengths, non-square latents, CE and MSE targets
    data = SimpleCustomBatch(make_batch(1, BatchSpec(use_flex=use_flex, n_samples=3))).to_dict()

    class Batch:
        def __init__(self, d):
            self.d = d

        def cuda(self, device):
            return self

        def to_dict(self):
            return dict(self.d)

    def loss(d) -> float:
        model, vae, optimizer = fresh_model()
        return train_steps(iter([Batch(d)]), model, vae, optimizer, 1, {})[0]

    base = loss(data)
    changed = [k for k in data if k in _CHANGES]
    assert len(changed) == len(data) - 3  # all but sequence_length, sample_lens, batch_data_indexes
    for name in changed:
        assert loss({**data, name: _CHANGES[name](data[name])}) != base, f"{name} does not reach the loss"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer_and_special):
    """Runs (a), (b) and the killed-then-resumed (b), as NeMo subprocesses (started together)."""
    root = str(tmp_path_factory.mktemp("train"))
    packed_dir = build_pack(root, tokenizer_and_special, batches=6)  # 2 streams x 6 batches, W=1, K=2
    from schemas.config_file import load_config

    cfg = load_config(os.path.join(root, "data", "config.yaml"))
    assert cfg.world_size == 1 and cfg.num_workers == WORKERS
    grouped, info = reference_dataset_block(cfg)
    online = json.loads(json.dumps({"grouped_datasets": grouped, "dataset_info": info, **asdict(cfg.knobs)}))
    common = dict(seed=cfg.seed, max_steps=STEPS, ckpt_every_steps=KILL_AT)

    readme_yaml = yaml.safe_load(readme_tested_blocks()[0])
    assert readme_yaml["dataset"] == {"packed_dir": "/data/packed"}, "README YAML block changed shape"
    readme_yaml["dataset"]["packed_dir"] = packed_dir

    def packed(ckpt: str) -> dict:
        base = recipe_config(recipe="", dataset={}, dataloader={}, checkpoint_dir=ckpt, **common)
        return {**base, **readme_yaml}  # the README's keys replace the base YAML's

    work = os.path.join(root, "runs")
    ref = _start(recipe_config(recipe=NEMO_RECIPE, dataset=online, dataloader={"num_workers": WORKERS},
                               checkpoint_dir=os.path.join(work, "ckpt-ref"), **common), work, "reference")  # fmt: skip
    full = _start(packed(os.path.join(work, "ckpt-packed")), work, "packed")
    killed_cfg = packed(os.path.join(work, "ckpt-killed"))
    killed, killed_out = _start(killed_cfg, work, "killed", hang_at=KILL_AT)

    deadline = time.time() + 600
    while not os.path.exists(os.path.join(killed_out, "hung")):
        log = os.path.join(killed_out, "log.txt")
        assert killed.poll() is None and time.time() < deadline, open(log).read()[-4000:]
        time.sleep(0.2)
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.wait(timeout=60) == -signal.SIGKILL
    resumed = _start(killed_cfg, work, "resumed")  # same YAML: NeMo finds the latest checkpoint

    return SimpleNamespace(
        packed_dir=packed_dir,
        reference=_finish(*ref),
        packed=_finish(*full),
        killed=_losses(killed_out),
        resumed=_finish(*resumed),
        checkpoints=sorted(os.listdir(os.path.join(work, "ckpt-killed"))),
    )


@pytest.mark.slow
def test_nemo_from_the_pack_trains_like_nemo_online(runs):
    ref_losses, ref_weights = runs.reference
    losses, weights = runs.packed
    assert len(ref_losses) == STEPS and len(set(ref_losses)) > 1
    assert losses == ref_losses
    assert _same_weights(weights, ref_weights)


@pytest.mark.slow
def test_killed_nemo_run_resumes_exactly(runs):
    losses, weights = runs.packed
    assert "epoch_0_step_2" in runs.checkpoints  # NeMo's checkpoint after step KILL_AT - 1
    assert runs.killed == losses[:KILL_AT]  # the killed run got no further
    resumed_losses, resumed_weights = runs.resumed
    assert runs.killed + resumed_losses == losses
    assert _same_weights(resumed_weights, weights)


@pytest.mark.slow
def test_upstream_lines_train_like_nemo_and_resume(runs, tmp_path):
    """The README's upstream-BAGEL lines, run as written, in a plain loop (one rank, gloo)."""
    import torch.distributed as dist

    from tests.helpers.plain_loop import fresh_model, train_steps

    load_block, save_block = readme_tested_blocks()[1:3]
    data_args = SimpleNamespace(packed_dir=runs.packed_dir, num_workers=WORKERS, prefetch_factor=2)
    training_args = SimpleNamespace(checkpoint_dir=str(tmp_path))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        def run_block(block: str, **names) -> dict:
            scope = {"os": os, "torch": torch, "dist": dist, "data_args": data_args,
                     "training_args": training_args, "resume_model_only": False, **names}  # fmt: skip
            exec(compile(block, "README.md", "exec"), scope)
            return scope

        model, vae, optimizer = fresh_model()
        status: dict = {}
        loader = run_block(load_block, resume_from=None)["train_loader"]
        it = iter(loader)
        losses = train_steps(it, model, vae, optimizer, KILL_AT, status)
        resume_from = os.path.join(str(tmp_path), f"{KILL_AT - 1:07d}")
        os.makedirs(resume_from)  # upstream's checkpoint folder for that step
        run_block(save_block, train_loader=loader, curr_step=KILL_AT - 1)
        del it
        loader = run_block(load_block, resume_from=resume_from)["train_loader"]
        losses += train_steps(iter(loader), model, vae, optimizer, STEPS - KILL_AT, status)
    finally:
        dist.destroy_process_group()

    nemo_losses, nemo_weights = runs.packed
    assert losses == nemo_losses
    assert _same_weights(model.state_dict(), nemo_weights)
    assert status and all(isinstance(w, dict) and w for w in status.values())  # upstream's data_status filled
