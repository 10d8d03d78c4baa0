"""One rank of a CPU training of the tiny BAGEL under FSDP2 (``fully_shard``) over gloo, M micro-batches
per optimizer step, the loss normalized as NeMo's BAGEL recipe does (tests/helpers/balanced_training.py:
every micro-batch's CE sum and MSE mean-sum over the whole step's token counts, times the world
size; FSDP2's reduce-scatter averages the gradients over the ranks), gradients synced at every
micro-batch as the recipe leaves them (no ``set_requires_gradient_sync(False)``): the lockstep
training ``Balance(sync="lockstep")`` is for.

The layer (the attention projection ``qkv`` and the ``mlp``) is its own FSDP unit and the root
holds the rest.  Under FSDP2 every rank must take part in the same collectives: a unit whose
forward one rank skips leaves the other waiting on its all-gather (a gloo timeout), and a
parameter of a unit with a gradient on one rank but none on the other makes the ranks'
reduce-scatters differ in size (gloo: "Received data size doesn't match expected size").  The
tiny BAGEL uses its ViT, VAE and loss heads only for batches that have them, so those stay in
the root unit, and ``Sharded`` adds zero times every root parameter and the layer's output to the
outputs (``touch``): every parameter gets a gradient (exact zeros where unused, what DDP's helper
fills in) and the layer's backward runs in every backward, also for a batch without loss tokens
(its loss would otherwise not reach the layer: that rank skips the layer's backward all-gather
and reduce-scatter, and the ranks hang).  Only the layer, which every batch runs, is a unit of its
own.  (SGD with momentum, not AdamW: why in tests/helpers/balanced_training.py.)"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.balanced_training import LR, MOMENTUM
from tests.helpers.plain_loop import FORWARD_KEYS, fresh_model

LAYER = ("qkv", "mlp")  # the tiny BAGEL's transformer layer: run by every batch, its own FSDP unit


class Sharded(nn.Module):
    """The tiny BAGEL as FSDP2's root: its outputs plus ``touch``, zero times every root parameter
    and the layer's output (the module doc says why)."""

    def __init__(self, bagel: nn.Module):
        super().__init__()
        self.bagel = bagel
        self._layer_out: torch.Tensor | None = None
        getattr(bagel, LAYER[-1]).register_forward_hook(self._keep_layer_out)

    def _keep_layer_out(self, module, args, output) -> None:
        self._layer_out = output

    def forward(self, **batch):
        out = self.bagel(**batch)
        own = [p for name, p in self.bagel.named_parameters() if name.split(".")[0] not in LAYER]
        touched = sum(p.sum() for p in own) + self._layer_out.sum()  # inside forward: root params unsharded
        self._layer_out = None
        out["touch"] = touched * 0.0
        return out


def shard(bagel: nn.Module, mesh) -> Sharded:
    """``fully_shard`` the layer's modules, then the root."""
    from torch.distributed.fsdp import fully_shard

    for name in LAYER:
        fully_shard(getattr(bagel, name), mesh=mesh)
    model = Sharded(bagel)
    fully_shard(model, mesh=mesh)
    return model


def _step_counts(batches: list[dict]) -> tuple[int, int]:
    """The whole step's CE and MSE token counts, over every rank and micro-batch."""
    counts = torch.tensor([sum(b["ce_loss_indexes"].numel() if "ce_loss_indexes" in b else 0 for b in batches),
                           sum(b["mse_loss_indexes"].numel() if "mse_loss_indexes" in b else 0 for b in batches)],
                          dtype=torch.long)
    dist.all_reduce(counts)
    return int(counts[0]), int(counts[1])


def train_rank(rank: int, world_size: int, packed_dir: str, balance: bool, micro_batches: int, steps: int,
               init: str, out: str) -> None:
    """Train ``steps`` optimizer steps; save ``{"losses", "weights" (full tensors), "read"}`` to ``out`` + rank."""
    from torch.distributed.device_mesh import init_device_mesh

    from loader import PackedShardDataset
    from loader.balance import Balance

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    try:
        bagel, vae, _ = fresh_model()  # the same seed on every rank
        model = shard(bagel, init_device_mesh("cpu", (world_size,)))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        setting = Balance(micro_batches=micro_batches, sync="lockstep") if balance else None
        data = iter(PackedShardDataset(packed_dir, rank=rank, world_size=world_size, balance=setting))
        losses, read = [], []
        for _ in range(steps):
            batches = [next(data).cuda("cpu").to_dict() for _ in range(micro_batches)]
            read.append([repr(b.pop("batch_data_indexes")) for b in batches])
            n_ce, n_mse = _step_counts(batches)
            step_loss = torch.zeros((), dtype=torch.float32)
            for b in batches:  # every rank runs every micro-batch's forward and backward: FSDP's collectives
                if "padded_images" in b:
                    with torch.no_grad():
                        b["padded_latent"] = vae.encode(b.pop("padded_images"))
                out_ = model(**{k: v for k, v in b.items() if k in FORWARD_KEYS})
                loss = out_["touch"]
                if out_["ce"] is not None and n_ce > 0:
                    loss = loss + out_["ce"].sum() * world_size / n_ce
                if out_["mse"] is not None and n_mse > 0:
                    loss = loss + out_["mse"].mean(dim=-1).sum() * world_size / n_mse
                loss.backward()  # reduce-scatters each unit's gradients (the ranks' mean)
                step_loss += loss.detach()
            optimizer.step()
            optimizer.zero_grad()
            dist.all_reduce(step_loss)
            losses.append(float(step_loss) / world_size)
        weights = {k: v.full_tensor() for k, v in model.state_dict().items()}  # every rank gathers
        torch.save({"losses": losses, "weights": weights, "read": read}, f"{out}{rank}")
    finally:
        dist.destroy_process_group()


def spawn_target(rank: int, *args) -> None:
    """``torch.multiprocessing.spawn``'s entry: ``train_rank(rank, *args)``, then the process ends
    without the interpreter's teardown (why: ``exit_quietly`` in scripts/bench_lockstep.py)."""
    train_rank(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
