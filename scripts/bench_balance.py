#!/usr/bin/env python
"""How much of a step's time balancing gives back, by both step models: lockstep (FSDP) and step (DDP).

    python scripts/bench_balance.py                          # builds the two cost packs (a few minutes)
    python scripts/bench_balance.py --pack .costpack/costpack.tar.xz
    python scripts/bench_balance.py --pack PACK [--pack PACK2] --steps 200 \
        --cost-fit docs/data/record_cost_fit_h200_segments.json

Why (issues 44, 50; ``loader.balance``): ranks wait for each other.  Under **lockstep** (FSDP /
ZeRO-3, or DDP without ``no_sync``: both BAGEL stacks) they wait in every segment (the VAE encode,
the ViT, the LLM: ``schemas.cost.SEGMENTS``) of every micro-step, so a step lasts the sum over
micro-steps and segments of the slowest rank; under **step** (DDP under ``no_sync``) only at the
step's end, so it lasts as long as the largest rank sum.  The packs are
``scripts/make_cost_pack.py``'s (camera-sized pictures, NeMo's pretrain knobs 32768/36864/16384
with flex, a ``default`` mix and a VLM-heavy ``vlm`` mix), built under ``--out`` when no
``--pack`` is given; ``--pack`` takes a pack folder, a folder of packs, or a ``.tar``/``.tar.xz``
archive of packs.

Two sources of per-record costs, each giving the grid (W in ``--worlds`` x M in ``--micro``) for
each pack alone:

- **the model**: every record's cost terms read from the stream indexes (never the records),
  priced per segment by the cost model (``CostModel.default()``, BAGEL-7B from FLOPs, or
  ``--cost-fit``): steps assigned and timed by the model;
- **the H200 per-part timings** (``--check-csv``, default ``docs/data/record_cost_h200.csv``:
  111 records of the same two packs timed on an H200, ``scripts/cost_fit.segment_times``): steps
  assigned by the cost model from the records' terms, as a training would from the index, and
  timed by what the H200 measured for each segment.

Each cell draws ``--steps`` steps of W x M records with replacement
(``numpy.random.default_rng([seed, W, M])``: the same draw every run).  Per cell, **lockstep**:
the reference step time over the mean rank's work, then balanced (``assign_lockstep``) and the
bound (``lockstep_bound``: each segment grouped on its own; no grouping beats it, none need reach
it) as step time relative to the reference; **step**: the slowest rank's sum over the mean for the
reference, balanced (``assign_step``) and the ideal, and the balanced step time relative to the
reference; and each assignment's CPU per step.  The rank-sum assignment timed under lockstep says
what the previous balancing gives an FSDP training.

"Balanced samples" (M = 1: each step's samples re-split among its batches,
``prepack.engine.resplit.balance_samples``) is simulated at W=64 on the packs' records by the
model; a real ``prepack: balance: samples`` pack is packed too (``--packed-batches``; W=4, K=1, the
default mix) and its step time read from its index and its reference's.

Last line, exactly:
``balance: lockstep step time X of the reference at W=64 M=4 (bound Y); step model Z; samples at M=1: S``
(X, Y: by the H200 per-part timings, pooled over both packs, assigned by the cost model; Z: the
step model's balanced step time by the same timings; S: balanced samples by the model).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.dirname(os.path.abspath(__file__)), ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402

from pack_dirs import pack_dirs  # noqa: E402
from cost_fit import read_csv, segment_times  # noqa: E402
from loader.balance import (assign_lockstep, assign_step, ideal_spread, lockstep_bound, lockstep_time,  # noqa: E402
                            rank_loads, step_spread)
from loader.reader import Pack, read_shard  # noqa: E402
from prepack.engine.resplit import balance_samples, samples_of  # noqa: E402
from schemas.cost import COST_TERMS, SEGMENTS, TERM_COLUMNS, CostModel  # noqa: E402
from schemas.packed_batch import PackedBatch
from schemas.record import RECORD_SCHEMA

log = logging.getLogger("bench_balance")

HEADLINE = (64, 4)  # (W, M) of the last line
CHECK_CSV = os.path.join(ROOT, "docs", "data", "record_cost_h200.csv")
_COLUMNS = sorted(TERM_COLUMNS, key=RECORD_SCHEMA.get_field_index)  # a projection reads in schema order
_SCALARS = ("use_flex", "max_num_tokens", "sequence_length")


# -- the packs ----------------------------------------------------------------------------------
def build_packs(out: str, batches: int, seed: int) -> list[str]:
    """``make_cost_pack.py``'s two packs (``default``, ``vlm``) under ``out``, by the product's command."""
    import make_cost_pack as mcp  # a script beside this one (PIL, yaml): only when packs are built

    ds = mcp.make_data(os.path.join(out, "data"), seed)
    dests = []
    for mix in ("default", "vlm"):
        cfg = mcp.config(ds, batches, seed, mix, mcp.VLM_WEIGHTS if mix == "vlm" else None)
        dest = os.path.join(out, mix)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "prepack.cli", "run", cfg, "--out", dest, "--no-ray", "--no-progress"],
                       cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": ROOT},
                       stdout=sys.stderr)  # this one's stdout holds the figures only
        log.info("pack %s: %d records in %.0f s", mix, mcp.records(dest), time.perf_counter() - t0)
        dests.append(dest)
    return dests


def cost_view(record) -> PackedBatch:
    """The fields ``terms_of`` reads, from a projected record (the others left empty)."""
    fields = {name: record.column(name)[0].as_py() for name in _SCALARS}
    for name in _COLUMNS:
        if name not in _SCALARS:
            fields[name] = record.column(name).flatten().to_numpy(zero_copy_only=False)
    fields["vae_latent_shapes"] = fields["vae_latent_shapes"].reshape(-1, 2)
    return PackedBatch(vit_patch_size=0, **fields)


def read_terms(pack_dir: str) -> np.ndarray:
    """Every record's ``COST_TERMS`` of one pack, stream by stream, int64 [records, terms]: from the
    stream indexes, which store them (no record is read)."""
    pack = Pack.open(pack_dir)
    rows = [pack.record_terms(s, i) for s in range(pack.num_streams) for i in range(pack.num_records(s))]
    return np.array(rows, np.int64).reshape(-1, len(COST_TERMS))


def model_of(fit_path: str | None) -> tuple[CostModel, str]:
    """The default model, or a ``time_record_cost.py`` fit's (``CostModel.read``)."""
    if not fit_path:
        return CostModel.default(), "default (BAGEL-7B from FLOPs)"
    return CostModel.read(fit_path), f"fit {fit_path}"


# -- the simulation -------------------------------------------------------------------------------
@dataclass
class Cell:
    """One (W, M) cell's figures over its steps, by both step models."""

    world_size: int
    micro_batches: int
    steps: int
    lock_reference: float  # lockstep: reference step time / the mean rank's work, mean over the steps
    lock_balanced: float  # summed step time, assign_lockstep / reference
    lock_bound: float  # summed lockstep_bound / reference
    lock_ranksum: float  # summed step time of assign_step's assignment under lockstep / reference
    reference: float  # step: mean spread (slowest rank sum / mean), reference assignment
    balanced: float  # the same, assign_step
    ideal: float  # the same, the lower bound
    step_time: float  # step: sum of slowest ranks, balanced / reference
    ideal_time: float  # sum of lower bounds / reference
    lock_cpu_us: float  # assign_lockstep's CPU per step
    cpu_us: float  # assign_step's CPU per step


def simulate(timed: np.ndarray, world_size: int, micro_batches: int, steps: int, seed: int,
             priced: np.ndarray | None = None) -> Cell:
    """``steps`` steps of W x M records drawn from the rows of ``timed`` ((n, S): each record's time
    per segment; with replacement, fixed seed), assigned by ``priced`` (the same rows as a cost model
    prices them; None: ``timed`` itself) and timed by ``timed``."""
    priced = timed if priced is None else priced
    rng = np.random.default_rng([seed, world_size, micro_batches])
    n, w, m = len(timed), world_size, micro_batches
    spreads = np.zeros((steps, 3))
    slowest = np.zeros((steps, 3))
    lock = np.zeros((steps, 4))  # reference, balanced, bound, rank-sum assignment
    lock_ratio = np.zeros(steps)
    cpu = lock_cpu = 0
    for t in range(steps):
        idx = rng.integers(n, size=w * m)
        seg, by = timed[idx], priced[idx]
        c, c_by = seg.sum(axis=1), by.sum(axis=1)
        t0 = time.thread_time_ns()
        a = assign_step(c_by, w, m)
        t1 = time.thread_time_ns()
        la = assign_lockstep(by, w, m)
        t2 = time.thread_time_ns()
        cpu += t1 - t0
        lock_cpu += t2 - t1
        lock[t] = (lockstep_time(seg, w, m), lockstep_time(seg, w, m, la), lockstep_bound(seg, w, m),
                   lockstep_time(seg, w, m, a))
        mean = c.sum() / w
        lock_ratio[t] = lock[t, 0] / mean
        ideal = ideal_spread(c, w, m)
        spreads[t] = (step_spread(c, w, m), step_spread(c, w, m, a), ideal)
        slowest[t] = (rank_loads(c, w, m).max(), rank_loads(c, w, m, a).max(), ideal * mean)
    lt = lock.sum(axis=0)
    ref_time = slowest[:, 0].sum()
    return Cell(w, m, steps, float(lock_ratio.mean()), float(lt[1] / lt[0]), float(lt[2] / lt[0]),
                float(lt[3] / lt[0]), *spreads.mean(axis=0).tolist(), float(slowest[:, 1].sum() / ref_time),
                float(slowest[:, 2].sum() / ref_time), lock_cpu / steps / 1e3, cpu / steps / 1e3)


HEADER = (f"{'W':>4} {'M':>2}  lockstep: ref/mean balanced  bound  rank-sum   step: spread ref balanced ideal  "
          f"time    CPU/step lockstep, step")


def cell_line(cell: Cell) -> str:
    return (f"{cell.world_size:>4} {cell.micro_batches:>2}  {cell.lock_reference:17.3f} {cell.lock_balanced:8.4f} "
            f"{cell.lock_bound:6.4f} {cell.lock_ranksum:9.4f}   {cell.reference:17.4f} {cell.balanced:8.4f} "
            f"{cell.ideal:5.4f} {cell.step_time:6.4f}   {cell.lock_cpu_us:8.0f} us, {cell.cpu_us:.0f} us")


def grid(title: str, timed: np.ndarray, priced: np.ndarray | None, cells: list, args) -> dict:
    """Print one source's grid; returns its cells by (W, M)."""
    print(title)
    print(HEADER)
    out = {}
    for w, m in cells:
        out[(w, m)] = cell = simulate(timed, w, m, args.steps, args.seed, priced)
        print(cell_line(cell))
    return out


SAMPLES_W = 64  # the W of "samples at M=1" in the last line


def read_steps_samples(pack_dir: str, model: CostModel) -> list[tuple[list, float, int]]:
    """Every record of one pack as ``balance_samples`` sees it: (its samples, its fixed cost, its
    capacity ``max_num_tokens``), from a projected read (never the pixel table)."""
    pack = Pack.open(pack_dir)
    out = []
    for stream in range(pack.num_streams):
        for shard in pack.index(stream).shards:
            for _, record in read_shard(pack, shard, columns=_COLUMNS):
                batch = cost_view(record)
                samples, fixed = samples_of(batch, model)
                out.append((samples, fixed, int(batch.max_num_tokens)))
        pack.forget(stream)
    return out


def samples_figure(pack_dirs_: list[str], model: CostModel, args) -> float | None:
    """Balanced samples' step time over the reference at M = 1, W = ``SAMPLES_W``: steps drawn from
    the packs' records (as ``simulate`` draws), each step's samples re-split by
    ``prepack.engine.resplit.balance_samples`` (VAE samples in place, within each batch's max_num_tokens)
    and its slowest batch compared with the reference's.  A simulation of what the pack-time option
    would give: the re-split batches are not packed here."""
    records = [r for d in pack_dirs_ for r in read_steps_samples(d, model)]
    if not records:
        return None
    rng = np.random.default_rng([args.seed, SAMPLES_W, 1])
    ref_time = bal_time = 0.0
    for _ in range(args.steps):
        step = [records[i] for i in rng.integers(len(records), size=SAMPLES_W)]
        # a batch's cost: the intercept, its fixed part (its VAE canvas stays with it), its samples'
        cost = lambda b, taken: model.intercept + step[b][1] + sum(step[src][0][k].cost for src, k in taken)  # noqa: E731
        ref_time += max(cost(b, [(b, k) for k in range(len(step[b][0]))]) for b in range(SAMPLES_W))
        split = balance_samples([r[0] for r in step], [r[2] for r in step], [r[1] for r in step])
        bal_time += max(cost(b, taken) for b, taken in enumerate(split))
    return bal_time / ref_time


PACKED_W = 4  # the W of the packed balanced-samples pack (its data has 4 files per parquet group)


def tree_bytes(path: str) -> int:
    """Bytes of every file under ``path``."""
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)


def packed_samples(out: str, batches: int, seed: int) -> str:
    """A real ``prepack: balance: samples`` pack (``make_cost_pack``'s data and knobs, the default mix,
    W=4, K=1): its reference packed first by the product's command as a plain pack of the same config
    (what the balanced run packs into ``OUT/reference``), then the balanced run in this process, which
    finds the reference done and only balances (timed apart from loading the tokenizer).  Returns the figure's line: the model's step time of the packed
    steps over the reference's, and the balancing's wall time beside the packing's."""
    import make_cost_pack as mcp  # a script beside this one (PIL, yaml): only when packs are built
    import yaml

    ds = mcp.make_data(os.path.join(out, "data-samples"), seed)
    raw = yaml.safe_load(open(mcp.config(ds, batches, seed, "samples", None)))
    raw["dataloader"]["num_workers"] = 1
    raw["prepack"]["world_size"] = PACKED_W
    dest = os.path.join(out, "samples")
    configs = {}
    for name in ("none", "samples"):
        raw["prepack"]["balance"] = name
        configs[name] = os.path.join(ds.root, f"samples-{name}.yaml")
        with open(configs[name], "w") as f:
            yaml.safe_dump(raw, f, sort_keys=False)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "prepack.cli", "run", configs["none"], "--out", os.path.join(dest, "reference"),
                    "--no-ray", "--no-progress"], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": ROOT},
                   stdout=sys.stderr)
    packing_s = time.perf_counter() - t0
    plain_bytes = tree_bytes(os.path.join(dest, "reference"))  # an ordinary pack of the same config, whole
    from prepack.engine.tokenizer import load_tokenizer, special_token_ids
    from prepack.run.driver import RunOptions, run_pack
    from schemas.config_file import load_config

    cfg = load_config(configs["samples"])
    tokenizer = special_token_ids(load_tokenizer(cfg.tokenizer))
    t0, c0 = time.perf_counter(), time.process_time()
    run_pack(cfg, dest, RunOptions(inline=True, bar=False), tokenizer=tokenizer)  # the reference is done: balancing only
    balancing_s, balancing_cpu = time.perf_counter() - t0, time.process_time() - c0
    model = CostModel.default()
    pack, ref = Pack.open(dest), Pack.open(os.path.join(dest, "reference"))
    steps = min(pack.num_records(s) for s in range(PACKED_W))
    slowest = np.zeros(2)
    for j in range(steps):
        for i, p in enumerate((ref, pack)):
            slowest[i] += max(float(model.estimate(np.asarray(p.record_terms(s, j))))
                              for s in range(PACKED_W))
    records = steps * PACKED_W
    return (f"balanced samples, packed (W={PACKED_W}, K=1, {steps} steps, the default mix): step time "
            f"{slowest[1] / slowest[0]:.3f} of the reference by the model; balancing {balancing_s:.1f} s wall, "
            f"{balancing_cpu:.1f} s CPU for {records} records ({1e3 * balancing_cpu / records:.0f} ms CPU each; "
            f"packing them: {packing_s:.1f} s, a process); disk {tree_bytes(dest) / plain_bytes:.3f} of the "
            "ordinary pack's (its reference trimmed once balanced)")


def read_h200(path: str) -> tuple[list[dict], np.ndarray, np.ndarray] | None:
    """``time_record_cost.py``'s CSV: its rows, their cost terms and their measured full-depth time
    per segment ((n, S), ``cost_fit.segment_times``); None without one."""
    if not path or not os.path.exists(path):
        return None
    rows = read_csv(path)
    if not rows or "vae_ms" not in rows[0]:
        return None
    terms = np.array([[int(r[k]) for k in COST_TERMS] for r in rows], np.int64)
    timed = np.array([[segment_times(r)[s] for s in SEGMENTS] for r in rows])
    return rows, terms, timed


def model_check(path: str, model: CostModel, steps: int, seed: int) -> list[str]:
    """The model against ``time_record_cost.py``'s full-depth estimates: how it ranks them, its
    error per record and per segment, and what step-model balancing by it gives when the step is
    timed by the estimates themselves."""
    h200 = read_h200(path)
    if h200 is None:
        return []
    rows, terms, timed = h200
    measured = timed.sum(axis=1)
    est = model.estimate(terms)
    tokens = terms[:, COST_TERMS.index("tokens")].astype(float)
    rank = lambda a, b=measured: np.argsort(np.argsort(a, kind="stable"), kind="stable")  # noqa: E731
    spearman = lambda a, b=measured: float(np.corrcoef(rank(a), rank(b))[0, 1])  # noqa: E731
    err = np.abs(est / measured - 1)
    scaled = np.abs(est * (measured.mean() / est.mean()) / measured - 1)
    where = os.path.relpath(path, ROOT)
    lines = [f"cost model vs {where} ({len(rows)} records' full-depth estimates): "
             f"Spearman {spearman(est):.3f} (tokens alone {spearman(tokens):.3f}); error median "
             f"{100 * np.median(err):.1f}%, max {100 * err.max():.1f}% (scale-free: median "
             f"{100 * np.median(scaled):.1f}%, max {100 * scaled.max():.1f}%); "
             f"mean estimate {est.mean() / measured.mean():.3f} of measured"]
    seg = model.segments(terms)
    parts = [f"{name} Spearman {spearman(seg[:, k], timed[:, k]):.3f}, mean {seg[:, k].mean():.0f} ms vs "
             f"{timed[:, k].mean():.0f} measured" for k, name in enumerate(SEGMENTS)]
    lines.append("  per segment: " + "; ".join(parts))
    w, m = HEADLINE
    rng = np.random.default_rng([seed, w, m])
    slowest = np.zeros(4)  # reference; balanced by the model, by tokens alone, by the estimates themselves
    for _ in range(steps):
        idx = rng.integers(len(rows), size=w * m)
        c = measured[idx]
        slowest += [rank_loads(c, w, m).max()] + [rank_loads(c, w, m, assign_step(by[idx], w, m)).max()
                                                  for by in (est, tokens, measured)]
    lines.append(f"  step model timed by those estimates, W={w} M={m}, {steps} steps drawn from its records: step "
                 f"time {slowest[1] / slowest[0]:.3f} of the reference balanced by the model (by tokens alone "
                 f"{slowest[2] / slowest[0]:.3f}, by the estimates themselves {slowest[3] / slowest[0]:.3f})")
    return lines


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack", action="append", default=[],
                    help="a pack, a folder of packs or an archive of packs (repeatable); "
                         "none: build make_cost_pack's two")
    ap.add_argument("--out", default=None, help="where packs are built when no --pack (default: a temporary folder)")
    ap.add_argument("--batches", type=int, default=40, help="records per stream of each built pack (default 40)")
    ap.add_argument("--worlds", type=ints, default=[8, 64, 512], help="W values (default 8,64,512)")
    ap.add_argument("--micro", type=ints, default=[1, 4, 8], help="M values (default 1,4,8)")
    ap.add_argument("--steps", type=int, default=100, help="steps simulated per cell (default 100)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the draw (and of built packs; default 0)")
    ap.add_argument("--packed-batches", type=int, default=30,
                    help="records per stream of the packed balanced-samples pack (W=4, K=1; 0: not built; default 30)")
    ap.add_argument("--cost-fit", default=None, help="a time_record_cost.py fit JSON instead of the default model")
    ap.add_argument("--check-csv", default=CHECK_CSV, help="time_record_cost.py CSV to check the model on ('' : none)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if args.steps < 1 or min(args.worlds + args.micro, default=0) < 1:
        ap.error("--steps, --worlds and --micro must be >= 1")
    from machine import machine_line  # a script beside this one (it imports the resize kernel)

    print(machine_line())
    model, model_name = model_of(args.cost_fit)
    with tempfile.TemporaryDirectory(prefix="bench-balance-") as tmp:
        if args.pack:
            dirs = [d for spec in args.pack for d in pack_dirs(spec, tmp)]
        else:
            out = os.path.abspath(args.out or os.path.join(tmp, "packs"))
            os.makedirs(out, exist_ok=True)
            dirs = build_packs(out, args.batches, args.seed)
        t0 = time.perf_counter()
        per_pack = [read_terms(d) for d in dirs]
        read_s = time.perf_counter() - t0
        samples = samples_figure(dirs, model, args)
        packed = packed_samples(os.path.join(tmp, "packed"), args.packed_batches, args.seed) if args.packed_batches else None
    terms = np.concatenate(per_pack)
    if not len(terms):
        raise SystemExit("no records in the packs")
    costs = model.estimate(terms)
    names = ", ".join(f"{os.path.basename(os.path.normpath(d))} ({len(t)})" for d, t in zip(dirs, per_pack))
    print(f"records: {len(terms)} from {len(dirs)} pack(s): {names}; terms read in {read_s:.2f} s")
    print(f"cost model: {model_name}; per record {costs.min():.0f}-{costs.max():.0f} ms (mean {costs.mean():.0f}, "
          f"max/min {costs.max() / max(costs.min(), 1e-12):.2f})")
    for line in model_check(args.check_csv, model, args.steps, args.seed):
        print(line)
    print(f"draw: each step's W x M batches from a source's records with replacement, "
          f"numpy default_rng([seed={args.seed}, W, M]); {args.steps} steps per cell.  lockstep: the reference's "
          f"step time over the mean rank's work, then balanced (assign_lockstep), the bound, and the rank-sum "
          f"assignment, as step time relative to the reference; step: spread (slowest rank sum / mean) of the "
          f"reference, balanced (assign_step) and the ideal, and the balanced step time relative to the reference")
    cells = [(w, m) for w in args.worlds for m in args.micro]
    cells += [HEADLINE] if HEADLINE not in cells else []
    for d, t in zip(dirs, per_pack):  # each mix alone: the figures must hold on both, not only pooled
        if len(t):
            grid(f"{os.path.basename(os.path.normpath(d))} ({len(t)} records), by the model:", model.segments(t),
                 None, cells, args)
    h200 = read_h200(args.check_csv)
    head = None
    if h200 is not None:
        rows, h_terms, timed = h200
        packs = np.array([str(r.get("pack", "")) for r in rows])
        for name in sorted(set(packs)):
            mine = packs == name
            grid(f"{name} ({int(mine.sum())} records), by the H200 per-part timings (assigned by the model):",
                 timed[mine], model.segments(h_terms[mine]), cells, args)
        head = grid(f"both ({len(rows)} records), by the H200 per-part timings (assigned by the model):", timed,
                    model.segments(h_terms), [HEADLINE], args)[HEADLINE]
    else:  # no timings: the headline by the model, pooled, and said so
        print("no H200 timings (--check-csv): the last line is by the model")
        head = grid(f"all ({len(terms)} records), by the model:", model.segments(terms), None, [HEADLINE],
                    args)[HEADLINE]
    if packed:
        print(packed)
    z = "n/a" if samples is None else f"{samples:.3f}"
    print(f"balance: lockstep step time {head.lock_balanced:.3f} of the reference at W={HEADLINE[0]} M={HEADLINE[1]} "
          f"(bound {head.lock_bound:.3f}); step model {head.step_time:.3f}; samples at M=1: {z}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
