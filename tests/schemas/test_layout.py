"""schemas.layout: every name it formats parses back to its kind and numbers, and nothing else does."""

from __future__ import annotations

import pytest

from schemas import layout as L


@pytest.mark.parametrize("stream,shard", [(0, 0), (3, 12), (99999, 99999), (123456, 100000)])
def test_every_name_parses_back(stream, shard):
    names = {
        L.SHARD: L.shard_file(stream, shard),
        L.PIXELS: L.shard_pixels_file(stream, shard),
        L.SHARD_LINEAGE: L.shard_lineage_file(stream, shard),
        L.CKPT_JSON: L.checkpoint_file(stream, shard),
        L.CKPT_ARROW: L.checkpoint_file(stream, shard, "arrow"),
    }
    for kind, name in names.items():
        assert L.parse(name) == L.PackFile(kind, stream, shard), name
    assert L.parse(L.index_file(stream)) == L.PackFile(L.INDEX, stream)
    assert L.parse(L.done_file(stream)) == L.PackFile(L.DONE, stream)
    assert L.parse(L.stream_lineage_file(stream)) == L.PackFile(L.STREAM_LINEAGE, stream)
    assert set(L.LAYOUT) >= set(names) | {L.INDEX, L.DONE, L.STREAM_LINEAGE}


def test_names_are_the_ones_on_disk():
    assert L.shard_file(3, 2) == "stream-00003/shard-00002.arrow"
    assert L.shard_pixels_file(3, 2) == "stream-00003/shard-00002.pixels.arrow"
    assert L.checkpoint_file(3, 1, "arrow") == "stream-00003/ckpt-00001.arrow"
    assert L.stream_lineage_file(3) == "lineage/stream-00003.parquet"
    assert L.lease_file("ab12") == ".prepack/leases/ab12.json"
    assert L.parse(L.lease_file("ab12")) == L.PackFile(L.LEASE, holder="ab12")
    assert L.grant_file(3) == ".prepack/grants/stream-00003.json"
    assert L.parse(L.grant_file(3)) == L.PackFile(L.GRANT, stream=3)
    assert L.parse("pack.json") == L.PackFile(L.PACK_INFO) and L.parse("manifest.json") == L.PackFile(L.MANIFEST)


@pytest.mark.parametrize("name", [
    "stream-00003/shard-00002.arrow.tmp", "stream-00003/shard-x.arrow", "stream-00003/shard-00002.json",
    "stream-00003/ckpt-00002.pixels.arrow", "stream-00003", "shard-00002.arrow", "lineage/stream-00003.arrow",
    "stream-00003/sub/shard-00002.arrow", ".prepack/leases/a/b.json", "stream-00003/index.arrow.tmp",
])
def test_other_names_are_not_of_the_layout(name):
    assert L.parse(name) is None


def test_temporary_names():
    assert L.is_temporary(L.temporary(L.index_file(0))) and not L.is_temporary(L.index_file(0))
    mine, theirs = L.temporary(L.PACK_INFO_NAME, "a1"), L.temporary(L.PACK_INFO_NAME, "b2")
    assert mine != theirs and L.is_temporary(mine) and L.is_temporary(theirs)


def test_stream_numbering_is_rank_times_workers_plus_worker():
    from schemas.streams import rank_and_worker, rank_streams, stream_of, workers_per_rank

    for k in (0, 1, 2, 3):
        per = workers_per_rank(k)
        assert per == max(1, k)
        for r in range(4):
            assert rank_streams(r, k) == [stream_of(r, w, k) for w in range(per)]
            for w in range(per):
                s = stream_of(r, w, k)
                assert s == r * per + w and rank_and_worker(s, k) == (r, w)
