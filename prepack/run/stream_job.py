"""Pack one stream into its shard directory, resumably: the body of one Ray task.

Per shard k the commit order is: shard file (atomic) -> ``shard-k.lineage.parquet`` ->
``ckpt-(k+1)`` (state after the shard's last record) -> ``shard-k.json`` (the commit marker).  A
crash anywhere leaves a committed prefix; ``recover_stream`` removes the rest, and the stream
restarts from the checkpoint of its first uncommitted shard, producing the same bytes.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from prepack.engine.checkpoint import state_from_payload, state_to_payload
from prepack.engine.packer import StreamPacker
from prepack.run.writer import StreamWriter, recover_stream, write_bytes_atomic, write_json_atomic
from schemas.config import PrepackConfig
from schemas.location import resolve_location
from schemas.manifest import StreamEntry, checkpoint_file, done_file, shard_index_file, stream_dir

log = logging.getLogger(__name__)

LINEAGE_SCHEMA = pa.schema([
    ("stream", pa.int32()), ("record", pa.int64()), ("sample", pa.int32()),
    ("group", pa.string()), ("dataset", pa.string()), ("worker_id", pa.int32()),
    ("data_indexes", pa.list_(pa.int64())), ("source_file", pa.string()),
    ("source_row_group", pa.int64()), ("source_row", pa.int64()),
    ("num_tokens", pa.int32()),
])


def lineage_file(stream: int, shard: int) -> str:
    return f"{stream_dir(stream)}/shard-{shard:05d}.lineage.parquet"


@dataclass
class ProgressEvent:
    stream: int
    batches: int
    tokens: int
    done: bool = False
    extra: dict = field(default_factory=dict)


def _lineage_rows(stream: int, first_record: int, batches: list[tuple[list, list[int]]]) -> pa.Table:
    """Lineage of a shard from each batch's (origins, sample lengths)."""
    cols: dict[str, list] = {f.name: [] for f in LINEAGE_SCHEMA}
    for i, (origins, lens) in enumerate(batches):
        for j, (o, n) in enumerate(zip(origins, lens)):
            cols["stream"].append(stream)
            cols["record"].append(first_record + i)
            cols["sample"].append(j)
            cols["group"].append(o.group)
            cols["dataset"].append(o.dataset)
            cols["worker_id"].append(o.worker_id)
            cols["data_indexes"].append(list(o.data_indexes))
            cols["source_file"].append(o.source_file)
            cols["source_row_group"].append(o.source_row_group)
            cols["source_row"].append(o.source_row)
            cols["num_tokens"].append(n)
    return pa.Table.from_pydict(cols, schema=LINEAGE_SCHEMA)


def write_checkpoint(out, stream: int, shard: int, packer: StreamPacker) -> None:
    doc, pixels = state_to_payload(packer.state())
    loc = resolve_location(out)
    write_bytes_atomic(loc, checkpoint_file(stream, shard, "arrow"), pixels)
    write_json_atomic(loc, checkpoint_file(stream, shard, "json"), doc)


def read_checkpoint(out, stream: int, shard: int):
    loc = resolve_location(out)
    doc = json.loads(loc.read_bytes(checkpoint_file(stream, shard, "json")))
    return state_from_payload(doc, loc.read_bytes(checkpoint_file(stream, shard, "arrow")))


def _write_lineage(loc, stream: int, shard: int, table: pa.Table) -> None:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    write_bytes_atomic(loc, lineage_file(stream, shard), sink.getvalue().to_pybytes())


def pack_one_stream(cfg: PrepackConfig, out: str, stream: int, tokenizer, special, metadata: dict[str, str],
                    report: Callable[[ProgressEvent], None] | None = None) -> StreamEntry:
    """Pack (or finish packing) stream ``stream`` into ``out``; returns its manifest entry."""
    cpu_start = time.process_time()  # the whole process (Ray's threads too): what packing costs per core
    loc = resolve_location(out)
    rank, worker = cfg.stream_rank_worker(stream)
    if loc.fs.get_file_info(loc.path(done_file(stream))).type.name == "File":
        return StreamEntry.from_json(json.loads(loc.read_bytes(done_file(stream))))
    loc.fs.create_dir(loc.path(stream_dir(stream)), recursive=True)
    next_shard, next_record, committed = recover_stream(loc, stream)
    if next_shard == 0:
        packer = StreamPacker(cfg, stream, tokenizer, special)
        write_checkpoint(loc, stream, 0, packer)
    else:
        packer = StreamPacker(cfg, stream, tokenizer, special, state=read_checkpoint(loc, stream, next_shard))
        log.info("stream %d: resuming at shard %d (record %d)", stream, next_shard, next_record)
    writer = StreamWriter(loc, stream, shard_bytes=cfg.prepack.shard_bytes, compression=cfg.prepack.compression,
                          metadata=metadata, start_shard=next_shard, start_record=next_record)
    pending: list[tuple[list, list[int]]] = []  # lineage of the open shard (not its pixels)
    start = time.perf_counter()

    def commit(entry) -> None:
        _write_lineage(loc, stream, entry.shard, _lineage_rows(stream, entry.first_record, pending))
        write_checkpoint(loc, stream, entry.shard + 1, packer)
        write_json_atomic(loc, shard_index_file(stream, entry.shard), entry)
        committed.append(entry)
        pending.clear()

    try:
        for batch in packer:
            pending.append((batch.origins, batch.sample_lens.tolist()))
            entry = writer.append(batch)
            if entry is not None:
                commit(entry)
            if report is not None:
                report(ProgressEvent(stream, packer.batches, packer.tokens))
        entry = writer.finish()
        if entry is not None:
            commit(entry)
    except BaseException:
        writer.abort()
        raise
    counters = packer.final_counters()
    result = StreamEntry(
        stream=stream, rank=rank, worker=worker, seed=cfg.stream_seed(stream), shards=committed,
        num_records=sum(len(s.records) for s in committed),
        num_tokens=sum(r.num_tokens for s in committed for r in s.records),
        num_samples=sum(r.num_samples for s in committed for r in s.records),
        drops=counters.drops, warnings=counters.warnings, group_samples=counters.samples_packed,
        elapsed_s=round(time.perf_counter() - start, 3), cpu_s=round(time.process_time() - cpu_start, 3),
    )
    write_json_atomic(loc, done_file(stream), result)
    if report is not None:
        report(ProgressEvent(stream, packer.batches, packer.tokens, done=True))
    return result
