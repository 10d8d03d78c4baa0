"""Check that ``SimpleCustomBatch.cuda()`` builds exactly the CPU tensors, and time it.

    python scripts/check_cuda_materialize.py [--pack DIR] [--batches 8] [--device cuda:0]

For each batch (from a pack's streams, or synthetic ones made like the tests' fake packs) it
builds the reference tensors on the CPU (``to_dict()``) and on the device (``pin_memory().cuda()``)
and requires every tensor to be bit-identical (same dtype and shape, ``torch.equal``) and every
list equal.  It also reports how many values a naive on-device normalisation (division on the
GPU) would get wrong in the last bit -- the reason the loader gathers from CPU-made tables --
and times ``cuda()`` against moving the CPU-built tensors.  Exits 0 with a message when no CUDA
device is present; 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "helpers")]

import torch  # noqa: E402

from loader import SimpleCustomBatch  # noqa: E402

log = logging.getLogger("check_cuda_materialize")


def packed_batches(args):
    """PackedBatch objects: from a pack when given, else synthetic (tests/fakepack.py)."""
    if args.pack:
        from loader.reader import Pack, iter_records
        from schemas.record import record_to_batch

        pack = Pack.open(args.pack)
        count = 0
        for stream in pack.manifest.streams:
            for _, rec in iter_records(pack, stream.stream):
                yield record_to_batch(rec)
                count += 1
                if count >= args.batches:
                    return
        return
    from fakepack import BatchSpec, make_batch

    for i in range(args.batches):
        spec = BatchSpec(use_flex=bool(i % 2), n_samples=4 + i % 5, max_side=args.max_side, vae_targets=i % 4 != 3)
        yield make_batch(1000 + i, spec)


def compare(cpu, dev, path: str, errors: list[str], device: torch.device) -> None:
    if isinstance(cpu, torch.Tensor):
        if not isinstance(dev, torch.Tensor) or dev.device != device:
            errors.append(f"{path}: not a tensor on {device} ({type(dev).__name__})")
        elif cpu.dtype != dev.dtype or cpu.shape != dev.shape:
            errors.append(f"{path}: {dev.dtype}{tuple(dev.shape)} on device vs {cpu.dtype}{tuple(cpu.shape)} on CPU")
        elif not torch.equal(cpu, dev.cpu()):
            bad = (
                (cpu != dev.cpu()) & ~(cpu.isnan() & dev.cpu().isnan()) if cpu.is_floating_point() else cpu != dev.cpu()
            )
            errors.append(f"{path}: {int(bad.sum())} of {cpu.numel()} values differ")
    elif isinstance(cpu, dict):
        if list(cpu) != list(dev):
            errors.append(f"{path}: keys differ: {list(cpu)} vs {list(dev)}")
        for k in cpu:
            compare(cpu[k], dev.get(k), f"{path}.{k}", errors, device)
    elif isinstance(cpu, (list, tuple)):
        if len(cpu) != len(dev):
            errors.append(f"{path}: length {len(cpu)} vs {len(dev)}")
        for i, (a, b) in enumerate(zip(cpu, dev)):
            compare(a, b, f"{path}[{i}]", errors, device)
    elif cpu != dev:
        errors.append(f"{path}: {cpu!r} vs {dev!r}")


def naive_device_mismatches(pb, device) -> tuple[int, int]:
    """Values a straight on-device ToTensor + Normalize would get wrong vs the CPU reference."""
    from loader.normalize import norm_key, norm_table

    wrong = total = 0
    for i in range(len(pb.image_heights)):
        key = norm_key(pb.image_norm[i])
        hwc = torch.from_numpy(pb.image(i).copy())
        cpu = norm_table(key).view(3, 256)[torch.arange(3)[:, None, None], hwc.permute(2, 0, 1).long()]
        dev = hwc.to(device).permute(2, 0, 1).to(torch.float32).div(255)
        dev.sub_(torch.tensor(key[0], device=device).view(-1, 1, 1)).div_(
            torch.tensor(key[1], device=device).view(-1, 1, 1)
        )
        wrong += int((dev.cpu() != cpu).sum())
        total += cpu.numel()
    return wrong, total


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> tuple[float, object]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def apply(fn, value):
    """``fn`` on every tensor of a to_dict() value (tensors, lists of masks), others unchanged."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        return [fn(v) for v in value]
    return value


def nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", default="", help="read batches from this pack (default: synthetic batches)")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--max-side", type=int, default=40, help="synthetic images: up to this many patches per side")
    ap.add_argument("--device", default="cuda:0", help="'cpu' dry-runs the script's own logic")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log.info("no CUDA device present: nothing to check (run this on a GPU machine)")
        return 0
    torch.zeros(1, device=device)  # context creation outside the timings

    failures = 0
    t_ours = t_ref = 0.0
    bytes_ours = bytes_ref = 0
    wrong = total = 0
    for k, pb in enumerate(packed_batches(args)):
        cpu = SimpleCustomBatch(pb).to_dict()
        batch = SimpleCustomBatch(pb)
        if device.type == "cuda":
            batch.pin_memory()
        bytes_ours += sum(nbytes(x) for x in batch._compact.values())
        dt, on_device = timed(lambda b=batch: b.cuda(device).to_dict(), device)
        t_ours += dt
        errors: list[str] = []
        compare(cpu, on_device, f"batch{k}", errors, device)
        pinned = {n: apply(torch.Tensor.pin_memory, v) for n, v in cpu.items()} if device.type == "cuda" else cpu
        bytes_ref += nbytes(pinned)
        dt, _ = timed(
            lambda p=pinned: {n: apply(lambda t: t.to(device, non_blocking=True), v) for n, v in p.items()}, device
        )
        t_ref += dt
        naive_wrong, naive_total = naive_device_mismatches(pb, device)
        wrong, total = wrong + naive_wrong, total + naive_total
        status = "ok" if not errors else f"{len(errors)} MISMATCHES"
        log.info("batch %d: seq %d, use_flex %s, %d tensors: %s", k, pb.sequence_length, pb.use_flex, len(cpu), status)
        for e in errors[:20]:
            log.error("  %s", e)
        failures += bool(errors)

    log.info("cuda(): %.2f ms total, %.1f MB moved (compact)", t_ours * 1e3, bytes_ours / 1e6)
    log.info("moving CPU-built reference tensors instead: %.2f ms, %.1f MB moved", t_ref * 1e3, bytes_ref / 1e6)
    log.info("naive on-device normalisation: %d of %d pixel values differ from the CPU reference", wrong, total)
    if failures:
        log.error("FAILED: %d batches differ between CPU and device materialisation", failures)
        return 1
    log.info("PASSED: device materialisation is bit-identical to the CPU path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
