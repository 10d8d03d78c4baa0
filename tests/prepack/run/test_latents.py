"""``prepack latents``: the frozen VAE encoder's moments of every record, stored beside its shard (issue 51).

The oracle is NeMo AutoModel's own autoencoder (``load_bagel_autoencoder`` of the same random
``ae.safetensors``, BAGEL's channel sizes) run on NeMo's own canvas: on the CPU in fp32 the stored
moments are its output bit for bit, cropped to the latent rows BAGEL reads.  Then the file itself
(what made it, the digests tying it to its shard, the stream's ``latents.json``), and the stage's
guarantees: a killed run resumes to the same bytes, a second run writes nothing, other weights
are refused, ``follow`` runs beside a pack being written, trimmed shards are skipped, the command
line, and the Ray path (slow) gives the same bytes as in-process.

Pictures are tiny (fakepack: at most 64 x 64; the real pack: 32..64 pixels a side): the encoder
has BAGEL's real widths and is slow on a CPU.  Every encode runs on one torch thread
(``one_torch_thread``): fp32 CPU convolutions differ in their last bits with the thread count, and
``test_the_bytes_do_not_depend_on_the_cpu_thread_count`` asks the stage for bytes that do not.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import xxhash

from loader.batch import SimpleCustomBatch
from loader.reader import Pack, read_shard
from prepack.cli import main
from prepack.run.latents import stage as latents_stage
from prepack.run.latents.stage import LatentsOptions, read_listing, run_latents
from prepack.run.bounded.trim import trim_shards
from prepack.run.commit.writer import write_index
from schemas.errors import UsageError
from schemas.latents import LatentsFile, StreamLatents
from schemas.layout import done_file, shard_latents_file, stream_latents_file
from schemas.location import resolve_location
from schemas.manifest import StreamIndex
from schemas.record import record_to_batch
from tests.helpers.fakepack import make_pack, mark_done
from tests.helpers.latents import (
    SCALE_FACTOR,
    SHIFT_FACTOR,
    Z_CHANNELS,
    latents_bytes,
    load_reference_autoencoder,
    reference_canvas,
    reference_moments,
    snapshot,
    write_weights,
)
from tests.helpers.paths import REPO

LENGTHS = [4, 3]  # records per stream: W=1 rank x K=2 workers
SHARD_BYTES = 24 * 1024  # stream 0: four shards of one record, stream 1: a shard of two records and one of one


class Killed(BaseException):
    """What a kill looks like from inside the stage: nothing after it runs."""


def options(weights: str, **kw) -> LatentsOptions:
    return LatentsOptions(weights=weights, device="cpu", inline=True, bar=False, **kw)


def copy_pack(src: str, tmp_path, name: str = "pack") -> str:
    out = str(tmp_path / name)
    shutil.copytree(src, out)
    return out


def assert_same_bytes(got: "dict[str, bytes]", want: "dict[str, bytes]") -> None:
    """The same latents files and listings, byte for byte (naming those that differ)."""
    assert sorted(got) == sorted(want)
    differ = sorted(k for k in want if got[k] != want[k])
    assert not differ, f"differ from an uninterrupted in-process run: {differ}"


def error_line(err: str) -> str:
    """The one line a refused command prints (and no traceback)."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("prepack: error: "), err
    return lines[0]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Every encode here (the stage's and the reference's) on one torch thread: as NeMo's recipe runs
    on a CPU in these tests (``tests.helpers.nemo_cpu``) and as a Ray actor of ``num_cpus=1`` runs
    (Ray sets OMP_NUM_THREADS=1); fp32 convolutions on a CPU differ in their last bits with the
    thread count (see ``test_the_bytes_do_not_depend_on_the_cpu_thread_count``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    return write_weights(str(tmp_path_factory.mktemp("vae") / "ae.safetensors"))


@pytest.fixture(scope="module")
def autoencoder(weights):
    return load_reference_autoencoder(weights)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> str:
    """A finished fake pack without latents (copy it before writing to it)."""
    out = str(tmp_path_factory.mktemp("fresh") / "pack")
    make_pack(out, world_size=1, num_workers=2, lengths=LENGTHS, shard_bytes=SHARD_BYTES)
    pack = Pack.open(out)
    assert len(pack.index(0).shards) >= 3 and any(len(sh.records) > 1 for sh in pack.index(1).shards)
    return out


@pytest.fixture(scope="module")
def encoded(one_torch_thread, fresh, weights, tmp_path_factory) -> dict:
    """``fresh`` encoded by one uninterrupted in-process run: the bytes every other run must give."""
    out = copy_pack(fresh, tmp_path_factory.mktemp("encoded"))
    written = run_latents(out, options(weights))
    return {"out": out, "written": written, "bytes": latents_bytes(out)}


# --- 1. the moments are the reference encoder's, bit for bit ----------------------------------------
def test_moments_are_the_reference_encoders_bit_for_bit(encoded, autoencoder):
    pack = Pack.open(encoded["out"])
    images, cropped = 0, 0
    for s in range(pack.num_streams):
        for shard in pack.index(s).shards:
            path = os.path.join(encoded["out"], shard_latents_file(s, shard.shard))
            with open(path, "rb") as f:
                stored = LatentsFile(f.read(), path)
            for j, (_, record) in enumerate(read_shard(pack, shard)):
                batch = record_to_batch(record)
                got = stored.moments(j)
                shapes = np.asarray(batch.vae_latent_shapes).reshape(-1, 2).tolist()
                assert len(got) == len(shapes) == len(batch.vae_image_ids)
                if not shapes:
                    continue
                canvas = reference_canvas(batch)  # NeMo's transform and padding
                assert torch.equal(canvas, SimpleCustomBatch(batch).padded_images)  # the loader's: the same tensor
                want = reference_moments(autoencoder, canvas, shapes)
                for k, (m, w) in enumerate(zip(got, want)):
                    assert m.dtype == np.float32 and m.shape == tuple(w.shape) == (2 * Z_CHANNELS, *w.shape[1:])
                    where = f"stream {s} shard {shard.shard} record {j} image {k}"
                    assert torch.equal(torch.from_numpy(m.copy()), w), where
                    images += 1
                    cropped += tuple(w.shape[1:]) != (canvas.shape[2] // 8, canvas.shape[3] // 8)
    assert images >= 10 and cropped >= 3, (images, cropped)  # several pictures, several cropped from a larger canvas


@pytest.fixture(scope="module")
def real(one_torch_thread, tmp_path_factory, tokenizer_and_special) -> dict:
    """A small real pack (t2i pictures resized to 32..64 a side: a canvas of a few tiny pictures)
    and its config, for the reference PackedDataset."""
    from prepack.run.driver import RunOptions, run_pack
    from schemas.config_file import load_config
    from tests.helpers import datagen as dg

    root = tmp_path_factory.mktemp("real")
    os.makedirs(root / "data")
    rs = np.random.RandomState(0)
    ds = dg.Dataset(str(root / "data"))
    rows = [[{"image": dg.jpeg(dg.photo(4 * i + j, rs, 24, 72)), "captions": json.dumps({"c": dg.sentence(rs)})}
             for j in range(4)] for i in range(2)]
    dg.add_t2i(ds, rows, row_group_size=2)
    ds.groups["t2i_pretrain"]["image_transform_args"] = {"image_stride": 16, "max_image_size": 64, "min_image_size": 32}
    knobs = dict(expected_num_tokens=120, max_num_tokens=200, max_num_tokens_per_sample=150, prefer_buffer_before=80,
                 max_buffer_size=3, use_flex=True)
    cfg = load_config(ds.config(knobs=knobs, num_workers=1, prepack={"batches_per_stream": 3, "shard_bytes": 20_000}))
    out = str(root / "out")
    run_pack(cfg, out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    return {"cfg": cfg, "out": out}


def test_moments_of_the_reference_packed_datasets_own_canvas(real, weights, autoencoder, tokenizer_and_special):
    """The canvas is training's own: the reference PackedDataset's ``padded_images`` for this config,
    encoded by NeMo's autoencoder, gives the stored moments bit for bit."""
    from tests.helpers import oracle

    out, cfg = real["out"], real["cfg"]
    assert run_latents(out, options(weights)) == {0: 3}
    pack = Pack.open(out)
    refs = oracle.reference_batches(cfg, 0, tokenizer_and_special[0], 3)
    stored = []
    for shard in pack.index(0).shards:
        path = os.path.join(out, shard_latents_file(0, shard.shard))
        with open(path, "rb") as f:
            lf = LatentsFile(f.read(), path)
        stored += [lf.moments(j) for j in range(len(lf))]
    assert len(stored) == len(refs) == 3
    images = 0
    for i, (got, ref) in enumerate(zip(stored, refs)):
        shapes = ref["patchified_vae_latent_shapes"]
        want = reference_moments(autoencoder, ref["padded_images"], shapes)
        assert len(got) == len(want) and len(shapes) >= 2, i
        for k, (m, w) in enumerate(zip(got, want)):
            assert torch.equal(torch.from_numpy(m.copy()), w), f"batch {i} image {k}"
            images += 1
    assert images >= 8


# --- 2. the file: what made it, and the digests that tie it to its shard ------------------------------
def test_latents_file_and_listing_describe_what_made_them(encoded, weights):
    out = encoded["out"]
    pack = Pack.open(out)
    h = xxhash.xxh3_128()
    with open(weights, "rb") as f:
        h.update(f.read())
    weights_digest = h.hexdigest()
    assert encoded["written"] == {s: len(pack.index(s).shards) for s in range(pack.num_streams)}
    for s in range(pack.num_streams):
        index = pack.index(s)
        listing = read_listing(pack.location, s)
        assert isinstance(listing, StreamLatents) and listing.stream == s
        assert "nemo_automodel" in listing.encoder and listing.weights == weights_digest
        assert [e.shard for e in listing.shards] == [sh.shard for sh in index.shards]
        for shard, entry in zip(index.shards, listing.shards):
            path = os.path.join(out, shard_latents_file(s, shard.shard))
            with open(path, "rb") as f:
                data = f.read()
            lf = LatentsFile(data, path)
            info = lf.info
            assert "nemo_automodel" in info.encoder and info.encoder == listing.encoder
            assert info.weights == weights_digest
            assert (info.device, info.device_type, info.dtype, info.autocast) == ("cpu", "cpu", "float32", "none")
            assert info.z_channels == Z_CHANNELS
            assert (info.scale_factor, info.shift_factor) == (SCALE_FACTOR, SHIFT_FACTOR)
            assert lf.shard_digest == shard.xxh3
            assert lf.record_digests == [r.digest for r in shard.records] and len(lf) == len(shard.records)
            assert entry.size == len(data) == os.path.getsize(path)
            assert entry.digest == xxhash.xxh3_128(data).hexdigest()
            assert (entry.records, entry.device, entry.dtype) == (len(shard.records), "cpu", "float32")
            batches = [record_to_batch(r) for _, r in read_shard(pack, shard)]
            assert entry.images == sum(len(b.vae_image_ids) for b in batches)
            for j, b in enumerate(batches):
                shapes = np.asarray(b.vae_latent_shapes).reshape(-1, 2).tolist()
                assert [m.shape for m in lf.moments(j)] == [(2 * Z_CHANNELS, 2 * h_, 2 * w_) for h_, w_ in shapes]


# --- 3. a killed run resumes to the same bytes ----------------------------------------------------
def test_a_crash_between_a_file_and_its_listing_resumes_to_the_same_bytes(fresh, encoded, weights, tmp_path,
                                                                           monkeypatch):
    out = copy_pack(fresh, tmp_path)
    real_write = latents_stage.write_json_atomic
    calls = []

    def dies_at_the_third_listing(loc, relpath, obj):
        calls.append(relpath)
        if len(calls) == 3:
            raise Killed()  # after stream 0's shard 2 file, before its listing
        return real_write(loc, relpath, obj)

    monkeypatch.setattr(latents_stage, "write_json_atomic", dies_at_the_third_listing)
    with pytest.raises(Killed):
        run_latents(out, options(weights))
    monkeypatch.undo()
    loc = resolve_location(out)
    assert [e.shard for e in read_listing(loc, 0).shards] == [0, 1]
    unlisted = os.path.join(out, shard_latents_file(0, 2))
    assert os.path.exists(unlisted)
    with open(unlisted, "wb") as f:  # an unlisted file is not trusted, whatever it holds
        f.write(b"not the latents")
    leftovers = [os.path.join(out, shard_latents_file(0, 3)) + ".0123456789ab.tmp",
                 os.path.join(out, stream_latents_file(0)) + ".ba9876543210.tmp",
                 os.path.join(out, shard_latents_file(1, 0)) + ".tmp"]
    for p in leftovers:
        with open(p, "wb") as f:
            f.write(b"half a file")
    assert run_latents(out, options(weights)) == {0: encoded["written"][0] - 2, 1: encoded["written"][1]}
    assert_same_bytes(latents_bytes(out), encoded["bytes"])


def test_the_bytes_do_not_depend_on_the_cpu_thread_count(fresh, encoded, weights, tmp_path):
    """A run resumed on a machine with another core count, or in a Ray actor (``num_cpus=1``: Ray sets
    OMP_NUM_THREADS=1, so torch runs one intra-op thread) beside an in-process run on all cores, must
    write the same bytes: one stage, one set of bytes on one device kind (``prepack.run.latents.stage``)."""
    out = copy_pack(fresh, tmp_path)
    threads = torch.get_num_threads()  # 1 (one_torch_thread)
    other = 2
    torch.set_num_threads(other)
    try:
        assert run_latents(out, options(weights, streams=(1,))) == {1: encoded["written"][1]}
    finally:
        torch.set_num_threads(threads)
    got = latents_bytes(out)
    want = {k: v for k, v in encoded["bytes"].items() if k.startswith("stream-00001/")}
    assert got.keys() == want.keys()
    differ = sorted(k for k in want if got[k] != want[k])
    assert not differ, f"encoded with {other} torch thread(s) instead of {threads}: {differ} differ"


@pytest.mark.slow  # a subprocess: imports torch and NeMo, loads the encoder (~10 s)
def test_sigkill_after_the_first_listing_resumes_to_the_same_bytes(fresh, encoded, weights, tmp_path):
    out = copy_pack(fresh, tmp_path)
    listing = os.path.join(out, stream_latents_file(0))
    cmd = [sys.executable, "-m", "prepack.cli", "latents", out, "--vae", weights, "--device", "cpu", "--no-ray",
           "--no-bar"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one torch thread, as this process (see one_torch_thread)
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(listing):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "no listing after 120 s"
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL
    done = read_listing(resolve_location(out), 0)
    assert done is not None and 1 <= len(done.shards) < len(Pack.open(out).index(0).shards)
    written = run_latents(out, options(weights))
    assert sum(written.values()) == sum(encoded["written"].values()) - len(done.shards)
    assert_same_bytes(latents_bytes(out), encoded["bytes"])


# --- 4. a second run writes nothing; other weights are refused ---------------------------------------
def test_a_second_run_writes_nothing_and_other_weights_are_refused(encoded, weights, tmp_path, capsys):
    out = copy_pack(encoded["out"], tmp_path)
    before = snapshot(out)
    assert run_latents(out, options(weights)) == {0: 0, 1: 0}
    assert snapshot(out) == before
    other = write_weights(str(tmp_path / "other.safetensors"), seed=1)
    with pytest.raises(UsageError) as refused:
        run_latents(out, options(other))
    message = str(refused.value)
    assert "\n" not in message and os.path.join(out, stream_latents_file(0)) in message, message
    assert main(["latents", out, "--vae", other, "--device", "cpu", "--no-ray", "--no-bar", "--streams", "1"]) == 2
    line = error_line(capsys.readouterr().err)
    assert os.path.join(out, stream_latents_file(1)) in line, line
    assert snapshot(out) == before


# --- 5. follow: beside a pack being written --------------------------------------------------------
def test_follow_encodes_shards_as_they_are_committed(fresh, encoded, weights, tmp_path):
    out = copy_pack(fresh, tmp_path)
    loc = resolve_location(out)
    src = Pack.open(fresh)
    full = [src.index(s) for s in range(src.num_streams)]
    for index in full:  # a pack being written: each stream's first shard committed, not done
        write_index(loc, StreamIndex(index.stream, index.shards[:1], index.ckpt0_json_sha256,
                                     index.ckpt0_arrow_sha256))
        os.remove(os.path.join(out, done_file(index.stream)))
    result, errors = {}, []

    def run():
        try:
            result.update(run_latents(out, options(weights, follow=True, poll_s=0.05)))
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while read_listing(loc, 0) is None:
        assert not errors and time.monotonic() < deadline, errors
        time.sleep(0.02)
    time.sleep(0.5)
    assert t.is_alive() and not errors  # waiting for the rest of stream 0
    assert [e.shard for e in read_listing(loc, 0).shards] == [0] and read_listing(loc, 1) is None
    identity = Pack.open(out).identity
    for index in full:  # the packer commits the rest, then finishes each stream
        write_index(loc, index)
        time.sleep(0.1)
    time.sleep(0.3)
    assert t.is_alive()  # done.json not there yet: a stream may still grow
    for index in full:
        mark_done(loc, identity, index, 2)
    t.join(120)
    assert not t.is_alive() and not errors, errors
    assert result == encoded["written"]
    assert_same_bytes(latents_bytes(out), encoded["bytes"])


# --- 6. trimmed shards are skipped ------------------------------------------------------------------
def test_trimmed_shards_are_skipped(fresh, encoded, weights, tmp_path):
    out = copy_pack(fresh, tmp_path)
    pack = Pack.open(out)
    index = pack.index(0)
    trim_shards(pack, 0, [index.shards[0], index.shards[2]])
    assert run_latents(out, options(weights)) == {0: len(index.shards) - 2, 1: encoded["written"][1]}
    listing = read_listing(pack.location, 0)
    kept = [sh.shard for sh in index.shards if sh.shard not in (index.shards[0].shard, index.shards[2].shard)]
    assert [e.shard for e in listing.shards] == kept
    for sh in (index.shards[0], index.shards[2]):
        assert not os.path.exists(os.path.join(out, shard_latents_file(0, sh.shard)))
    want = {k: v for k, v in encoded["bytes"].items() if not k.startswith("stream-00000/")}
    got = latents_bytes(out)
    assert {k: v for k, v in got.items() if not k.startswith("stream-00000/")} == want
    for shard in kept:
        name = shard_latents_file(0, shard)
        assert got[name] == encoded["bytes"][name]


def test_a_shard_trimmed_after_its_latents_is_not_encoded_again(encoded, weights, tmp_path):
    """A trim takes the shard's latents file with it and keeps its listing entry (what a restore
    makes again): a later run writes nothing for it."""
    out = copy_pack(encoded["out"], tmp_path)
    pack = Pack.open(out)
    shard = pack.index(0).shards[1]
    listing = read_listing(pack.location, 0)
    trim_shards(pack, 0, [shard])
    assert not os.path.exists(os.path.join(out, shard_latents_file(0, shard.shard)))
    assert run_latents(out, options(weights)) == {0: 0, 1: 0}
    assert read_listing(pack.location, 0) == listing
    assert not os.path.exists(os.path.join(out, shard_latents_file(0, shard.shard)))


# --- 7. the command line -------------------------------------------------------------------------------
def test_cli_refuses_a_missing_vae_file_and_a_missing_cuda(fresh, weights, tmp_path, capsys):
    out = copy_pack(fresh, tmp_path)
    before = snapshot(out)
    assert main(["latents", out, "--vae", str(tmp_path / "missing.safetensors"), "--no-ray", "--no-bar"]) == 2
    line = error_line(capsys.readouterr().err)
    assert "--vae" in line and "missing.safetensors" in line, line
    assert not torch.cuda.is_available()
    assert main(["latents", out, "--vae", weights, "--device", "cuda", "--no-ray", "--no-bar"]) == 2
    line = error_line(capsys.readouterr().err)
    assert "--device cuda" in line and "CUDA" in line, line
    assert main(["latents", str(tmp_path / "nowhere"), "--vae", weights, "--device", "cpu", "--no-ray"]) != 0
    assert "nowhere" in error_line(capsys.readouterr().err)
    assert main(["latents", out, "--vae", weights, "--device", "cpu", "--no-ray", "--streams", "7"]) == 2
    assert "stream 7" in error_line(capsys.readouterr().err)
    assert snapshot(out) == before  # nothing written by a refused run


@pytest.mark.parametrize("kind", ["not_safetensors", "without_the_encoder"])
def test_cli_refuses_a_vae_file_that_is_not_the_vaes_weights(kind, fresh, tmp_path, capsys):
    """A ``--vae`` that is not a safetensors file, or one without the encoder's weights (NeMo loads
    with strict=False: the encoder would run on its random initial weights, which no training has),
    is a user mistake: one line, and nothing written."""
    out = copy_pack(fresh, tmp_path)
    before = snapshot(out)
    vae = str(tmp_path / f"{kind}.safetensors")
    if kind == "not_safetensors":
        with open(vae, "wb") as f:
            f.write(b"not a safetensors file")
    else:
        write_weights(vae, only="decoder.conv_out.bias")
    code = main(["latents", out, "--vae", vae, "--device", "cpu", "--no-ray", "--no-bar"])
    err = capsys.readouterr().err
    assert code in (1, 2), f"--vae {vae}: exit {code}\n{err[-3000:]}"
    assert vae in error_line(err)
    assert snapshot(out) == before, "files written"


def test_cli_help_teaches(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["latents", "--help"])
    assert ended.value.code == 0
    text = capsys.readouterr().out
    for word in ("--vae", "--encoder", "--device", "--follow", "--no-ray", "--streams", "examples:",
                 "prepack latents /data/packed --vae"):
        assert word in text, word
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "latents" in capsys.readouterr().out


def test_cli_encodes_and_prints_its_summary(fresh, encoded, weights, tmp_path, capsys):
    out = copy_pack(fresh, tmp_path)
    assert main(["latents", out, "--vae", weights, "--device", "cpu", "--no-ray", "--no-bar", "--streams", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().splitlines()[-1] == f"latents: {encoded['written'][1]} shard(s) encoded in 1 stream(s)"
    assert_same_bytes(latents_bytes(out), {k: v for k, v in encoded["bytes"].items() if k.startswith("stream-00001/")})


# --- 8. on Ray: the same bytes -------------------------------------------------------------------------
@pytest.mark.slow  # starts a local Ray
def test_on_ray_gives_the_same_bytes_as_in_process(fresh, encoded, weights, tmp_path):
    from tests.helpers.ray_helpers import RayRun, prepack

    out = copy_pack(fresh, tmp_path)
    with RayRun() as rr:
        refused = rr.run(prepack("latents", out, "--vae", weights, "--device", "cuda", "--no-bar"), timeout=300)
        r = rr.run(prepack("latents", out, "--vae", weights, "--device", "cpu", "--no-bar"), timeout=300)
    assert refused.returncode == 2 and "no GPU" in error_line(refused.stderr), refused.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-4000:]
    total = sum(encoded["written"].values())
    assert r.stdout.strip().splitlines()[-1] == f"latents: {total} shard(s) encoded in 2 stream(s)", r.stdout
    assert_same_bytes(latents_bytes(out), encoded["bytes"])


def _store_latents(uri: str) -> "dict[str, bytes]":
    """``latents_bytes`` of a pack on a store: relpath -> bytes."""
    import pyarrow.fs as pafs

    loc = resolve_location(uri)
    infos = loc.fs.get_file_info(pafs.FileSelector(loc.base, recursive=True))
    return {i.path[len(loc.base) + 1:]: loc.read_bytes(i.path[len(loc.base) + 1:]) for i in infos
            if i.type == pafs.FileType.File and (i.base_name.endswith(".latents.arrow") or i.base_name == "latents.json")}


def test_on_s3_with_reuse_and_an_extension(real, weights, s3, tmp_path, tokenizer_and_special):
    """The real pack packed again onto S3 (SeaweedFS) with ``--reuse`` of the local one, encoded there:
    its latents are the local pack's byte for byte; both extended by a batch and encoded again, only
    the new shard is encoded, and still the same bytes; ``vae_latents=True`` reads the same latents
    from the store as from disk, and over a continuation of the local pack (its parent's latents, then
    its own)."""
    from dataclasses import replace

    from loader import PackedShardDataset
    from prepack.run.driver import RunOptions, run_pack

    local, uri = copy_pack(real["out"], tmp_path, "local"), s3.new_prefix("latents-reuse")
    run_pack(real["cfg"], uri, RunOptions(inline=True, bar=False, reuse=(local,)), tokenizer=tokenizer_and_special)
    run_latents(uri, options(weights)), run_latents(local, options(weights))  # (the local one may be encoded already)
    assert _store_latents(uri) == latents_bytes(local) != {}
    cfg = replace(real["cfg"], prepack=replace(real["cfg"].prepack, batches_per_stream=4))
    before = len(Pack.open(local).index(0).shards)
    for where in (uri, local):
        run_pack(cfg, where, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    written = run_latents(uri, options(weights))
    assert written == run_latents(local, options(weights)) and 0 < written[0] <= len(Pack.open(local).index(0).shards) - before
    assert _store_latents(uri) == latents_bytes(local)
    got = [b.to_dict()["padded_latent"] for b in PackedShardDataset(uri, rank=0, world_size=1, vae_latents=True)]
    want = [b.to_dict()["padded_latent"] for b in PackedShardDataset(local, rank=0, world_size=1, vae_latents=True)]
    assert len(got) == len(want) == 4 and all(torch.equal(a, b) for a, b in zip(got, want))
    # a continuation of the local pack after 2 batches (the same config: the same records), encoded on its
    # own: the loader reads the parent's latents before the switch and its own after
    from prepack.run.chain import Continue

    cont = str(tmp_path / "continued")
    run_pack(replace(cfg, prepack=replace(cfg.prepack, batches_per_stream=2)), cont,
             RunOptions(inline=True, bar=False, continue_from=Continue(local, 2, None)), tokenizer=tokenizer_and_special)
    assert run_latents(cont, options(weights))[0] > 0
    chained = [b.to_dict()["padded_latent"] for b in PackedShardDataset(cont, rank=0, world_size=1, vae_latents=True)]
    assert len(chained) == 4 and all(torch.equal(a, b) for a, b in zip(chained, want))


def test_a_balanced_scheduled_pack_encoded_by_two_runs_at_once(weights, tmp_path, tokenizer_and_special):
    """Latents of a balanced-samples pack under a schedule (W=2 ranks): encoded by two runs of disjoint
    ``--streams`` at once, the bytes one run makes; verify passes; ``vae_latents=True`` reads each
    balanced batch's latents on both ranks."""
    from loader import PackedShardDataset
    from prepack.run.driver import RunOptions, run_pack
    from prepack.tools.verify import verify_pack
    from schemas.config_file import load_config
    from tests.helpers import datagen as dg

    os.makedirs(tmp_path / "data")
    rs = np.random.RandomState(1)
    ds = dg.Dataset(str(tmp_path / "data"))
    dg.add_t2i(ds, [[{"image": dg.jpeg(dg.photo(4 * i + j, rs, 24, 72)), "captions": json.dumps({"c": dg.sentence(rs)})}
                     for j in range(4)] for i in range(4)], row_group_size=2)
    ds.groups["t2i_pretrain"]["image_transform_args"] = {"image_stride": 16, "max_image_size": 64, "min_image_size": 32}
    lines, files = dg.good_sft(rs, 8)
    dg.add_sft(ds, lines, files)
    knobs = dict(expected_num_tokens=120, max_num_tokens=200, max_num_tokens_per_sample=150, prefer_buffer_before=80,
                 max_buffer_size=3, use_flex=True)
    schedule = [{"after": 1, "set": {"dataset.grouped_datasets.vlm_sft.weight": 3.0}}]
    cfg = load_config(ds.config(knobs=knobs, num_workers=1, prepack={
        "batches_per_stream": 3, "shard_bytes": 20_000, "world_size": 2, "balance": "samples", "schedule": schedule}))
    out = str(tmp_path / "out")
    run_pack(cfg, out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    one = copy_pack(out, tmp_path, "one")
    run_latents(one, options(weights))
    runs = [threading.Thread(target=run_latents, args=(out, options(weights, streams=[s]))) for s in (0, 1)]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    assert latents_bytes(out) == latents_bytes(one) != {}
    rep = verify_pack(out)
    assert rep.ok, [r for r in rep.rows if not r.ok]
    latents = [b.to_dict().get("padded_latent") for r in range(2)
               for b in PackedShardDataset(out, rank=r, world_size=2, vae_latents=True)]
    assert len(latents) == 6 and sum(x is not None for x in latents) >= 4


def test_follow_beside_two_packing_jobs_encodes_what_a_run_after_them_does(real, weights, tmp_path, monkeypatch,
                                                                          tokenizer_and_special):
    """latents x many jobs: ``prepack latents --follow`` started with two jobs packing one stream each
    encodes every shard as its job commits it, and ends once both are done: the latents one run
    makes of the finished pack, byte for byte."""
    from dataclasses import replace

    from prepack.run.driver import RunOptions, run_pack

    cfg = replace(real["cfg"], prepack=replace(real["cfg"].prepack, world_size=2))
    plain = str(tmp_path / "plain")
    run_pack(cfg, plain, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    run_latents(plain, options(weights))
    out, errors, written = str(tmp_path / "out"), [], {}
    from prepack.run.commit.writer import StreamWriter

    append = StreamWriter.append  # a moment per batch: the follower starts well before the jobs end
    monkeypatch.setattr(StreamWriter, "append", lambda self, batch: (time.sleep(0.3), append(self, batch))[1])

    def guarded(call):
        def run():
            try:
                call()
            except BaseException as e:  # noqa: BLE001 (asserted below)
                errors.append(e)
        return threading.Thread(target=run, daemon=True)

    jobs = [guarded(lambda s=s: run_pack(cfg, out, RunOptions(inline=True, bar=False, streams=[s]),
                                         tokenizer=tokenizer_and_special)) for s in (0, 1)]
    for t in jobs:
        t.start()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out, "pack.json")):
        assert not errors and time.monotonic() < deadline, errors
        time.sleep(0.02)
    follower = guarded(lambda: written.update(run_latents(out, options(weights, follow=True, poll_s=0.05))))
    follower.start()
    assert any(t.is_alive() for t in jobs), "both jobs ended before the follower started (inconclusive)"
    for t in jobs + [follower]:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in jobs + [follower]), errors
    assert written and sum(written.values()) == sum(len(Pack.open(out).index(s).shards) for s in (0, 1))
    assert_same_bytes(latents_bytes(out), latents_bytes(plain))
