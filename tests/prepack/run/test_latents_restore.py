"""A pack's VAE latents under ``verify``, ``trim`` and ``restore`` (issue 51): verify catches a
damaged, a missing and a foreign latents file and a damaged listing; a trimmed shard's latents
go with its records, and ``prepack restore --vae`` makes them again byte for byte, or refuses in
one line, before any work, without the weights or with other weights."""

from __future__ import annotations

import os
import shutil

import pytest

from loader.reader import Pack
from prepack.cli import main
from prepack.run.latents.stage import LatentsOptions, LatentsRestore, run_latents
from prepack.run.bounded.restore import restore
from prepack.run.bounded.trim import trim_shards
from prepack.tools.verify import verify_pack
from schemas.errors import PackRefused
from schemas.layout import shard_file, shard_latents_file, stream_latents_file
from tests.helpers.latents import write_weights
from tests.helpers.packs import build_pack


@pytest.fixture(scope="module")
def encoded(tmp_path_factory, tokenizer_and_special):
    """A small real pack (2 streams, 2 shards each) with its latents, and the weights."""
    root = tmp_path_factory.mktemp("latents-restore")
    out = build_pack(str(root), tokenizer_and_special, batches=3, shard_bytes=300_000)
    weights = write_weights(str(root / "ae.safetensors"))
    run_latents(out, LatentsOptions(weights=weights, device="cpu", inline=True, bar=False))
    return out, weights


def _copy(src: str, dst) -> str:
    shutil.copytree(src, str(dst))
    return str(dst)


def _latents_rows(report):
    return [r for r in report.rows if r.check == "latents"]


def test_verify_passes_a_pack_with_latents_and_catches_damage(encoded, tmp_path):
    out, _ = encoded
    good = verify_pack(out)
    rows = _latents_rows(good)
    assert not good.failures() and len(rows) == sum(len(Pack.open(out).index(s).shards) for s in range(2))
    bad = _copy(out, tmp_path / "bad")
    damaged = os.path.join(bad, shard_latents_file(0, 0))
    data = bytearray(open(damaged, "rb").read())
    data[len(data) // 3] ^= 0x10
    open(damaged, "wb").write(bytes(data))
    os.remove(os.path.join(bad, shard_latents_file(1, 1)))
    shutil.copy(os.path.join(out, shard_latents_file(1, 0)), os.path.join(bad, shard_latents_file(0, 1)))
    failed = {r.target: r.detail for r in verify_pack(bad).failures()}
    assert "damaged" in failed[shard_latents_file(0, 0)]
    assert "missing" in failed[shard_latents_file(1, 1)]
    assert shard_latents_file(0, 1) in failed  # another shard's file: its size or digest gives it away
    listing = os.path.join(bad, stream_latents_file(1))
    open(listing, "a").write(" ")
    assert any(r.target == stream_latents_file(1) for r in verify_pack(bad).failures())
    assert main(["verify", bad]) == 1


def test_a_trimmed_shards_latents_are_restored_byte_for_byte(encoded, tmp_path):
    out, weights = encoded
    pack_dir = _copy(out, tmp_path / "trimmed")
    name = os.path.join(pack_dir, shard_latents_file(0, 0))
    before = open(name, "rb").read()
    pack = Pack.open(pack_dir)
    trim_shards(pack, 0, [pack.index(0).shards[0]])
    assert not os.path.exists(name) and not os.path.exists(os.path.join(pack_dir, shard_file(0, 0)))
    assert not verify_pack(pack_dir).failures()  # a trimmed shard's latents may be gone
    with pytest.raises(PackRefused, match="it had VAE latents: give --vae"):
        restore(pack_dir, {0: (0, None)})
    other = write_weights(str(tmp_path / "other.safetensors"), seed=1)
    with pytest.raises(PackRefused, match="is not the weights its latents were encoded with"):
        restore(pack_dir, {0: (0, None)}, latents=LatentsRestore(other))
    assert not os.path.exists(os.path.join(pack_dir, shard_file(0, 0)))  # refused before any work
    assert restore(pack_dir, {0: (0, None)}, latents=LatentsRestore(weights)) == {0: [0]}
    assert open(name, "rb").read() == before
    assert not verify_pack(pack_dir).failures()


def test_restore_cli_says_why_in_one_line(encoded, tmp_path, capsys):
    out, weights = encoded
    pack_dir = _copy(out, tmp_path / "cli")
    pack = Pack.open(pack_dir)
    trim_shards(pack, 1, [pack.index(1).shards[1]])
    assert main(["restore", pack_dir, "--streams", "1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give --vae" in err[0]
    assert main(["restore", pack_dir, "--streams", "1", "--vae", weights]) == 0
    assert "restored 1 shard(s)" in capsys.readouterr().out
    assert os.path.exists(os.path.join(pack_dir, shard_latents_file(1, 1)))
