"""Checks of a balanced-samples pack (``prepack: balance: samples``) against its reference.

``verify`` proves the pack's contract step by step: each step's W balanced batches hold exactly
the samples of the reference step (a multiset of per-sample digests: every tensor of a sample,
not where it lies), and a step some stream lacks is the reference's records unchanged.
``audit`` re-splits each shard's steps from the reference records and compares record digests:
the balanced records are what the code makes of the reference.  The reference itself
(``OUT/reference``) is an ordinary pack: verify and audit it as one.
"""

from __future__ import annotations

from collections import Counter

from loader.reader import Pack, iter_records
from prepack.engine.step_split import split_batch
from prepack.run.sample_balance import balanced_records, step_streams
from prepack.tools.report import CheckReport
from schemas.cost import CostModel
from schemas.config import PrepackConfig
from schemas.errors import PrepackError
from schemas.layout import REFERENCE_DIR
from schemas.location import PackLocation
from schemas.manifest import ShardEntry
from schemas.record import encode_record, record_to_batch


def balances_samples(pack: Pack) -> bool:
    return pack.info.stored_config().prepack.balance == "samples"


def open_reference(pack: Pack) -> Pack:
    """The reference pack inside a balanced-samples pack."""
    loc = pack.location
    return Pack.open(PackLocation(loc.fs, loc.path(REFERENCE_DIR)))


def check_balanced_steps(pack: Pack, rep: CheckReport) -> None:
    """One row per worker class: every step's samples are the reference step's (see module doc)."""
    try:
        reference = open_reference(pack)
    except PrepackError as e:
        rep.add("balanced steps", REFERENCE_DIR, False, f"the reference cannot be read: {e}")
        return
    cfg = pack.info.stored_config()
    for streams in step_streams(cfg):
        where = f"streams {streams[0]}..{streams[-1]} (every {max(1, cfg.num_workers)})"
        rep.add("balanced steps", where, *_steps_agree(pack, reference, streams))


def _steps_agree(pack: Pack, reference: Pack, streams: list[int]) -> tuple[bool, str]:
    n = {s: pack.num_records(s) for s in streams}
    ref_n = {s: reference.num_records(s) for s in streams}
    if any(n[s] > ref_n[s] for s in streams):
        s = next(s for s in streams if n[s] > ref_n[s])
        return False, f"stream {s} holds {n[s]} records, its reference {ref_n[s]}"
    ours = {s: iter_records(pack, s) for s in streams}
    theirs = {s: iter_records(reference, s) for s in streams}
    full = min(ref_n.values())
    steps = 0
    for j in range(max(n.values(), default=0)):
        live = [s for s in streams if j < n[s]]
        if j < full and len(live) < len(streams):
            break  # a pack still being written: the rest of the step is not there yet
        a, b = Counter(), Counter()
        for s in live:
            a.update(x.digest() for x in split_batch(record_to_batch(next(ours[s])[1])))
            b.update(x.digest() for x in split_batch(record_to_batch(next(theirs[s])[1])))
        if a != b:
            gone, new = sum((b - a).values()), sum((a - b).values())
            return False, f"step {j}: {gone} reference samples missing, {new} not in the reference step"
        steps += 1
    return True, f"{steps} steps: each holds its reference step's samples, tensor for tensor"


def audit_balanced_shard(pack: Pack, reference: Pack, cfg: PrepackConfig, shard: ShardEntry,
                         rep: CheckReport) -> None:
    """Re-split shard ``shard``'s steps from the reference and compare each record's digest."""
    streams = next(c for c in step_streams(cfg) if shard.stream in c)
    step = balanced_records(reference, streams, CostModel.of(cfg), shard.first_record)
    bad = []
    for i, entry in enumerate(shard.records):
        got = step()
        if got is None or shard.stream not in got[1]:
            bad.append(i)
            break
        if encode_record(got[1][shard.stream]).digest != entry.digest:
            bad.append(i)
    ok = not bad
    rep.add("re-split", shard.file, ok, f"{len(shard.records)} records identical to their steps re-split from "
            "the reference" if ok else f"record {shard.first_record + bad[0]} differs from its step re-split "
            f"from the reference ({len(bad)} of {len(shard.records)})")
