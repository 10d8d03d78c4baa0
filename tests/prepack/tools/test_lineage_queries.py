"""The lineage scan over a pack whose stream is being extended: its compacted file and its new shards."""

from __future__ import annotations

import os

import pytest

from loader.reader import Pack
from prepack.run.stream_job import StreamJob, pack_one_stream
from prepack.tools.lineage_queries import scan_lineage
from schemas.layout import shard_lineage_file, stream_lineage_file
from tests.helpers.packs import make_dataset, pack_in_process, small_config


class _Kill(Exception):
    pass


def test_an_extended_stream_still_packing_has_every_committed_row(tmp_path, tokenizer_and_special):
    """A finished stream (its lineage compacted into lineage/stream-S.parquet) extended to a larger
    budget and stopped mid-way holds new shards whose rows are still in shard lineage files: the scan
    reads both, each committed record's rows once."""
    data = make_dataset(str(tmp_path / "d"))
    out = str(tmp_path / "out")
    first = small_config(data, shard_bytes=1, batches_per_stream=2)  # a shard per record
    pack_in_process(first.config_path, out, tokenizer_and_special)
    assert os.path.exists(os.path.join(out, stream_lineage_file(0)))
    bigger = small_config(data, shard_bytes=1, batches_per_stream=6)
    tok, special = tokenizer_and_special

    def report(progress):
        if progress.batches == 4:
            raise _Kill()

    with pytest.raises(_Kill):
        pack_one_stream(StreamJob(bigger, out, Pack.open(out).info.shard_metadata()), 0, tok, special, report)
    index = Pack.open(out).index(0)
    assert len(index.shards) == 4 and os.path.exists(os.path.join(out, shard_lineage_file(0, 3)))
    rows = scan_lineage(out).filter(stream=0).select("record").collect()["record"].to_list()
    want = [sh.first_record + i for sh in index.shards for i, r in enumerate(sh.records) for _ in range(r.num_samples)]
    assert sorted(rows) == want
