"""Budgets: every budget stops a stream at a batch boundary, and the result is a prefix of the
reference's endless stream (the same batches as a longer budget)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import datagen as dg
from prepack.engine.packer import PackerOptions, StreamPacker
from schemas.config_file import load_config
from schemas.record import batch_to_record, record_digest

KNOBS = dict(expected_num_tokens=1500, max_num_tokens=2000, max_num_tokens_per_sample=1500,
             prefer_buffer_before=1000, max_buffer_size=4, use_flex=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rs = np.random.RandomState(5)
    ds = dg.Dataset(str(tmp_path_factory.mktemp("budget")))
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 4, 4 * i) for i in range(2)])
    lines, files = dg.good_sft(rs, 10)
    dg.add_sft(ds, lines, files)
    return ds


def digests(ds, tokenizer_and_special, **prepack):
    cfg = load_config(ds.config(knobs=KNOBS, prepack=prepack))
    p = StreamPacker(cfg, 0, *tokenizer_and_special)
    batches = list(p)
    return [record_digest(batch_to_record(b)) for b in batches], batches, p


def test_tokens_budget_stops_at_the_first_batch_past_it(data, tokenizer_and_special):
    long, _, _ = digests(data, tokenizer_and_special, batches_per_stream=30)
    short, batches, _ = digests(data, tokenizer_and_special, tokens_per_stream=20_000, batches_per_stream=None)
    total = sum(b.sequence_length for b in batches)
    assert total >= 20_000 and total - batches[-1].sequence_length < 20_000
    assert short == long[: len(short)]


def test_passes_budget_covers_every_group_at_least_once(data, tokenizer_and_special):
    long, _, _ = digests(data, tokenizer_and_special, batches_per_stream=60)
    short, _, p = digests(data, tokenizer_and_special, passes=1, batches_per_stream=None)
    assert all(s.passes >= 1 for s in p.sources)
    assert short == long[: len(short)]
    c = p.final_counters()  # nothing left unaccounted at the end of the budget
    assert sum(c.samples_read.values()) == sum(c.samples_packed.values()) + sum(
        v for k, v in c.drops.items() if ":" not in k)


def test_reused_pixel_table_gives_the_same_batches(data, tokenizer_and_special):
    """The writer's mode (one table buffer for every batch) packs the same records, and really
    reuses the buffer: each batch must be consumed before the next is made."""
    want, _, _ = digests(data, tokenizer_and_special, batches_per_stream=5)
    cfg = load_config(data.config(knobs=KNOBS, prepack={"batches_per_stream": 5}))
    got, tables = [], []
    for b in StreamPacker(cfg, 0, *tokenizer_and_special, options=PackerOptions(reuse_pixel_table=True)):
        got.append(record_digest(batch_to_record(b)))  # consumed now, as the writer does
        tables.append(b.image_pixels)
    assert got == want
    assert len(tables) == 5 and all(t.size for t in tables)
    assert sum(np.shares_memory(tables[i], tables[i + 1]) for i in range(4)) >= 3
