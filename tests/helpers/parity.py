"""The parity assertion: our packer, through the on-disk record and the loader, equals the reference."""

from __future__ import annotations

from loader.batch import SimpleCustomBatch
from prepack.engine.packer import StreamPacker
from schemas.record import batch_to_record, record_to_batch
from tests.helpers import oracle
from tests.helpers.compare import diff_batches


def ours_via_record(batch):
    """The product path: PackedBatch -> Arrow record -> decoded -> loader batch -> to_dict()."""
    return SimpleCustomBatch(record_to_batch(batch_to_record(batch))).to_dict()


def assert_parity(cfg, tok_special, streams, n):
    tok, special = tok_special
    for s in streams:
        ours = []
        for b in StreamPacker(cfg, s, tok, special):
            ours.append(b)
            if len(ours) == n:
                break
        assert len(ours) == n, f"stream {s}: only {len(ours)} batches"
        ref = oracle.reference_batches(cfg, s, tok, n)
        for i, (a, b) in enumerate(zip(ours, ref)):
            diffs = diff_batches(ours_via_record(a), b)
            assert not diffs, f"stream {s} batch {i}: " + "; ".join(diffs[:5])
