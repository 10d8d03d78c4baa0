"""A plain PyTorch training loop over a dataloader of packed batches, shaped like upstream BAGEL's
``train/pretrain_unified_navit.py`` (``data.cuda(device).to_dict()``, ``batch_data_indexes``
popped and folded into a ``data_status``, VAE encode of ``padded_images``), with the loss
arithmetic of NeMo's multimodal recipe step (CE sum / CE tokens + MSE mean-sum / MSE tokens,
one AdamW step, no clipping), so its losses and weights can be compared bit for bit with a
NeMo run on the same batches.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import torch

from tests.helpers.nemo_cpu import OPTIMIZER, SEED_MODEL
from tests.helpers.tiny_bagel import TinyBagel, TinyVAE

FORWARD_KEYS = set(inspect.signature(TinyBagel.forward).parameters) - {"self"}


def fresh_model() -> tuple[TinyBagel, TinyVAE, torch.optim.Optimizer]:
    """The model, VAE and optimizer every run starts from (same seed and settings as nemo_cpu)."""
    torch.set_num_threads(1)
    torch.manual_seed(SEED_MODEL)
    model = TinyBagel()
    kwargs = {k: v for k, v in OPTIMIZER.items() if k != "_target_"}
    return model, TinyVAE().eval(), torch.optim.AdamW(model.parameters(), **kwargs)


def train_steps(batches: Iterator, model, vae, optimizer, steps: int, data_status: dict) -> list[float]:
    """Train ``steps`` steps from ``batches``; returns each step's loss."""
    losses = []
    for _ in range(steps):
        data = next(batches).cuda("cpu").to_dict()
        for item in data.pop("batch_data_indexes"):
            data_status.setdefault(item["dataset_name"], {})[item["worker_id"]] = item["data_indexes"]
        n_ce = data["ce_loss_indexes"].numel() if "ce_loss_indexes" in data else 0
        n_mse = data["mse_loss_indexes"].numel() if "mse_loss_indexes" in data else 0
        if "padded_images" in data:
            with torch.no_grad():
                data["padded_latent"] = vae.encode(data.pop("padded_images"))
        out = model(**{k: v for k, v in data.items() if k in FORWARD_KEYS})
        loss = torch.zeros((), dtype=torch.float32)
        if out["ce"] is not None and n_ce > 0:
            loss = loss + out["ce"].sum() * 1 / max(n_ce, 1)
        if out["mse"] is not None and n_mse > 0:
            loss = loss + out["mse"].mean(dim=-1).sum() * 1 / max(n_mse, 1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().item())
    return losses
