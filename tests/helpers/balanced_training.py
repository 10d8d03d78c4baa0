"""One rank of a data-parallel CPU training over gloo with M micro-batches per optimizer step, the
loss normalized as NeMo's BAGEL recipe does: every micro-batch's CE sum and MSE mean-sum divided by
the token counts of the whole optimizer step (all-reduced over ranks and micro-batches), times the
world size, with gradients averaged over ranks (DDP's mean).  So the step's gradient is the same
whichever rank computes which of the step's batches: what balanced steps rely on.

The optimizer is SGD with momentum, linear in the gradients, so the weights differ by what the
gradients differ by (float summation order).  Not the training tests' AdamW: with BAGEL's
``eps=1e-15`` (or even 1e-8) Adam normalizes a gradient that is zero in exact arithmetic (the
attention's key bias: softmax ignores a constant shift) into a step of up to +-lr whose sign is
that of float noise, so any change in the order of a sum (balanced steps, but also another world
size or all-reduce) moves those 16 entries by ~lr (measured: 0.011 at eps=1e-15, 6e-4 at 1e-8,
every other weight within 2.4e-7): a property of Adam, not of the data."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.helpers.plain_loop import FORWARD_KEYS, fresh_model

LR, MOMENTUM = 0.05, 0.9  # SGD (see the module doc)


def train_rank(rank: int, world_size: int, packed_dir: str, balance: bool, micro_batches: int, steps: int,
               init: str, out: str) -> None:
    """Train ``steps`` optimizer steps; save ``{"losses", "weights", "read"}`` to ``out`` + rank."""
    from loader import Balance, PackedShardDataset

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    try:
        model, vae, _ = fresh_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        setting = Balance(micro_batches=micro_batches, sync="step") if balance else None  # DDP-like: one sync a step
        data = iter(PackedShardDataset(packed_dir, rank=rank, world_size=world_size, balance=setting))
        losses, read = [], []
        for _ in range(steps):
            batches = [next(data).cuda("cpu").to_dict() for _ in range(micro_batches)]
            read.append([repr(b.pop("batch_data_indexes")) for b in batches])
            counts = torch.tensor([sum(b["ce_loss_indexes"].numel() if "ce_loss_indexes" in b else 0 for b in batches),
                                   sum(b["mse_loss_indexes"].numel() if "mse_loss_indexes" in b else 0
                                       for b in batches)], dtype=torch.long)
            dist.all_reduce(counts)
            n_ce, n_mse = int(counts[0]), int(counts[1])
            step_loss = torch.zeros((), dtype=torch.float32)
            for b in batches:
                if "padded_images" in b:
                    with torch.no_grad():
                        b["padded_latent"] = vae.encode(b.pop("padded_images"))
                out_ = model(**{k: v for k, v in b.items() if k in FORWARD_KEYS})
                loss = torch.zeros((), dtype=torch.float32)
                if out_["ce"] is not None and n_ce > 0:
                    loss = loss + out_["ce"].sum() * world_size / n_ce
                if out_["mse"] is not None and n_mse > 0:
                    loss = loss + out_["mse"].mean(dim=-1).sum() * world_size / n_mse
                if loss.requires_grad:  # a batch without loss tokens adds nothing
                    loss.backward()
                step_loss += loss.detach()
            for p in model.parameters():  # DDP: the mean of the ranks' gradients (a rank's None is zeros)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= world_size
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            dist.all_reduce(step_loss)
            losses.append(float(step_loss) / world_size)
        torch.save({"losses": losses, "weights": model.state_dict(), "read": read}, f"{out}{rank}")
    finally:
        dist.destroy_process_group()


def differences(ref: dict, other: dict) -> tuple[float, float]:
    """Two trainings' (one rank's saved dict each): the largest relative difference of a step's loss
    and the largest absolute difference of a final weight."""
    losses, want = torch.tensor(other["losses"]), torch.tensor(ref["losses"])
    loss_diff = float(((losses - want).abs() / want.abs()).max())
    weight_diff = max(float((other["weights"][k] - ref["weights"][k]).abs().max()) for k in ref["weights"])
    return loss_diff, weight_diff


def spawn_target(rank: int, *args) -> None:
    """``torch.multiprocessing.spawn``'s entry: ``train_rank(rank, *args)``."""
    train_rank(rank, *args)


def train_two_ways(target, packed_dir: str, work: str, world: int, micro_batches: int, steps: int,
                   balance: bool) -> list[dict]:
    """Every rank's ``{"losses", "weights", "read"}`` of a ``world``-rank training run by ``target``
    (a ``spawn_target``: this module's, DDP-like, or ``tests/helpers/fsdp_training.py``'s, FSDP2)."""
    import torch.multiprocessing as mp

    out = os.path.join(work, f"{'balanced' if balance else 'reference'}-rank")
    init = os.path.join(work, f"pg-{balance}")
    mp.spawn(target, args=(world, packed_dir, balance, micro_batches, steps, init, out), nprocs=world, join=True)
    return [torch.load(f"{out}{r}", weights_only=True) for r in range(world)]


def check_balanced_against_reference(ref: list[dict], bal: list[dict], steps: int) -> tuple[float, float]:
    """Every rank saw the same losses, every step computed the reference's batches (dealt otherwise,
    somewhere), training moved; returns ``differences`` of the balanced run from the reference."""
    for r in range(len(ref)):
        assert ref[r]["losses"] == ref[0]["losses"] and bal[r]["losses"] == bal[0]["losses"]
    for t in range(steps):
        assert sorted(sum((x["read"][t] for x in ref), [])) == sorted(sum((x["read"][t] for x in bal), []))
    assert any(ref[r]["read"] != bal[r]["read"] for r in range(len(ref))), "balance moved no batch"
    assert len(set(ref[0]["losses"])) == steps  # training moves
    return differences(ref[0], bal[0])
