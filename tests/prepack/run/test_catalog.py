"""The pixel catalog: a pack's shard pixel indexes merged by content, read a block at a time.

One small pack (t2i + edit + SFT, W=1 K=2, several shards a stream).  The catalog must list
exactly the first copy of every ``(content, decode, width, height)`` the shard indexes list, each
found again by content with the same frame location; a reader over it holds nothing in memory
but shards the catalog does not cover; a catalog that no longer matches the pack, or a damaged
block, is refused (counted) without losing a picture that can still be read.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import numpy as np
import pytest

from prepack.cli import main
from prepack.engine.reuse.source_pictures import ReuseCounts
from prepack.engine.reuse.earlier_pixels import PixelReuse
from prepack.run.catalog import build_catalog, catalog_is_current, ensure_catalog
from prepack.engine.reuse.earlier_packs import open_old_pack
from schemas.layout import index_file, shard_pixels_file
from schemas.manifest import StreamIndex
from schemas.pixel_catalog import CATALOG_NAME, ROW_DTYPE, Catalog, part_file
from schemas.pixel_index import PictureSource, read_pixel_index
from tests.helpers.packs import KNOBS, make_dataset, pack_in_process


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tokenizer_and_special):
    root = str(tmp_path_factory.mktemp("catalog"))
    ds = make_dataset(root, seed=3, edit=True)
    config = ds.config(knobs=KNOBS, num_workers=2, prepack={"shard_bytes": 200_000, "batches_per_stream": 8})
    return pack_in_process(config, os.path.join(root, "pack"), tokenizer_and_special)


def _shard_rows(out: str) -> list[dict]:
    """Every row of every shard pixel index, in pack order, with its stream and shard."""
    loc, streams = open_old_pack(out)
    rows = []
    for s in range(streams):
        index = StreamIndex.from_bytes(loc.read_bytes(index_file(s)), s, "index")
        for e in index.shards:
            table, _ = read_pixel_index(loc.read_bytes(shard_pixels_file(s, e.shard)), "pixels")
            for r in table.to_pylist():
                rows.append({**r, "stream": s, "shard": e.shard})
    return rows


def _copy(pack: str, dest) -> str:
    out = str(dest / "copy")
    shutil.copytree(pack, out)
    return out


def _found(reuse: PixelReuse, rows: list[dict]) -> int:
    """How many of ``rows`` the reader finds, with the same facts and frame bytes' digest check."""
    found = 0
    for r in rows:
        facts = reuse.facts((r["content"], r["decode"]))
        assert facts is not None and (facts.width, facts.height) == (r["src_width"], r["src_height"])
        source = PictureSource(r["content"], r["decode"], facts)
        got = reuse.fetch(source, r["width"], r["height"])
        if got is not None:
            assert got.shape == (r["height"], r["width"], 3)
            found += 1
    return found


def test_the_catalog_lists_the_first_copy_of_every_picture(pack, tmp_path):
    out = _copy(pack, tmp_path)
    rows = _shard_rows(out)
    result = build_catalog(out)
    first: dict = {}
    for r in rows:
        first.setdefault((r["content"], r["decode"], r["width"], r["height"]), r)
    assert result.rows == len(first) and result.shards == result.committed and not result.skipped
    assert len(rows) > len(set(r["content"] for r in rows)) > 0  # a picture at several targets / copies
    reuse = PixelReuse([out], ReuseCounts())
    assert _found(reuse, list(first.values())) == len(first)
    assert not reuse._where and not reuse.counts.fallbacks  # nothing held in memory: all from the catalog
    for (content, decode, width, height), r in first.items():  # the first copy, where it lies
        where = reuse._catalog_where(PictureSource(content, decode, None), width, height)
        assert (where.offset, where.length, where.digest) == (r["offset"], r["length"], r["digest"])
        assert reuse._files[where.file].relpath.endswith(f"shard-{r['shard']:05d}.arrow")
    assert reuse.facts((b"\0" * 16, "rgb")) is None
    again = str(tmp_path / "again")
    shutil.copytree(pack, again)
    build_catalog(again)
    assert _digest_tree(os.path.join(out, "pixels")) == _digest_tree(os.path.join(again, "pixels"))


def test_a_picture_asked_again_after_others_is_not_looked_up_again(pack, tmp_path, monkeypatch):
    """A stream asks a picture's facts when it samples it, and its targets when it plans and builds
    its batch, other pictures in between: the catalog is read once per picture, within a bound."""
    from prepack.engine.reuse import earlier_packs, earlier_pixels

    out = _copy(pack, tmp_path)
    build_catalog(out)
    first: dict = {}
    for r in _shard_rows(out):
        first.setdefault((r["content"], r["decode"]), r)
    pictures = list(first.values())
    assert len(pictures) > 2
    reads = []
    real_rows = earlier_packs.CatalogView.rows
    monkeypatch.setattr(earlier_packs.CatalogView, "rows", lambda self, c, d: reads.append(c) or real_rows(self, c, d))
    reuse = PixelReuse([out], ReuseCounts())
    for r in pictures:  # every picture sampled first, then every one fetched
        assert reuse.facts((r["content"], r["decode"])) is not None
    for r in pictures:
        source = PictureSource(r["content"], r["decode"], None)
        assert reuse.fetch(source, r["width"], r["height"]) is not None
    assert sorted(reads) == sorted(r["content"] for r in pictures)  # once each
    monkeypatch.setattr(earlier_pixels, "RECENT_PICTURES", 1)
    reuse, reads[:] = PixelReuse([out], ReuseCounts()), []
    for r in pictures:
        reuse.facts((r["content"], r["decode"]))
    for r in pictures:
        reuse.facts((r["content"], r["decode"]))
    assert len(reads) == 2 * len(pictures) and len(reuse._recent) == 1  # the bound holds


def _digest_tree(folder: str) -> dict:
    return {os.path.relpath(os.path.join(d, n), folder): hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
            for d, _, names in os.walk(folder) for n in names}


def test_shards_committed_after_the_catalog_are_read_from_their_own_index(pack, tmp_path):
    out = _copy(pack, tmp_path)
    loc, _ = open_old_pack(out)
    full = loc.read_bytes(index_file(1))
    index = StreamIndex.from_bytes(full, 1, "index")
    assert len(index.shards) >= 2
    shorter = StreamIndex(1, index.shards[:1], index.ckpt0_json_sha256, index.ckpt0_arrow_sha256)
    open(loc.path(index_file(1)), "wb").write(shorter.to_bytes())  # stream 1 had committed one shard
    build_catalog(out)
    open(loc.path(index_file(1)), "wb").write(full)  # ... then the rest
    assert not catalog_is_current(*open_old_pack(out))
    rows = _shard_rows(out)
    later = [r for r in rows if r["stream"] == 1 and r["shard"] >= 1]
    reuse = PixelReuse([out], ReuseCounts())
    assert _found(reuse, rows) == len(rows) and not reuse.counts.fallbacks
    assert 0 < len(reuse._where) <= len(later)  # only the uncovered shards are held in memory
    assert ensure_catalog(out).startswith("indexed ")  # a run brings it up to date
    assert catalog_is_current(*open_old_pack(out)) and ensure_catalog(out) is None


def test_a_catalog_of_another_pack_state_is_refused(pack, tmp_path):
    out = _copy(pack, tmp_path)
    build_catalog(out)
    loc, _ = open_old_pack(out)
    catalog = Catalog.read(loc)
    stream, (n, _) = next(iter(catalog.covered.items()))
    catalog.covered[stream] = (n, "0" * 64)  # says it covers shards the stream index does not have
    open(loc.path(CATALOG_NAME), "wb").write(catalog.to_bytes())
    reuse = PixelReuse([out], ReuseCounts())
    rows = _shard_rows(out)
    assert _found(reuse, rows) == len(rows)  # every picture still found, from the shard indexes
    assert reuse.counts.fallbacks == {"pixel_catalog_stale": 1}


def test_a_damaged_block_loses_only_its_pictures(pack, tmp_path):
    out = _copy(pack, tmp_path)
    build_catalog(out)
    loc, _ = open_old_pack(out)
    catalog = Catalog.read(loc)
    rows = _shard_rows(out)
    part = rows[0]["content"][0]
    path = loc.path(part_file(catalog.build, part))
    records = np.fromfile(path, ROW_DTYPE)
    records["offset"][0] += 1  # a well-formed part whose first block no longer matches its fence
    records.tofile(path)
    reuse = PixelReuse([out], ReuseCounts())
    unique = {(r["content"], r["decode"], r["width"], r["height"]): r for r in rows}
    in_part = [r for r in unique.values() if r["content"][0] == part]
    others = [r for r in unique.values() if r["content"][0] != part]
    assert sum(reuse.fetch(PictureSource(r["content"], r["decode"], None), r["width"], r["height"]) is not None
               for r in in_part) < len(in_part)
    assert reuse.counts.fallbacks.get("pixel_catalog_damaged", 0) > 0
    assert _found(reuse, others) == len(others)


def test_index_command(pack, tmp_path, capsys):
    out = _copy(pack, tmp_path)
    assert main(["index", out]) == 0
    assert "indexed " in capsys.readouterr().out
    assert catalog_is_current(*open_old_pack(out))
    assert main(["index", out]) == 0 and "up to date" in capsys.readouterr().out
    assert main(["index", str(tmp_path / "nothing")]) == 1
    assert "not a pack" in capsys.readouterr().err


def test_verify_checks_the_catalog(pack, tmp_path):
    from prepack.tools.verify import verify_pack

    out = _copy(pack, tmp_path)
    build_catalog(out)
    rep = verify_pack(out)
    rows = [r for r in rep.rows if r.check == "pixel catalog"]
    assert rep.ok and len(rows) >= 3, rows
    loc, _ = open_old_pack(out)
    catalog = Catalog.read(loc)
    part = int(next(n for n in sorted(os.listdir(os.path.join(out, "pixels", catalog.build))) if n.startswith("part-"))[5:8])
    path = loc.path(part_file(catalog.build, part))
    records = np.fromfile(path, ROW_DTYPE)
    records["digest"][-1] ^= 1
    records.tofile(path)
    rep = verify_pack(out)
    assert not rep.ok and any(r.check == "pixel catalog" and not r.ok and "differ" in r.detail for r in rep.rows)
