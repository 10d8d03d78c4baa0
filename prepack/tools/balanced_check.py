"""Checks of a balanced-samples pack (``prepack: balance: samples``) against its reference.

``verify`` proves the pack's contract step by step: each step's W balanced batches hold exactly
the samples of the reference step (a multiset of per-sample digests: every tensor of a sample,
not where it lies), and a step some stream lacks is the reference's records unchanged.  Once the
reference's shards are trimmed (a finished pack keeps no second copy), by their lineage: which
source row each sample is, and its tokens.
``audit`` re-splits each shard's steps from the reference records and compares record digests:
the balanced records are what the code makes of the reference.  The reference itself
(``OUT/reference``) is an ordinary pack: verify and audit it as one.
"""

from __future__ import annotations

from collections import Counter

from loader.reader import Pack, iter_records
from prepack.engine.step_split import split_batch
from prepack.run.reference_pack import open_reference
from prepack.run.sample_balance import balanced_records
from prepack.tools.report import CheckReport
from schemas.cost import CostModel
from schemas.config import PrepackConfig
from schemas.errors import PrepackError
from schemas.layout import REFERENCE_DIR, stream_lineage_file
from schemas.lineage import read_lineage
from schemas.manifest import ShardEntry
from schemas.streams import step_class, step_classes
from schemas.record import encode_record, record_to_batch


def check_balanced_steps(pack: Pack, rep: CheckReport) -> None:
    """One row per worker class: every step's samples are the reference step's (see module doc)."""
    try:
        reference = open_reference(pack)
    except PrepackError as e:
        rep.add("balanced steps", REFERENCE_DIR, False, f"the reference cannot be read: {e}")
        return
    cfg = pack.info.stored_config()
    for streams in step_classes(cfg.world_size, cfg.num_workers):
        where = f"streams {streams[0]}..{streams[-1]} (every {max(1, cfg.num_workers)})"
        rep.add("balanced steps", where, *_steps_agree(pack, reference, streams))


_SAMPLE = ("group", "dataset", "worker_id", "data_indexes", "source_file", "source_row_group", "source_row",
           "num_tokens")


def _lineage_steps(pack: Pack, streams: list[int]) -> dict[int, Counter]:
    """Per record j (over a continuation's chain), the samples that records j of ``streams`` packed
    (their lineage rows: the pack's own records)."""
    steps: dict[int, Counter] = {}
    for s in streams:
        rows = read_lineage(pack.location.read_bytes(stream_lineage_file(s)))
        cols = [rows.column(c).to_pylist() for c in ("record", *_SAMPLE)]
        n = pack.switch(s)
        for record, *sample in zip(*cols):
            steps.setdefault(n + record, Counter())[tuple(tuple(x) if isinstance(x, list) else x for x in sample)] += 1
    return steps


def _steps_agree_by_lineage(pack: Pack, reference: Pack, streams: list[int]) -> tuple[bool, str]:
    """A reference whose shards were trimmed once balanced: each step's samples by what each is
    (its source row and tokens, from both packs' lineage); its tensors are ``audit``'s to prove,
    packing the reference again from its checkpoints."""
    try:
        ours, theirs = _lineage_steps(pack, streams), _lineage_steps(reference, streams)
    except (OSError, ValueError) as e:
        return False, f"the lineage cannot be read: {e}"
    for j in sorted(set(ours) | set(theirs)):
        if ours.get(j) != theirs.get(j):
            a, b = ours.get(j, Counter()), theirs.get(j, Counter())
            return False, (f"step {j}: {sum((b - a).values())} reference samples missing, "
                           f"{sum((a - b).values())} not in the reference step (by their lineage)")
    return True, (f"{len(ours)} steps: each holds its reference step's samples, by their lineage (the reference's "
                  "shards are trimmed: audit packs them again and compares tensors)")


def _steps_agree(pack: Pack, reference: Pack, streams: list[int]) -> tuple[bool, str]:
    if any(reference.trimmed(s) for s in streams):
        return _steps_agree_by_lineage(pack, reference, streams)
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
                         rep: CheckReport, tokenizer: tuple) -> None:
    """Re-split shard ``shard``'s steps from the reference (its records, or where they were trimmed
    once balanced, packed again from its checkpoints) and compare each record's digest."""
    streams = step_class(shard.stream, cfg.world_size, cfg.num_workers)
    step = balanced_records(reference, streams, CostModel.of(cfg), pack.switch(shard.stream) + shard.first_record,
                            tokenizer)
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
