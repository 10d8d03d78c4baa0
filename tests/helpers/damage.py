"""Seeded random damage to a pack's files, and a child process that reads a damaged pack.

The parent (a test) mutates a copy of a pack one way at a time and asks a long-lived child
process to read it through the loader (``open_stream``, with and without ``follow``, and
``PackedShardDataset``) and to ``verify`` it.  A child keeps a crash (a signal) or a hang in a
reader from taking the test process down with it, and it is started once, not per mutation.

Run as ``python -m tests.helpers.damage``: one pack path per line on stdin, one JSON line of
results per path on stdout.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from dataclasses import dataclass, field

KINDS = ("pack", "manifest", "done", "index", "ckpt-json", "ckpt-arrow", "shard", "pixels", "lineage")
JSON_KINDS = ("pack", "manifest", "done", "ckpt-json")


def kind_of(rel: str) -> str | None:
    name = rel.rsplit("/", 1)[-1]
    if rel == "pack.json":
        return "pack"
    if rel == "manifest.json":
        return "manifest"
    if name == "done.json":
        return "done"
    if name == "index.arrow":
        return "index"
    if name.startswith("ckpt-"):
        return "ckpt-json" if name.endswith(".json") else "ckpt-arrow"
    if name.startswith("shard-") and name.endswith(".pixels.arrow"):
        return "pixels"
    if name.startswith("shard-") and name.endswith(".arrow"):
        return "shard"
    if name.endswith(".parquet"):
        return "lineage"
    return None


def pack_files(out: str) -> dict[str, list[str]]:
    """Every file of the pack by kind (relative paths, sorted)."""
    files: dict[str, list[str]] = {k: [] for k in KINDS}
    for root, _, names in os.walk(out):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), out).replace(os.sep, "/")
            kind = kind_of(rel)
            if kind is not None:
                files[kind].append(rel)
    return {k: sorted(v) for k, v in files.items() if v}


@dataclass
class Mutation:
    """One damage: the new content of each touched file (None: deleted)."""

    what: str
    new: dict[str, bytes | None] = field(default_factory=dict)

    def apply(self, out: str) -> dict[str, bytes]:
        """Damage ``out``; returns the clean bytes of every touched file (to restore them)."""
        clean = {rel: open(os.path.join(out, rel), "rb").read() for rel in self.new}
        for rel, data in self.new.items():
            path = os.path.join(out, rel)
            if data is None:
                os.remove(path)
            else:
                with open(path, "wb") as f:
                    f.write(data)
        return clean

    def changed(self, clean: dict[str, bytes]) -> bool:
        return any(data != clean[rel] for rel, data in self.new.items())


def restore(out: str, clean: dict[str, bytes]) -> None:
    for rel, data in clean.items():
        with open(os.path.join(out, rel), "wb") as f:
            f.write(data)


def _edit_json_value(data: bytes, rng: random.Random) -> bytes:
    """One leaf value changed, the file's own checksum left as it was (a careless edit)."""
    doc = json.loads(data)
    leaves: list[tuple[list, object]] = []

    def walk(node, path):
        if isinstance(node, dict):
            for k in sorted(node):
                if k != "checksum":
                    walk(node[k], path + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, path + [i])
        else:
            leaves.append((path, node))

    walk(doc, [])
    path, value = leaves[rng.randrange(len(leaves))]
    if isinstance(value, bool):
        new = not value
    elif isinstance(value, (int, float)):
        new = value + rng.choice([1, -1, 1000])
    elif isinstance(value, str):
        new = value + "x" if value else "x"
    else:
        new = 0
    node = doc
    for k in path[:-1]:
        node = node[k]
    if path:
        node[path[-1]] = new
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def random_mutation(files: dict[str, list[str]], out: str, rng: random.Random, kind: str | None = None) -> Mutation:
    """One seeded random damage to one file of ``kind`` (else a random kind; two files for a swap)."""
    kind = rng.choice(sorted(files)) if kind is None else kind
    rel = rng.choice(files[kind])
    data = open(os.path.join(out, rel), "rb").read()
    n = len(data)
    ops = ["flip", "truncate", "zero", "append", "empty", "delete"]
    if len(files[kind]) > 1:
        ops.append("swap")
    if kind in JSON_KINDS:
        ops += ["edit-json", "reformat-json"]
    op = rng.choice(ops)
    if op == "flip":
        i = rng.randrange(n)
        bit = 1 << rng.randrange(8)
        return Mutation(f"{rel}: flip bit {bit:#04x} of byte {i}/{n}", {rel: data[:i] + bytes([data[i] ^ bit]) + data[i + 1:]})
    if op == "truncate":
        k = rng.randrange(n)
        return Mutation(f"{rel}: truncate to {k}/{n}", {rel: data[:k]})
    if op == "zero":
        a = rng.randrange(n)
        b = min(n, a + rng.randint(1, 256))
        return Mutation(f"{rel}: zero bytes {a}..{b}/{n}", {rel: data[:a] + bytes(b - a) + data[b:]})
    if op == "append":
        extra = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        return Mutation(f"{rel}: append {len(extra)} bytes", {rel: data + extra})
    if op == "empty":
        return Mutation(f"{rel}: emptied", {rel: b""})
    if op == "delete":
        return Mutation(f"{rel}: deleted", {rel: None})
    if op == "swap":
        other = rng.choice([f for f in files[kind] if f != rel])
        return Mutation(f"{rel} <-> {other}: swapped", {rel: open(os.path.join(out, other), "rb").read(), other: data})
    if op == "edit-json":
        return Mutation(f"{rel}: a value edited", {rel: _edit_json_value(data, rng)})
    compact = json.dumps(json.loads(data), sort_keys=True).encode()  # same content, other bytes
    return Mutation(f"{rel}: rewritten compactly (same content)", {rel: compact})


# -- the child ------------------------------------------------------------------------------------
def fingerprint(batch) -> str:
    """A digest of everything a batch hands to training (every tensor's dtype, shape and bytes)."""
    import torch

    h = hashlib.blake2b(digest_size=16)

    def feed(v):
        if isinstance(v, torch.Tensor):
            h.update(f"T{v.dtype}{tuple(v.shape)}".encode())
            h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if v.numel() else b"")
        elif isinstance(v, dict):
            for k in sorted(v):
                h.update(f"K{k}".encode())
                feed(v[k])
        elif isinstance(v, (list, tuple)):
            h.update(f"L{len(v)}".encode())
            for x in v:
                feed(x)
        else:
            h.update(f"V{v!r}".encode())

    feed(batch.to_dict())
    return h.hexdigest()


def _outcome(fn) -> dict:
    from schemas.errors import PrepackError

    try:
        return {"batches": [fingerprint(b) for b in fn()]}
    except PrepackError as e:
        return {"error": f"{type(e).__name__}: {e}", "prepack": True}
    except Exception as e:  # noqa: BLE001  (reported to the test, which fails on it)
        return {"error": f"{type(e).__name__}: {e}", "prepack": False}


def read_everything(out: str, streams: int) -> dict:
    """Every reader's outcome on ``out``, and verify's."""
    from loader import PackedShardDataset, open_stream
    from prepack.tools.verify import verify_pack

    res: dict = {}
    for s in range(streams):
        res[f"open_stream {s}"] = _outcome(lambda: open_stream(out, s))
        res[f"open_stream {s} follow"] = _outcome(lambda: open_stream(out, s, follow=True, poll_s=0.05, timeout_s=3))
    res["PackedShardDataset"] = _outcome(lambda: PackedShardDataset(out, rank=0, world_size=1))
    res["PackedShardDataset follow"] = _outcome(
        lambda: PackedShardDataset(out, rank=0, world_size=1, follow=True, poll_s=0.05, timeout_s=3))
    try:
        report = verify_pack(out)
        res["verify"] = {"ok": report.ok, "failures": [f"{r.target}: {r.detail}" for r in report.failures()]}
    except Exception as e:  # noqa: BLE001
        res["verify"] = {"ok": False, "crashed": f"{type(e).__name__}: {e}", "failures": []}
    return res


def main() -> None:
    streams = int(sys.argv[1])
    for line in sys.stdin:
        out = line.strip()
        if out:
            print(json.dumps(read_everything(out, streams)), flush=True)


if __name__ == "__main__":
    main()
