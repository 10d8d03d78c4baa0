"""``prepack run --reuse OLD``: another config over the same pictures packs byte for byte what a
fresh pack of it packs, taking OLD's pixels where they are provably the same.

One OLD pack (t2i + edit + SFT, W=1 K=2).  NEW configs change the seed, the weights, W x K and
the budget.  Each NEW is packed fresh and with ``--reuse OLD`` (in process, the driver without
Ray), and every file of the two packs but the informational ones (done.json's counts and times,
the manifest that lists them) is compared byte for byte.  Then OLD is damaged in each way a
store can damage it, a source picture is rewritten under its old path, a reused run is killed
and resumed, and a small set read several times over takes its later passes from its own shards.
"""

from __future__ import annotations

import os
import shutil

import pytest
import yaml

from prepack.engine.reuse.earlier_pixels import OWN_SETTING
from prepack.run.driver import RunOptions, run_pack
from prepack.run.stream_job import StreamJob, pack_one_stream
from schemas.config_file import load_config
from schemas.errors import PackRefused
from prepack.run.catalog import ensure_catalog
from schemas.layout import shard_file, shard_pixels_file
from schemas.pixel_catalog import CATALOG_DIR, CATALOG_NAME, Catalog, fences_file, part_file
from tests.helpers.packs import KNOBS, make_dataset, make_video_dataset, pack_in_process
from tests.helpers.s3checks import pack_bytes



_files = pack_bytes


def _config(ds, path: str, **change) -> str:
    """``ds``'s config with ``change`` applied (seed, num_workers, prepack keys, group weights)."""
    weights = change.pop("weights", {})
    prepack = {"shard_bytes": 300_000, "batches_per_stream": 6, **change.pop("prepack", {})}
    cfg_path = ds.config(knobs=KNOBS, num_workers=change.pop("num_workers", 2), prepack=prepack,
                         seed=change.pop("seed", 42))
    cfg = yaml.safe_load(open(cfg_path))
    for group, w in weights.items():
        cfg["dataset"]["grouped_datasets"][group]["weight"] = w
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    return path


def _pack(config: str, out: str, tok, reuse=()):
    return run_pack(load_config(config), out, RunOptions(inline=True, bar=False, reuse=reuse), tokenizer=tok)


def _reuse(summary) -> tuple[int, int, dict]:
    images = sum(s.reuse.get("images", 0) for s in summary.streams)
    reused = sum(s.reuse.get("reused", 0) for s in summary.streams)
    fallbacks: dict = {}
    for s in summary.streams:
        for k, v in s.reuse.get("fallbacks", {}).items():
            fallbacks[k] = fallbacks.get(k, 0) + v
    return images, reused, fallbacks


@pytest.fixture(scope="module")
def old(tmp_path_factory, tokenizer_and_special):
    root = str(tmp_path_factory.mktemp("reuse"))
    ds = make_dataset(root, seed=0, edit=True)
    config = _config(ds, os.path.join(root, "old.yaml"), prepack={"batches_per_stream": 10})
    out = pack_in_process(config, os.path.join(root, "old"), tokenizer_and_special)
    return {"ds": ds, "root": root, "out": out}


CHANGES = {
    "seed": dict(seed=7),
    "weights": dict(weights={"t2i_pretrain": 3, "vlm_sft": 0.5}),
    "world": dict(num_workers=1, prepack={"world_size": 2}),
    "budget": dict(prepack={"batches_per_stream": 3}),
    "passes": dict(seed=11, prepack={"batches_per_stream": None, "passes": 1}),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_reused_pack_is_the_fresh_pack(old, change, tmp_path, tokenizer_and_special, monkeypatch):
    monkeypatch.setenv(OWN_SETTING, "0")  # reuse from OLD alone: what OLD gives is what is measured
    config = _config(old["ds"], str(tmp_path / "new.yaml"), **{k: v for k, v in CHANGES[change].items()})
    fresh = _pack(config, str(tmp_path / "fresh"), tokenizer_and_special)
    reused = _pack(config, str(tmp_path / "reused"), tokenizer_and_special, reuse=[old["out"]])
    assert _files(str(tmp_path / "reused")) == _files(str(tmp_path / "fresh"))
    images, hits, fallbacks = _reuse(reused)
    assert images > 0 and hits > images // 2 and not fallbacks, (images, hits, fallbacks)
    assert _reuse(fresh)[1] == 0
    line = [x for x in reused.lines() if x.startswith("reused ")]
    assert line == [f"reused {hits:,} of {images:,} images ({hits / images:.0%}) from {old['out']}"]
    # the same compression as OLD's: every reused frame is written as OLD stored it, none decompressed
    assert sum(s.reuse["frames_passed"] for s in reused.streams) == hits
    assert not any("compressed again" in x for x in reused.lines())
    if change == "world":  # reuse x balanced batches x a world-size change: read as the fresh pack is
        assert _balanced_then_merged(str(tmp_path / "reused")) == _balanced_then_merged(str(tmp_path / "fresh"))


def _balanced_then_merged(out: str) -> list[str]:
    """Each of W=2 ranks reads one balanced step (M=2), then their states merged onto one rank read
    the rest: every batch, in the order read."""
    from loader import Balance, PackedShardDataset

    read, states = [], []
    for r in (0, 1):
        ds = PackedShardDataset(out, rank=r, world_size=2, balance=Balance(micro_batches=2))
        it = iter(ds)
        read += [repr(next(it).batch_data_indexes) for _ in range(2)]
        states.append(ds.state_dict())
    rest = PackedShardDataset(out, rank=0, world_size=1)
    rest.load_state_dict(PackedShardDataset.merge_states(states))
    read += [repr(b.batch_data_indexes) for b in rest]
    assert len(read) == 12 and len(set(read)) == len(read)  # 2 streams x 6 batches, each once
    return read


@pytest.mark.parametrize("compression", [pytest.param("zstd:3", marks=pytest.mark.slow),
                                         pytest.param("lz4", marks=pytest.mark.slow), "none"])
def test_another_compression_stores_reused_pixels_anew(old, compression, tmp_path, tokenizer_and_special,
                                                       monkeypatch):
    """OLD's frames are zstd:1: a NEW of another compression decompresses them and stores the pixels
    its own way (the fresh pack's bytes), saying so; none of OLD's frames is passed through."""
    monkeypatch.setenv(OWN_SETTING, "0")
    config = _config(old["ds"], str(tmp_path / "new.yaml"), seed=3, prepack={"compression": compression})
    fresh = _pack(config, str(tmp_path / "fresh"), tokenizer_and_special)
    reused = _pack(config, str(tmp_path / "reused"), tokenizer_and_special, reuse=[old["out"]])
    assert _files(str(tmp_path / "reused")) == _files(str(tmp_path / "fresh"))
    images, hits, fallbacks = _reuse(reused)
    assert hits > 0 and not fallbacks and _reuse(fresh)[1] == 0
    assert sum(s.reuse["frames_passed"] for s in reused.streams) == 0
    again = sum(s.reuse["frames_recompressed"] for s in reused.streams)
    assert again == (0 if compression == "none" else hits)
    assert any(x.startswith(f"{again:,} reused images compressed again") for x in reused.lines()) == (again > 0)


def _a_part(pack: str, build: str) -> int:
    """The catalog part holding the most pictures (so some of a new pack's lookups land in it)."""
    folder = os.path.join(pack, CATALOG_DIR, build)
    parts = [n for n in os.listdir(folder) if n.startswith("part-")]
    return int(max(parts, key=lambda n: os.path.getsize(os.path.join(folder, n)))[5:8])


def _damaged_copy(old: str, dest: str, how: str) -> str:
    shutil.copytree(old, dest)
    s0 = os.path.join(dest, os.path.dirname(shard_file(0, 0)))
    if how == "frame":  # flip bytes in the middle of every shard of stream 0 (inside pixel frames)
        for name in os.listdir(s0):
            if name.startswith("shard-") and name.endswith(".arrow") and ".pixels" not in name:
                p = os.path.join(s0, name)
                data = bytearray(open(p, "rb").read())
                for i in range(len(data) // 4, len(data) * 3 // 4, 997):
                    data[i] ^= 0x5A
                open(p, "wb").write(bytes(data))
    elif how == "deleted_shard":
        os.remove(os.path.join(dest, shard_file(0, 0)))
    elif how == "truncated_shard":
        p = os.path.join(dest, shard_file(0, 1))
        os.truncate(p, os.path.getsize(p) // 2)
    elif how == "catalog_block":  # one block of the catalog: its pictures decode, the others still serve
        build = Catalog.from_bytes(open(os.path.join(dest, CATALOG_NAME), "rb").read(), "catalog").build
        p = os.path.join(dest, part_file(build, _a_part(dest, build)))
        data = bytearray(open(p, "rb").read())
        for i in range(64, len(data) - 64, 101):
            data[i] ^= 0x5A
        open(p, "wb").write(bytes(data))
    elif how == "catalog_fences":  # the whole catalog is refused: the shards' own indexes serve
        build = Catalog.from_bytes(open(os.path.join(dest, CATALOG_NAME), "rb").read(), "catalog").build
        p = os.path.join(dest, fences_file(build))
        data = bytearray(open(p, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(p, "wb").write(bytes(data))
    elif how == "index_damaged":
        shutil.rmtree(os.path.join(dest, CATALOG_DIR))  # else the catalog serves what the index lost
        p = os.path.join(dest, shard_pixels_file(0, 0))
        data = bytearray(open(p, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(p, "wb").write(bytes(data))
    elif how == "index_deleted":
        shutil.rmtree(os.path.join(dest, CATALOG_DIR))
        os.remove(os.path.join(dest, shard_pixels_file(1, 0)))
    return dest


@pytest.mark.parametrize("how,reason", [("frame", "frame_damaged"), ("truncated_shard", "shard_unreadable"),
                                        *(pytest.param(*p, marks=pytest.mark.slow) for p in [
                                            ("deleted_shard", "shard_unreadable"),
                                            ("index_damaged", "pixel_index_damaged"),
                                            ("index_deleted", "pixel_index_missing"),
                                            ("catalog_block", "pixel_catalog_damaged"),
                                            ("catalog_fences", "pixel_catalog_damaged")])])
def test_damaged_old_falls_back_to_decoding(old, how, reason, tmp_path, tokenizer_and_special, monkeypatch):
    monkeypatch.setenv(OWN_SETTING, "0")
    ensure_catalog(old["out"])  # the copy has a catalog to damage (the kinds that damage others drop it)
    assert os.path.exists(os.path.join(old["out"], CATALOG_NAME))
    config = _config(old["ds"], str(tmp_path / "new.yaml"), seed=5)
    fresh = _pack(config, str(tmp_path / "fresh"), tokenizer_and_special)
    bad = _damaged_copy(old["out"], str(tmp_path / "bad"), how)
    reused = _pack(config, str(tmp_path / "reused"), tokenizer_and_special, reuse=[bad])
    assert _files(str(tmp_path / "reused")) == _files(str(tmp_path / "fresh"))
    images, hits, fallbacks = _reuse(reused)
    assert fallbacks.get(reason, 0) > 0 and hits > 0, fallbacks
    assert any(x.startswith("reuse fell back to decoding: ") and reason in x for x in reused.lines())
    assert _reuse(fresh)[1] == 0


@pytest.mark.slow  # packs twice
def test_a_picture_rewritten_under_its_path_is_not_reused(tmp_path, tokenizer_and_special, monkeypatch):
    monkeypatch.setenv(OWN_SETTING, "0")
    ds = make_dataset(str(tmp_path / "a"), seed=0)
    config = _config(ds, str(tmp_path / "cfg.yaml"))
    old = pack_in_process(config, str(tmp_path / "old"), tokenizer_and_special)
    images_dir = ds.info["vlm_sft"]["vlm"]["data_dir"]
    from PIL import Image

    changed = 0
    for name in sorted(os.listdir(images_dir)):  # same paths, same sizes, other pixels
        p = os.path.join(images_dir, name)
        with Image.open(p) as im:
            im.convert("RGB").rotate(180).save(p, quality=90)
        changed += 1
    assert changed
    fresh = _pack(config, str(tmp_path / "fresh"), tokenizer_and_special)
    reused = _pack(config, str(tmp_path / "reused"), tokenizer_and_special, reuse=[old])
    assert _files(str(tmp_path / "reused")) == _files(str(tmp_path / "fresh"))
    assert _files(str(tmp_path / "fresh")) != _files(old)
    images, hits, _ = _reuse(reused)
    assert 0 < hits < images  # the t2i pictures are unchanged and still reused; the rewritten ones are not


class _Kill(Exception):
    pass


@pytest.mark.slow  # kills a run and packs again
def test_a_killed_reused_run_resumes_to_the_fresh_bytes(old, tmp_path, tokenizer_and_special, monkeypatch):
    monkeypatch.setenv(OWN_SETTING, "0")
    config = _config(old["ds"], str(tmp_path / "new.yaml"), seed=9, prepack={"shard_bytes": 120_000})
    fresh = str(tmp_path / "fresh")
    _pack(config, fresh, tokenizer_and_special)
    out = str(tmp_path / "reused")
    _pack(config, out, tokenizer_and_special, reuse=[old["out"]])  # settles pack.json; then redo stream 0 by a kill
    shutil.rmtree(os.path.join(out, "stream-00000"))
    os.remove(os.path.join(out, "manifest.json"))
    cfg = load_config(config)
    tok, special = tokenizer_and_special

    def report(ev):
        if ev.batches == 3:
            raise _Kill()

    with pytest.raises(_Kill):
        pack_one_stream(StreamJob(cfg, out, _metadata(out), (old["out"],)), 0, tok, special, report)
    assert os.path.exists(os.path.join(out, shard_file(0, 0)))  # killed after a commit, before the end
    assert not os.path.exists(os.path.join(out, "stream-00000", "done.json"))
    _pack(config, out, tokenizer_and_special, reuse=[old["out"]])
    assert _files(out) == _files(fresh)


def _metadata(out: str) -> dict:
    """The shard metadata the driver gives stream tasks for the pack at ``out``."""
    from schemas.location import resolve_location
    from schemas.pack_info import PackInfo

    return PackInfo.read(resolve_location(out)).shard_metadata()


@pytest.mark.parametrize("shard_bytes,compression", [(60_000, "zstd:1"), (1 << 30, "zstd:1"), (60_000, "none")],
                         ids=["committed-shards", "open-shard-in-memory", "uncompressed"])
@pytest.mark.slow  # three passes, three ways
def test_later_passes_take_their_pictures_from_the_stream_s_own_shards(shard_bytes, compression, tmp_path,
                                                                       tokenizer_and_special, monkeypatch):
    """Passes 2 and 3 of a small set take its pictures back: from the shards committed, and from
    the frames of the shard still open, held in memory (one shard for the whole pack: every later
    picture from memory; uncompressed tables are not held, their buffer is the packer's)."""
    ds = make_dataset(str(tmp_path / "a"), seed=1)
    config = _config(ds, str(tmp_path / "cfg.yaml"), prepack={"batches_per_stream": None, "passes": 3,
                                                              "shard_bytes": shard_bytes,
                                                              "compression": compression})
    monkeypatch.setenv(OWN_SETTING, "0")
    off = _pack(config, str(tmp_path / "off"), tokenizer_and_special)
    monkeypatch.setenv(OWN_SETTING, "1")
    on = _pack(config, str(tmp_path / "on"), tokenizer_and_special)
    assert _files(str(tmp_path / "on")) == _files(str(tmp_path / "off"))
    images, hits, fallbacks = _reuse(on)
    assert _reuse(off)[1] == 0 and not fallbacks
    assert hits >= images // 3, (images, hits)  # passes 2 and 3 (less what the open shard held, uncompressed)
    if shard_bytes > 1 << 20:  # one shard: every picture of passes 2 and 3 came from memory
        assert hits >= images * 3 // 5, (images, hits)
    assert any(x.startswith("reused ") and "this pack's own shards" in x for x in on.lines())


@pytest.mark.slow  # runs the CLI in subprocesses
def test_a_wrong_reuse_is_one_clear_line(old, tmp_path, tokenizer_and_special):
    config = _config(old["ds"], str(tmp_path / "new.yaml"), seed=3)
    with pytest.raises(PackRefused, match="is not a pack"):
        _pack(config, str(tmp_path / "x"), tokenizer_and_special, reuse=[str(tmp_path / "nothing-here")])
    with pytest.raises(PackRefused, match="the output itself"):
        _pack(config, old["out"], tokenizer_and_special, reuse=[old["out"]])


@pytest.mark.slow
def test_old_on_the_s3_server(old, s3, tmp_path, tokenizer_and_special, monkeypatch):
    """OLD copied to a real S3 server: its frames read ahead by ranged reads, the same bytes."""
    monkeypatch.setenv(OWN_SETTING, "0")
    uri = s3.new_prefix("old")
    import pyarrow.fs as pafs

    from schemas.location import resolve_location

    dest = resolve_location(uri)
    pafs.copy_files(old["out"], dest.base, destination_filesystem=dest.fs)
    config = _config(old["ds"], str(tmp_path / "new.yaml"), seed=13, num_workers=1, prepack={"world_size": 2})
    fresh = _pack(config, str(tmp_path / "fresh"), tokenizer_and_special)
    reused = _pack(config, str(tmp_path / "reused"), tokenizer_and_special, reuse=[uri])
    assert _files(str(tmp_path / "reused")) == _files(str(tmp_path / "fresh"))
    images, hits, fallbacks = _reuse(reused)
    assert hits > images // 2 and not fallbacks, (images, hits, fallbacks)
    assert _reuse(fresh)[1] == 0
    ahead = sum(s.reuse["frames_read_ahead"] for s in reused.streams)
    assert 0 < ahead and sum(s.reuse["frames_passed"] for s in reused.streams) == hits
    monkeypatch.setenv("PREPACK_READ_AHEAD", "0")  # off: the frames are read when asked for, same bytes
    off = _pack(config, str(tmp_path / "off"), tokenizer_and_special, reuse=[uri])
    assert _files(str(tmp_path / "off")) == _files(str(tmp_path / "fresh"))
    assert _reuse(off)[1] == hits and sum(s.reuse["frames_read_ahead"] for s in off.streams) == 0


def test_plan_projects_reuse(old, tmp_path, tokenizer_and_special, monkeypatch):
    from prepack.tools.plan import PlanOptions, plan_pack

    monkeypatch.setenv(OWN_SETTING, "0")
    config = load_config(_config(old["ds"], str(tmp_path / "new.yaml"), seed=9))
    plain = plan_pack(config, PlanOptions(sample_batches=2), tokenizer=tokenizer_and_special)
    plan = plan_pack(config, PlanOptions(sample_batches=2, reuse=[old["out"]]), tokenizer=tokenizer_and_special)
    assert not plain.reuse and not any(x.strip().startswith("reuse ") for x in plain.lines())
    assert plan.reuse["images"] > 0 and 0 < plan.reuse["reused"] <= plan.reuse["images"]
    share = plan.reuse["reused"] / plan.reuse["images"]
    assert [x for x in plan.lines() if x.strip().startswith("reuse ")] == [
        f"  reuse         {share:.0%} of the sampled images found in {old['out']} "
        f"({plan.reuse['reused']:,} of {plan.reuse['images']:,}); CPU above is with them"]
    assert plan.to_json()["reuse"]["reused"] == plan.reuse["reused"]
    with pytest.raises(PackRefused, match="--reuse .*not a pack"):
        plan_pack(config, PlanOptions(sample_batches=1, reuse=[str(tmp_path / "nothing")]), tokenizer=tokenizer_and_special)


def _pixel_rows(out: str) -> list[dict]:
    from schemas.layout import index_file
    from schemas.manifest import StreamIndex
    from schemas.pixel_index import read_pixel_index

    rows = []
    for name in sorted(os.listdir(out)):
        if not name.startswith("stream-"):
            continue
        s = int(name.split("-")[1])
        index = StreamIndex.from_bytes(open(os.path.join(out, index_file(s)), "rb").read(), s, "index")
        for e in index.shards:
            table, _ = read_pixel_index(open(os.path.join(out, shard_pixels_file(s, e.shard)), "rb").read(), "px")
            rows += table.to_pylist()
    return rows


@pytest.mark.slow  # writes and packs videos twice
def test_video_frames_are_reused(tmp_path, tokenizer_and_special, monkeypatch):
    """Frames of mp4 videos are keyed by the video's bytes and frame index: a new config takes them
    from OLD (decord does not decode a video whose sampled frames OLD holds), byte for byte."""
    monkeypatch.setenv(OWN_SETTING, "0")
    ds = make_video_dataset(str(tmp_path / "v"))
    old = pack_in_process(_config(ds, str(tmp_path / "old.yaml"), prepack={"batches_per_stream": 10}),
                          str(tmp_path / "old"), tokenizer_and_special)
    old_rows = _pixel_rows(old)
    assert any(r["decode"] == "video" for r in old_rows)
    config = _config(ds, str(tmp_path / "new.yaml"), seed=13)
    fresh = _pack(config, str(tmp_path / "fresh"), tokenizer_and_special)
    reused = _pack(config, str(tmp_path / "reused"), tokenizer_and_special, reuse=[old])
    assert _files(str(tmp_path / "reused")) == _files(str(tmp_path / "fresh"))
    known = {(r["content"], r["decode"], r["width"], r["height"]) for r in old_rows}
    new_rows = _pixel_rows(str(tmp_path / "reused"))
    videos = [r for r in new_rows if r["decode"] == "video"]
    assert videos and any((r["content"], r["decode"], r["width"], r["height"]) in known for r in videos)
    images, hits, fallbacks = _reuse(reused)
    assert not fallbacks and _reuse(fresh)[1] == 0
    assert images - hits == sum((r["content"], r["decode"], r["width"], r["height"]) not in known for r in new_rows)


@pytest.mark.parametrize("catalog", [True, False], ids=["catalog", "shard-indexes"])
def test_a_stream_given_old_as_the_driver_read_it_reads_no_stream_index(old, catalog, tmp_path):
    """The driver reads OLD's stream indexes once (``read_old_pack``) for every stream: with that
    snapshot a stream finds every picture of OLD with the indexes gone (through the catalog, or the
    shards' own pixel indexes the snapshot lists), and each picture's frame checks out."""
    from prepack.engine.reuse.earlier_packs import read_old_pack
    from prepack.engine.reuse.earlier_pixels import PixelReuse
    from schemas.layout import index_file
    from schemas.pixel_index import DecodeFacts, PictureSource

    copy = str(tmp_path / "old")
    shutil.copytree(old["out"], copy)
    shutil.rmtree(os.path.join(copy, CATALOG_DIR), ignore_errors=True)
    if catalog:
        ensure_catalog(copy)
    rows = _pixel_rows(copy)
    snapshot = read_old_pack(copy)
    assert (snapshot.catalog_build is not None) == catalog and snapshot.readable and not snapshot.fallbacks
    assert bool(snapshot.uncovered) != catalog  # a catalog covers every committed shard
    for s in range(2):
        os.remove(os.path.join(copy, index_file(s)))
    reuse = PixelReuse([snapshot], frame_format="zstd/none-such")  # frames decompressed: pixels checked
    for r in rows[::7]:
        facts = reuse.facts((r["content"], r["decode"]))
        assert facts == DecodeFacts(r["src_width"], r["src_height"], tuple(k for k in r["damage"].split(",") if k))
        got = reuse.fetch(PictureSource(r["content"], r["decode"], facts), r["width"], r["height"])
        assert got is not None and got.digest == r["digest"] and got.coded is not None
    assert not reuse.counts.fallbacks
    again = read_old_pack(copy)  # read now, without indexes: nothing is committed, a catalog is stale
    assert again.catalog_build is None and not again.uncovered
    assert again.fallbacks == ((("pixel_catalog_stale", 1),) if catalog else ())
    reuse.close()


@pytest.mark.parametrize("catalog", [True, False], ids=["catalog", "built-by-the-job"])
def test_a_re_pack_reads_old_once_per_job(old, catalog, tmp_path, tokenizer_and_special, monkeypatch):
    """A job reads each file of OLD it needs once (pack.json, every stream index, catalog.json, the
    fences), whatever its number of streams: its streams get them from the driver (``OldPack``) and
    read none again.  Without a catalog the job builds one first and reads it back not at all."""
    from schemas.layout import PACK_INFO_NAME, index_file
    from schemas.location import PackLocation

    monkeypatch.setenv(OWN_SETTING, "0")
    copy = str(tmp_path / "old")
    shutil.copytree(old["out"], copy)
    shutil.rmtree(os.path.join(copy, CATALOG_DIR), ignore_errors=True)
    if catalog:
        ensure_catalog(copy)
    reads: list[str] = []
    real = PackLocation.read_bytes

    def counted(self, relpath: str) -> bytes:
        if os.path.abspath(self.base) == os.path.abspath(copy):
            reads.append(relpath)
        return real(self, relpath)

    monkeypatch.setattr(PackLocation, "read_bytes", counted)
    config = _config(old["ds"], str(tmp_path / "new.yaml"), seed=7, num_workers=1,
                     prepack={"world_size": 2, "batches_per_stream": 2})
    reused = _pack(config, str(tmp_path / "reused"), tokenizer_and_special, reuse=[copy])
    assert len(reused.streams) == 2 and _reuse(reused)[1] > 0 and not _reuse(reused)[2]
    build = Catalog.from_bytes(open(os.path.join(copy, CATALOG_NAME), "rb").read(), "catalog").build
    wanted = [PACK_INFO_NAME, CATALOG_NAME, fences_file(build), index_file(0), index_file(1)]
    built_from = [r for r in reads if r.endswith(".pixels.arrow")]  # each shard's pixel index, to build it
    assert sorted(r for r in reads if r not in built_from) == sorted(wanted), reads
    assert len(set(built_from)) == len(built_from) and bool(built_from) != catalog


def test_reuse_from_a_partly_trimmed_old_is_the_fresh_pack(old, tmp_path, tokenizer_and_special, monkeypatch):
    """reuse x bounded: OLD with some shards trimmed (a bounded pack behind its trainings): their
    pictures are decoded again, the rest are taken from OLD; the pack is the fresh one byte for byte."""
    import shutil

    from loader.reader import Pack
    from prepack.run.bounded.trim_policy import TrimPolicy

    monkeypatch.setenv(OWN_SETTING, "0")
    trimmed = str(tmp_path / "old")
    shutil.copytree(old["out"], trimmed)
    TrimPolicy(Pack.open(trimmed), lambda s: Pack.open(trimmed).num_records(s) // 2).apply()  # half of each stream
    p = Pack.open(trimmed)
    assert all(p.trimmed(s) and len(p.trimmed(s)) < len(p.index(s).shards) for s in range(p.num_streams))
    config = _config(old["ds"], str(tmp_path / "new.yaml"), seed=7)
    fresh = _pack(config, str(tmp_path / "fresh"), tokenizer_and_special)
    reused = _pack(config, str(tmp_path / "reused"), tokenizer_and_special, reuse=[trimmed])
    assert _files(str(tmp_path / "reused")) == _files(str(tmp_path / "fresh"))
    whole = _pack(config, str(tmp_path / "reused-whole"), tokenizer_and_special, reuse=[old["out"]])
    assert 0 < _reuse(reused)[1] < _reuse(whole)[1]  # fewer pictures taken from OLD: the trimmed ones decoded


def test_an_extension_packed_with_reuse_is_the_fresh_pack(old, tmp_path, tokenizer_and_special, monkeypatch):
    """reuse x extend: a pack extended with ``--reuse OLD`` (its new records' pictures from OLD) is, record
    for record, the pack packed at the larger budget at once (an extension starts a new shard where the
    smaller budget ended one: shard files differ, records do not) and the extension without reuse,
    byte for byte."""
    monkeypatch.setenv(OWN_SETTING, "0")
    small = _config(old["ds"], str(tmp_path / "small.yaml"), seed=7, prepack={"batches_per_stream": 3})
    big = _config(old["ds"], str(tmp_path / "big.yaml"), seed=7, prepack={"batches_per_stream": 6})
    extended = str(tmp_path / "extended")
    _pack(small, extended, tokenizer_and_special)
    summary = _pack(big, extended, tokenizer_and_special, reuse=[old["out"]])
    fresh, plain = str(tmp_path / "fresh"), str(tmp_path / "plain")
    _pack(big, fresh, tokenizer_and_special)
    _pack(small, plain, tokenizer_and_special)
    _pack(big, plain, tokenizer_and_special)
    assert _reuse(summary)[1] > 0
    assert _files(extended) == _files(plain)

    def records(out: str) -> list[list[str]]:
        from loader.reader import Pack

        p = Pack.open(out)
        return [[r.digest for sh in p.index(s).shards for r in sh.records] for s in range(p.num_streams)]

    assert records(extended) == records(fresh)
