"""Checks shared by the object-store tests, written against public behaviour only (what the loader
hands training, and the set of objects a pack consists of), so they hold whatever the pack's
file layout is."""

from __future__ import annotations

import hashlib
import json
import os

import torch

from schemas.manifest import INFORMATIONAL_FIELDS


def batch_fingerprint(batch) -> str:
    """SHA-256 of everything training sees of one batch (``to_dict()``: tensors with dtype and
    shape, lists exactly)."""
    h = hashlib.sha256()
    for key, value in sorted(batch.to_dict().items()):
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            t = value.contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(json.dumps(value, sort_keys=True, default=str).encode())
    return h.hexdigest()


def stream_fingerprints(out: str, num_streams: int) -> dict[int, list[str]]:
    """Every stream of ``out`` read through ``open_stream`` (record digests verified on the way)."""
    from loader import open_stream

    return {s: [batch_fingerprint(b) for b in open_stream(out, stream=s)] for s in range(num_streams)}


def local_files(root: str) -> dict[str, bytes]:
    """Every file under ``root`` (path relative to it, ``/``-separated -> bytes)."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root).replace(os.sep, "/")] = f.read()
    return out


def pack_bytes(root: str) -> dict[str, bytes]:
    """``local_files`` without the files that say how a run went rather than what it packed
    (done.json, manifest.json: times and reuse counts): two runs of one pack compare equal."""
    return {k: v for k, v in local_files(root).items() if k.rsplit("/", 1)[-1] not in ("done.json", "manifest.json")}


def _untimed(value):
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k not in (*INFORMATIONAL_FIELDS, "checksum")}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def same_pack_objects(a: dict[str, bytes], b: dict[str, bytes]) -> list[str]:
    """Names whose content differs between two packs' object sets (all names must match); JSON
    objects are compared without their timings (``elapsed_s``, ``cpu_s``, and so their own checksum)."""
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))
    differ = []
    for k in a:
        if a[k] == b[k]:
            continue
        if k.endswith(".json") and _untimed(json.loads(a[k])) == _untimed(json.loads(b[k])):
            continue
        differ.append(k)
    return differ


def secret_leaks(secret: str, objects: dict[str, bytes] = {}, texts: dict[str, str] = {},  # noqa: B006
                 dirs: tuple[str, ...] = ()) -> list[str]:
    """Where ``secret`` appears: object names, captured texts, or any file under ``dirs``."""
    needle = secret.encode()
    found = [f"object {k}" for k, v in objects.items() if needle in v or secret in k]
    found += [f"text {k}" for k, v in texts.items() if secret in v]
    for d in dirs:
        for dirpath, _, names in os.walk(d):
            for n in names:
                p = os.path.join(dirpath, n)
                try:
                    with open(p, "rb") as f:
                        if needle in f.read():
                            found.append(f"file {p}")
                except OSError:
                    pass
    return found
