#!/usr/bin/env python
"""What an FSDP2 step waits for: the slowest rank of every micro-step, not the slowest rank's sum.

    python scripts/bench_lockstep.py                       # ~30 s on 2 cores
    python scripts/bench_lockstep.py --layers 4 --large 2048 --repeats 3

Why (issue 50): NeMo's BAGEL recipe trains under FSDP2 (``fully_shard``) without deferring the
gradient sync, so every micro-batch's forward all-gathers each layer's parameters and its
backward reduce-scatters each layer's gradients: the ranks meet at every layer of every
micro-batch ("lockstep").  A step of W ranks x M micro-batches then lasts the sum over
micro-steps of the slowest rank there (``loader.balance.lockstep_time``), and evening out each
rank's *sum* over the step (``loader.balance.assign_step``, the "rank-sum" model) need not
shorten it; grouping the batches into micro-steps (``loader.balance.assign_lockstep``) does.

The benchmark: W=2 ranks (``torch.multiprocessing.spawn``, gloo over a ``file://`` rendezvous, one
CPU thread each) train a stack of ``--layers`` blocks (Linear + GELU of ``--width``), each block
and the root wrapped in ``fully_shard`` on a CPU device mesh, one SGD step of M=4 micro-batches
per step.  A batch is ``size`` rows, so its compute scales with its size.  The step's 8 batches
are 4 of ``--large`` rows and 4 of ``--small`` rows, placed in the reference order where the two
models disagree most (``arrangement``: among all 70 placements, rank-sum balancing evens the sums
perfectly but leaves large and small batches in the same micro-steps, so it is *slower* than the
reference under lockstep while the rank-sum model says it is faster).  Three assignments are
timed: the reference (rank r computes batches r*M..r*M+M-1), the rank-sum assignment
(``assign_step`` on cost = size) and the micro-step assignment (``assign_lockstep`` with one
segment, cost = size).  Each step is timed on rank 0 between barriers; the assignments take turns,
``--warmup`` steps each first, then the median of ``--repeats``.  Beside the medians: what each
model predicts (``lockstep_time``, and the slowest rank's sum), also as a fraction of the
reference's.  A benchmark, not a test: the figures depend on the machine and its load (printed: with
fewer than W idle CPUs the ranks share them, the waiting no longer costs, and every assignment
takes about the total work).

Last line, exactly:
``lockstep bench: step time reference R s, rank-sum S s, micro-step L s (W=2 M=4, FSDP2 on cpu)``
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from loader.balance import assign_lockstep, assign_step, lockstep_time, rank_loads, reference_assignment  # noqa: E402

W, M = 2, 4
NAMES = ("reference", "rank-sum", "micro-step")


# -- the step's batches and their assignments ---------------------------------------------------
def assignments(sizes: np.ndarray) -> dict[str, np.ndarray]:
    """The three assignments of a step of batch ``sizes`` (reference order): (W, M) each, entry
    [r, j] the batch rank r computes in micro-step j."""
    sizes = np.asarray(sizes, np.float64)
    return {"reference": reference_assignment(W, M), "rank-sum": assign_step(sizes, W, M),
            "micro-step": assign_lockstep(sizes[:, None], W, M)}


def predictions(sizes: np.ndarray, assignment: np.ndarray) -> tuple[float, float]:
    """(lockstep model, rank-sum model): the step's time in rows under each model."""
    sizes = np.asarray(sizes, np.float64)
    return lockstep_time(sizes[:, None], W, M, assignment), float(rank_loads(sizes, W, M, assignment).max())


def arrangement(large: int, small: int) -> np.ndarray:
    """The step's batch sizes in reference order: M large and M small batches, placed where the
    models disagree most (the rank-sum assignment's lockstep time over the reference's, plus the
    reference's slowest sum over the rank-sum assignment's), the rank-sum assignment's sums even;
    the first such placement in ``itertools.combinations`` order (deterministic)."""
    best, best_score = None, None
    for where in itertools.combinations(range(W * M), M):
        sizes = np.full(W * M, small, np.int64)
        sizes[list(where)] = large
        a = assignments(sizes)
        ref_lock, ref_sum = predictions(sizes, a["reference"])
        rs_lock, rs_sum = predictions(sizes, a["rank-sum"])
        if rs_sum * W != sizes.sum():
            continue
        score = (rs_lock - ref_lock) + (ref_sum - rs_sum)
        if best_score is None or score > best_score:
            best, best_score = sizes, score
    return best


# -- one rank ------------------------------------------------------------------------------------
def make_model(width: int, layers: int) -> nn.Sequential:
    """A stack of Linear + GELU blocks, the same weights on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])


def _rank(rank: int, settings: dict, init: str, out: str) -> None:
    """Time every assignment's steps on this rank; rank 0 writes ``{name: [seconds, ...]}`` to ``out``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=W)
    try:
        mesh = init_device_mesh("cpu", (W,))
        model = make_model(settings["width"], settings["layers"])
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1)
        batches = [torch.randn(int(n), settings["width"], generator=g) for n in settings["sizes"]]
        plans = {k: np.asarray(v) for k, v in settings["assignments"].items()}
        times: dict[str, list[float]] = {k: [] for k in plans}
        for repeat in range(settings["warmup"] + settings["repeats"]):
            for name, plan in plans.items():  # the assignments take turns: drift hits all alike
                dist.barrier()
                start = time.perf_counter()
                for j in range(M):
                    model(batches[int(plan[rank, j])]).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                dist.barrier()
                if repeat >= settings["warmup"]:
                    times[name].append(time.perf_counter() - start)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(times, f)
    finally:
        dist.destroy_process_group()
    exit_quietly()


def exit_quietly() -> None:
    """End a rank's process, its results written, without the interpreter's teardown: there gloo's
    threads now and then abort it (std::terminate: "terminate called without an active exception",
    after ``destroy_process_group`` on both ranks; 3 of ~120 two-rank runs here, on a loaded machine)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def measure(sizes: np.ndarray, plans: dict[str, np.ndarray], args: argparse.Namespace) -> dict[str, float]:
    """The median step time of each assignment, two ranks under FSDP2."""
    settings = {"width": args.width, "layers": args.layers, "warmup": args.warmup, "repeats": args.repeats,
                "sizes": [int(s) for s in sizes], "assignments": {k: v.tolist() for k, v in plans.items()}}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_rank, args=(settings, os.path.join(tmp, "pg"), out), nprocs=W, join=True)
        with open(out) as f:
            times = json.load(f)
    return {k: statistics.median(v) for k, v in times.items()}


# -- the report ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=256, help="each block's width (default 256)")
    ap.add_argument("--layers", type=int, default=8, help="blocks, each its own fully_shard unit (default 8)")
    ap.add_argument("--large", type=int, default=4096, help="rows of a large batch (default 4096)")
    ap.add_argument("--small", type=int, default=512, help="rows of a small batch (default 512)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per assignment first (default 2)")
    ap.add_argument("--repeats", type=int, default=7, help="timed steps per assignment; the median is shown (default 7)")
    args = ap.parse_args(argv)
    if min(args.width, args.layers, args.small, args.repeats) < 1 or args.warmup < 0:
        ap.error("--width, --layers, --small and --repeats must be >= 1, --warmup >= 0")
    if args.large <= args.small:
        ap.error("--large must be more rows than --small")

    sizes = arrangement(args.large, args.small)
    plans = assignments(sizes)
    print(f"lockstep bench: W={W} ranks x M={M} micro-batches, {args.layers} blocks of width {args.width}, "
          f"each under fully_shard (gloo, cpu, 1 thread per rank); {args.warmup} warm-up + {args.repeats} "
          f"timed steps per assignment", flush=True)
    print(f"batch sizes (rows, reference order): {' '.join(str(int(s)) for s in sizes)}", flush=True)
    print(f"machine: {len(os.sched_getaffinity(0))} CPUs for this process, load average {os.getloadavg()[0]:.2f} "
          f"(the ranks need {W} idle CPUs: on fewer they share, and every assignment takes the total work)",
          flush=True)
    medians = measure(sizes, plans, args)

    ref_lock, ref_sum = predictions(sizes, plans["reference"])
    print(f"{'assignment':<11} {'micro-steps (rank 0 | rank 1 sizes)':<42} {'lockstep model':>16} "
          f"{'rank-sum model':>16} {'measured':>16}")
    for name in NAMES:
        plan = plans[name]
        lock, top = predictions(sizes, plan)
        steps = ", ".join(f"{sizes[plan[0, j]]}|{sizes[plan[1, j]]}" for j in range(M))
        print(f"{name:<11} {steps:<42} {lock:>8.0f} ({lock / ref_lock:.2f}) {top:>8.0f} ({top / ref_sum:.2f}) "
              f"{medians[name]:>7.3f} s ({medians[name] / medians['reference']:.2f})")
    print("(models in rows, measured the median step; in brackets: the fraction of the reference's)")
    print(f"lockstep bench: step time reference {medians['reference']:.4f} s, rank-sum {medians['rank-sum']:.4f} s, "
          f"micro-step {medians['micro-step']:.4f} s (W={W} M={M}, FSDP2 on cpu)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
