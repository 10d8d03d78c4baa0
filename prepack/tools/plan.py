"""``prepack plan``: what a pack will cost before it runs, from a small sample of its streams.

A few batches of a few streams are packed in this process exactly as ``prepack run`` packs them
(same sources, packer and record encoder) and sized as the writer would write them, into
nothing: records go to a byte-counting sink, so no output is written.  From the sample and the
config's budget it projects the whole run: records, tokens, output bytes (shards, checkpoints,
lineage), shards per stream, CPU core-hours and wall time on N cores, each group's token share,
drop rate and passes over its data, and what the sampled batches hold (text, ViT, VAE and
loss-bearing tokens, images and flex padding per batch and per sample of each group:
``prepack.tools.composition``); and it warns about knobs that look wrong.

What it cannot know: the sample is the streams' first batches (later ones may differ a little),
CPU time is this machine's, and a ``tokens_per_stream`` or ``passes`` budget is converted into
batches at the sampled rates.  ``docs/architecture.md`` and the README say how close it came.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Mapping

import pyarrow as pa

from prepack.engine.accounting import Drop, parse_key
from prepack.engine.state_codec import state_to_payload
from prepack.engine.packer import PackerOptions
from prepack.engine.packers import open_packer
from prepack.engine.reuse.earlier_packs import check_old_packs
from prepack.engine.reuse.earlier_pixels import PixelReuse
from prepack.run.bounded.ahead import PACK_FILES_RESERVE, SHARD_FILES_SLACK, shard_most
from prepack.run.chain import Continue, check_continuation, open_parent, switch_at, switch_points
from prepack.run.commit.lineage import lineage_table, parquet_bytes
from prepack.tools.composition import Composition, packed_batch_counts
from schemas.cost import terms_of
from prepack.tools.plan_report import GroupPlan, PackPlan, size_text
from prepack.tools.plan_tokenizer import load_plan_tokenizer
from schemas.compression import Compression
from schemas.config import PrepackConfig
from schemas.errors import PackRefused, StreamFailed
from schemas.location import redact_uri
from schemas.mix_change import group_matches
from schemas.record import RECORD_SCHEMA, encode_record

log = logging.getLogger(__name__)

MIB = 1 << 20
GOOD_SHARD_MIN, GOOD_SHARD_MAX = 64 * MIB, 2048 * MIB  # "a few hundred MB", give or take
SMALL_FILES_BYTES = 4096  # per stream: index.arrow, done.json (measured ~1-3 KB)
MAX_SAMPLE_FRACTION = 0.25  # of the pack's batches, at most (a small pack is sampled less)
SETTLED_TOLERANCE = 0.05  # stop sampling a stream once a batch moves the bytes-per-batch mean less than this


@dataclass
class _Sample:
    """What the sampled batches measured (summed over the sampled streams)."""

    batches: int = 0
    tokens: int = 0
    record_bytes: int = 0  # IPC bytes of the records as the writer frames them
    shard_overhead: int = 0  # IPC file header + footer of one shard
    lineage_bytes: int = 0
    lineage_rows: int = 0
    checkpoint_bytes: int = 0  # one checkpoint (json + arrow), the mean over streams
    cpu_s: float = 0.0  # CPU of the batches after each stream's first
    steady_batches: int = 0
    startup_cpu_s: float = 0.0  # per stream: sources opened + first batch
    group_tokens: dict = field(default_factory=dict)
    samples_read: dict = field(default_factory=dict)
    source_drops: dict = field(default_factory=dict)
    packer_drops: int = 0
    rows_per_pass: dict = field(default_factory=dict)
    streams: list = field(default_factory=list)
    batch_bytes: list = field(default_factory=list)  # each sampled record's buffer bytes: when to stop sampling
    composition: Composition = field(default_factory=Composition)  # tokens of each kind per sampled batch
    terms: list = field(default_factory=list)  # each sampled batch's compute terms (schemas.cost), for the step spread
    switch_at: dict = field(default_factory=dict)  # a continuation: group -> passes read at the switch, per stream


def _ipc_sizes(records: list[pa.RecordBatch], compression: Compression) -> tuple[int, int]:
    """(bytes of the records, bytes of an empty shard's framing) as an Arrow IPC file, into nothing."""
    def framed(batch_list) -> int:
        sink = pa.MockOutputStream()
        with pa.ipc.new_file(sink, RECORD_SCHEMA, options=compression.write_options()) as w:
            for r in batch_list:
                w.write_batch(r)
        return sink.size()

    empty = framed([])
    return framed(records) - empty, empty


@dataclass
class _Sampling:
    """What every sampled stream of one plan shares: the config, the tokenizer, the deadline, the
    pixels of ``--reuse`` packs, and a continuation's parent with its switch points."""

    cfg: PrepackConfig
    tokens: tuple  # (tokenizer, special)
    deadline: float
    pixels: object = None  # PixelReuse
    parent: object = None  # loader.reader.Pack of a continuation
    after: "list[int] | None" = None


def _sample_stream(how: _Sampling, stream: int, least: int, most: int, acc: _Sample) -> None:
    """Pack ``least`` to ``most`` batches of ``stream`` into ``acc`` (fewer once settled or past the
    deadline); a continuation's stream starts where it would (``prepack.run.chain.switch_at``)."""
    cfg, (tokenizer, special), deadline = how.cfg, how.tokens, how.deadline
    compression = Compression.parse(cfg.prepack.compression)
    cpu0 = time.process_time()
    records, lineage, stamps = [], [], []
    switch = None if how.parent is None else switch_at(how.parent, stream, how.after[stream], tokenizer, special)
    options = PackerOptions(reuse_pixel_table=True, pixels=how.pixels)
    with open_packer(cfg, stream, tokenizer, special, switch, options) as packer:
        if switch is not None:
            for group, source, at in zip(cfg.groups, packer.sources, group_matches(switch.config, cfg)):
                where = None
                if at is not None:
                    st = switch.state.sources[at]
                    where = st["passes"] + st["yields_this_pass"] / max(source.pass_rows(), 1)
                acc.switch_at.setdefault(group.name, []).append(where)
        for batch in packer:
            record = encode_record(batch, compression).record
            records.append(record)
            lineage.append((batch.origins, batch.sample_lens.tolist()))
            acc.tokens += int(batch.sequence_length)
            for o, n in zip(batch.origins, batch.sample_lens.tolist()):
                acc.group_tokens[o.group] = acc.group_tokens.get(o.group, 0) + int(n)
            stamps.append(time.process_time())
            acc.batch_bytes.append(record.nbytes)
            acc.composition.add(packed_batch_counts(batch))
            acc.terms.append([int(x) for x in terms_of(batch)])
            if len(records) >= most:
                break
            if len(records) >= least and (time.monotonic() > deadline or estimate_settled(acc.batch_bytes)):
                break
        if not records:
            return
        doc, pixels = state_to_payload(packer.state())
        acc.checkpoint_bytes = max(acc.checkpoint_bytes, len(doc.to_json().encode()) + len(pixels))
        counters = packer.counters
        for g, n in counters.samples_read.items():
            acc.samples_read[g] = acc.samples_read.get(g, 0) + n
        source_drops, packer_drops = lost_samples(counters.drops)
        for group, n in source_drops.items():
            acc.source_drops[group] = acc.source_drops.get(group, 0) + n
        acc.packer_drops += packer_drops
        for group, source in zip(cfg.groups, packer.sources):
            acc.rows_per_pass.setdefault(group.name, source.pass_rows())
    record_bytes, overhead = _ipc_sizes(records, compression)
    acc.record_bytes += record_bytes
    acc.shard_overhead = overhead
    table = lineage_table(stream, 0, lineage)
    acc.lineage_bytes += len(parquet_bytes(table))
    acc.lineage_rows += table.num_rows
    acc.batches += len(records)
    acc.startup_cpu_s += stamps[0] - cpu0
    if len(stamps) > 1:
        acc.cpu_s += stamps[-1] - stamps[0]
        acc.steady_batches += len(stamps) - 1
    acc.streams.append(stream)


def lost_samples(drops: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """(rows each group's source dropped, samples the packer lost) from a stream's drop counts.

    Not lost: samples still buffered when the sample's budget ran out (a longer stream packs
    them), and refused batches themselves (counted in batches; their samples are counted again,
    as samples, under their own reason)."""
    by_group: dict[str, int] = {}
    packer = 0
    for key, n in drops.items():
        group, reason = parse_key(key)
        if group is not None:
            by_group[group] = by_group.get(group, 0) + n
        elif reason is not Drop.LEFT_IN_BUFFER_AT_END_OF_BUDGET and (reason is None or reason.counts == "samples"):
            packer += n
    return by_group, packer


def sample_streams(num_streams: int, count: int) -> list[int]:
    """``count`` streams spread over ``0..num_streams-1`` (first and last included)."""
    if count <= 1 or num_streams == 1:
        return [0]
    count = min(count, num_streams)
    return sorted({round(i * (num_streams - 1) / (count - 1)) for i in range(count)})


def batch_allotment(num_sampled: int, sample_batches: int, batches_per_stream: int | None, num_streams: int,
                    max_fraction: float = MAX_SAMPLE_FRACTION) -> list[tuple[int, int]]:
    """``(least, most)`` batches to pack of each sampled stream.

    Each stream packs up to ``sample_batches`` (never more than its budget); together they take at
    most ``max_fraction`` of the pack's batches when the budget is in batches, except that the first
    sampled stream always packs two (one after its start, to measure steady CPU) and every other one
    at least one.  Between ``least`` and ``most`` a stream stops once the estimate has settled.
    """
    most = max(1, sample_batches if batches_per_stream is None else min(sample_batches, batches_per_stream))
    least = [min(most, 2)] + [1] * (num_sampled - 1)
    if batches_per_stream is None:
        return [(n, most) for n in least]
    room = max(sum(least), math.floor(max_fraction * batches_per_stream * num_streams)) - sum(least)
    extra = [0] * num_sampled
    while room > 0 and any(n + e < most for n, e in zip(least, extra)):  # round-robin, first streams first
        for i in range(num_sampled):
            if room and least[i] + extra[i] < most:
                extra[i] += 1
                room -= 1
    return [(n, n + e) for n, e in zip(least, extra)]


def estimate_settled(record_bytes: list[int], tolerance: float = SETTLED_TOLERANCE) -> bool:
    """Whether the mean bytes per batch moved by less than ``tolerance`` with the last batch."""
    if len(record_bytes) < 2:
        return False
    now = sum(record_bytes) / len(record_bytes)
    before = sum(record_bytes[:-1]) / (len(record_bytes) - 1)
    return abs(now - before) <= tolerance * now


@dataclass(frozen=True)
class PlanOptions:
    """How ``plan_pack`` samples, and what run it plans.

    Up to ``sample_batches`` batches of ``sample_streams_n`` streams, for at most ``max_seconds``
    (see :func:`batch_allotment` for the counts; ``max_fraction`` of a batch budget at most),
    projected onto ``cores`` (default: this machine's).  ``reuse``: earlier packs the run would take
    pixels from (``prepack run --reuse``): the sample takes them too, so CPU is projected with them,
    and the plan says how many it found.  ``continue_from``: a ``prepack.run.chain.Continue``: the
    sampled streams start where the continuation would (OLD's state at the switch, its records there
    already packed).  ``bounded``: ``{"ahead": N, "keep_checkpoints": K, "checkpoint_every": C}`` of a
    bounded run (``prepack run --ahead``): the plan adds its disk high-water mark
    (``bounded_peak_bytes``)."""

    cores: "int | None" = None
    sample_batches: int = 4
    sample_streams_n: int = 2
    max_seconds: float = 60.0
    max_fraction: float = MAX_SAMPLE_FRACTION
    reuse: "tuple[str, ...] | list[str]" = ()
    continue_from: "Continue | None" = None
    bounded: "dict | None" = None


def plan_pack(cfg: PrepackConfig, options: PlanOptions = PlanOptions(), tokenizer=None) -> PackPlan:
    """Sample a few batches of a few streams (``PlanOptions``) and project the whole run.

    A stream stops early once it has packed its least batches and the estimate of bytes per batch
    (over everything sampled so far) has settled.  Past ``max_seconds`` the stream being sampled
    stops after its least batches and the streams not begun yet are skipped.  ``tokenizer`` (with its
    special ids) skips the load.
    """
    o = options
    start = time.monotonic()
    loaded = tokenizer is None
    tokens = tokenizer or load_plan_tokenizer(cfg.tokenizer)
    # every packing worker loads its tokenizer once (through transformers: a few seconds more than
    # the light load of qwen2-offline measured here; negligible against a run of hours)
    worker_start_s = time.monotonic() - start if loaded else 0.0
    p = cfg.prepack
    acc = _Sample()
    how = _Sampling(cfg, tokens, start + o.max_seconds)
    streams = sample_streams(cfg.num_streams, o.sample_streams_n)
    allot = batch_allotment(len(streams), o.sample_batches, p.batches_per_stream, cfg.num_streams, o.max_fraction)
    reuse = tuple(o.reuse)
    if o.continue_from is not None:
        how.parent = open_parent(o.continue_from.uri)
        check_continuation(how.parent, cfg, o.continue_from.uri)
        how.after = switch_points(how.parent, o.continue_from)
        for s in streams:
            if how.parent.num_records(s) < how.after[s]:
                raise PackRefused(f"plan: stream {s} of {o.continue_from.uri} has {how.parent.num_records(s)} "
                                  f"records, fewer than the {how.after[s]} the continuation takes from it")
        reuse = reuse + (o.continue_from.uri,)
    how.pixels = _reuse_provider(reuse, Compression.parse(p.compression))
    try:
        for s, (least, most) in zip(streams, allot):
            if acc.batches and time.monotonic() > how.deadline:
                log.info("plan: %.0f s of sampling reached; streams from %d on not sampled", o.max_seconds, s)
                break
            _sample_stream(how, s, least, most, acc)
    finally:
        if how.pixels is not None:
            how.pixels.close()
    if not acc.batches:
        raise StreamFailed("plan: the sampled streams produced no batch (see the drop counts in the log)")
    plan = _project(cfg, acc, o.cores or os.cpu_count() or 1, (time.monotonic() - start, worker_start_s), o.bounded)
    if how.parent is not None:
        plan.continues = {
            "from": redact_uri(o.continue_from.uri),
            "after": o.continue_from.after if o.continue_from.after is not None else "a loader state",
            "groups": {g: (None if None in v else sum(v) / len(v)) for g, v in acc.switch_at.items()}}
    if how.pixels is not None:
        counts = how.pixels.counts.to_json()
        plan.reuse = {"from": [redact_uri(r) for r in reuse], "images": counts["images"], "reused": counts["reused"],
                      "fallbacks": counts["fallbacks"]}
    return plan


def _reuse_provider(reuse: "tuple[str, ...] | list[str]", compression: Compression):
    """A stream's view of the ``reuse`` packs, each checked first (a wrong one is one line); frames
    are handed over as a run's writer would take them."""
    if not reuse:
        return None
    return PixelReuse(check_old_packs(reuse), frame_format=compression.frame_format)


def _project(cfg: PrepackConfig, acc: _Sample, cores: int, times: "tuple[float, float]",
             bounded: "dict | None" = None) -> PackPlan:
    """``times``: the sampling's seconds and a packing worker's start-up seconds."""
    seconds, worker_start_s = times
    p, k = cfg.prepack, cfg.knobs
    n_streams = cfg.num_streams
    per_batch_tokens = acc.tokens / acc.batches
    record_bytes = acc.record_bytes / acc.batches
    n_sampled = len(acc.streams)
    rows = {g.name: acc.samples_read.get(g.name, 0) + acc.source_drops.get(g.name, 0) for g in cfg.groups}
    rows_per_batch = {g: r / acc.batches for g, r in rows.items()}
    warnings: list[str] = []
    if p.batches_per_stream is not None:
        batches = float(p.batches_per_stream)
    elif p.tokens_per_stream is not None:
        batches = float(math.ceil(p.tokens_per_stream / per_batch_tokens))
    else:
        need = []
        for g in cfg.groups:
            per_pass = acc.rows_per_pass.get(g.name, 0)
            if rows_per_batch[g.name] > 0:
                need.append(p.passes * per_pass / rows_per_batch[g.name])
            else:
                warnings.append(f"group {g.name}: not drawn in the sample; passes: {p.passes} cannot be projected "
                                "for it (it may take very long)")
        batches = float(math.ceil(max(need))) if need else float(acc.batches / n_sampled)
    batches = max(1.0, batches)
    records_per_stream = int(round(batches))
    records_per_shard = max(1, math.ceil((p.shard_bytes - acc.shard_overhead) / record_bytes))
    shards = max(1, math.ceil(records_per_stream / records_per_shard))
    shard_bytes = acc.shard_overhead + min(records_per_shard, records_per_stream) * record_bytes
    lineage_per_record = acc.lineage_bytes / acc.batches
    stream_bytes = (records_per_stream * (record_bytes + lineage_per_record) + shards * acc.shard_overhead
                    + (shards + 1) * acc.checkpoint_bytes + SMALL_FILES_BYTES)
    cpu_per_batch = acc.cpu_s / acc.steady_batches if acc.steady_batches else acc.startup_cpu_s / n_sampled
    startup = acc.startup_cpu_s / n_sampled - (cpu_per_batch if acc.steady_batches else 0.0)
    stream_cpu = max(0.0, startup) + records_per_stream * cpu_per_batch
    waves = math.ceil(n_streams / cores)
    groups = []
    total_tokens = sum(acc.group_tokens.values()) or 1
    for g in cfg.groups:
        read = acc.samples_read.get(g.name, 0)
        dropped = acc.source_drops.get(g.name, 0)
        per_pass = acc.rows_per_pass.get(g.name, 0)
        passes = batches * rows_per_batch[g.name] / per_pass if per_pass else 0.0
        groups.append(GroupPlan(g.name, acc.group_tokens.get(g.name, 0) / total_tokens,
                                dropped / (read + dropped) if read + dropped else 0.0,
                                rows_per_batch[g.name], per_pass, passes))
    samples_read = sum(acc.samples_read.values())
    packer_drop_rate = acc.packer_drops / samples_read if samples_read else 0.0
    fill = per_batch_tokens / k.max_num_tokens
    plan = PackPlan(
        config=cfg.config_path or "(config)", streams=n_streams, cores=cores, budget=p.budget(),
        batches_per_stream=batches, records=records_per_stream * n_streams,
        tokens=int(round(batches * per_batch_tokens)) * n_streams, output_bytes=int(stream_bytes * n_streams),
        shards_per_stream=shards, shard_bytes=int(shard_bytes), record_bytes=record_bytes,
        cpu_core_hours=stream_cpu * n_streams / 3600, wall_hours=(worker_start_s + waves * stream_cpu) / 3600, groups=groups,
        packer_drop_rate=packer_drop_rate, fill=fill, warnings=warnings, composition=acc.composition,
        batch_terms=list(acc.terms),
        sample={"streams": acc.streams, "batches": acc.batches, "seconds": round(seconds, 2),
                "cpu_s_per_batch": round(cpu_per_batch, 4)},
    )
    plan.warnings += _knob_warnings(cfg, plan, records_per_shard)
    if bounded:
        plan.bounded = dict(bounded, checkpoint_bytes=acc.checkpoint_bytes,
                            reserve_bytes=shard_most(cfg) + SHARD_FILES_SLACK, pack_files_bytes=PACK_FILES_RESERVE,
                            peak_bytes=bounded_peak_bytes(
            plan, (records_per_stream, records_per_shard), max(cfg.num_workers, 1), acc.checkpoint_bytes, bounded))
    return plan


def bounded_peak_bytes(plan: PackPlan, records: tuple[int, int], workers: int, checkpoint_bytes: int,
                       bounded: dict) -> int:
    """The most a bounded run (``bounded``: ``ahead``, ``keep_checkpoints``, ``checkpoint_every``) holds
    on disk at once: every stream's records from the earliest kept checkpoint (K checkpoints of C
    training steps, a stream advancing once per ``workers`` steps) to ``ahead`` past the reader, plus
    the shard being finished past that and the shard the trim bound falls inside, with those shards'
    checkpoints; behind them the checkpoint ladder (``prepack.run.bounded.checkpoint_ladder``: about
    two per doubling of the distance) and every shard's indexes, sources and lineage, never trimmed.
    ``records``: (per stream, per shard)."""
    records_per_stream, records_per_shard = records
    ahead, keep, every = bounded["ahead"], bounded["keep_checkpoints"], bounded["checkpoint_every"]
    held = min(ahead + keep * math.ceil(every / workers) + 2 * records_per_shard, records_per_stream)
    shards = max(1, math.ceil(records_per_stream / records_per_shard))
    ckpts = min(shards + 1, math.ceil(held / records_per_shard) + 2 * shards.bit_length() + 2)
    everything = (plan.record_bytes * records_per_stream + (shards + 1) * checkpoint_bytes) * plan.streams
    return int(plan.output_bytes - everything + (plan.record_bytes * held + ckpts * checkpoint_bytes) * plan.streams)


def _knob_warnings(cfg: PrepackConfig, plan: PackPlan, records_per_shard: int) -> list[str]:
    p, k = cfg.prepack, cfg.knobs
    out = []
    if records_per_shard == 1 and plan.shards_per_stream > 1:
        out.append(f"shard_bytes={p.shard_bytes:,} is smaller than one record (~{size_text(plan.record_bytes)}): "
                   "every record becomes a shard with its own checkpoint; use a few hundred MB")
    elif plan.shards_per_stream > 1 and not GOOD_SHARD_MIN <= plan.shard_bytes <= GOOD_SHARD_MAX:
        out.append(f"shards of ~{size_text(plan.shard_bytes)} (shard_bytes={p.shard_bytes:,}): far from a few hundred MB "
                   f"({plan.shards_per_stream:,} per stream, each with a checkpoint); 268435456 is the default")
    elif p.shard_bytes > GOOD_SHARD_MAX:
        out.append(f"shard_bytes={p.shard_bytes:,} is over {size_text(GOOD_SHARD_MAX)}: a killed run redoes up to a "
                   "whole shard per stream, and audits re-pack whole shards")
    for g in plan.groups:
        if g.passes > 1.0 and p.passes is None:
            out.append(f"group {g.name}: the budget runs it past its data — each stream reads its slice "
                       f"{g.passes:.1f} times (the same rows in the same order; the reference repeats them too)")
        if g.drop_rate > 0.05:
            out.append(f"group {g.name}: {g.drop_rate:.0%} of its rows are dropped (see `prepack run`'s drop "
                       "counts; a wrong data_dir or damaged files?)")
    if plan.packer_drop_rate > 0.05:
        out.append(f"{plan.packer_drop_rate:.0%} of samples are discarded by the packer (over-long or no room): "
                   f"check max_num_tokens_per_sample={k.max_num_tokens_per_sample:,}, "
                   f"prefer_buffer_before={k.prefer_buffer_before:,} and max_buffer_size={k.max_buffer_size}")
    if k.prefer_buffer_before > k.max_num_tokens:
        out.append(f"prefer_buffer_before={k.prefer_buffer_before:,} exceeds max_num_tokens={k.max_num_tokens:,}: "
                   "a buffered sample is taken back out and discarded when it does not fit")
    if plan.fill < 0.7:
        out.append(f"batches fill {plan.fill:.0%} of max_num_tokens={k.max_num_tokens:,} "
                   f"(expected_num_tokens={k.expected_num_tokens:,})")
    if plan.streams < plan.cores:
        out.append(f"{plan.streams} streams on {plan.cores} cores: {plan.cores - plan.streams} cores stay idle "
                   "(streams = world_size x num_workers; one core packs one stream)")
    return out
