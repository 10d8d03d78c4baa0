"""Shards on a store are read through blocks (``loader.reader._Blocks``): same bytes, same checks.

A ``SubTreeFileSystem`` over a local folder is a filesystem that is not local, so a pack read
through it takes the store's path (one request per block) without a store: every record must be
what the local read gives, and damage must be caught the same way.
"""

from __future__ import annotations

import os
import random
import shutil

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from loader import open_stream
from loader.reader import _Blocks
from schemas.errors import PackIntegrityError
from schemas.layout import shard_file
from tests.helpers.packs import build_pack
from tests.helpers.s3checks import batch_fingerprint


class _Counting:
    """A NativeFile stand-in that counts the reads reaching it (requests, on a store)."""

    def __init__(self, data: bytes):
        self._file = pa.BufferReader(data)
        self.fetches = 0

    def seek(self, pos: int) -> None:
        self._file.seek(pos)

    def read_buffer(self, n: int) -> pa.Buffer:
        self.fetches += 1
        return self._file.read_buffer(n)


def test_blocks_serve_every_read_with_the_file_bytes():
    rng = random.Random(7)
    data = bytes(rng.randrange(256) for _ in range(100_000))
    raw = _Counting(data)
    f = _Blocks(raw, len(data), block=4096)
    for _ in range(500):
        pos, n = rng.randrange(len(data) + 10), rng.choice([1, 10, 300, 4095, 4096, 9000])
        f.seek(pos)
        assert bytes(f.read(n)) == data[pos:pos + n]
    assert f.seek(0, 2) == len(data) and bytes(f.read(5)) == b""


def test_sequential_small_reads_cost_one_fetch_per_block():
    data = os.urandom(64 * 1024)
    raw = _Counting(data)
    f = _Blocks(raw, len(data), block=16 * 1024)
    got = bytearray()
    while chunk := f.read(1000):
        got += bytes(chunk)
    assert bytes(got) == data and raw.fetches == 5  # a block at each read that straddles the last one, the tail whole


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tokenizer_and_special) -> str:
    return build_pack(str(tmp_path_factory.mktemp("blocks")), tokenizer_and_special)


def _remote(out: str) -> tuple[str, pafs.FileSystem]:
    parent, name = os.path.split(out)
    return name, pafs.SubTreeFileSystem(parent, pafs.LocalFileSystem())


def _prints(out: str, stream: int, fs=None) -> list[str]:
    return [batch_fingerprint(b) for b in open_stream(out, stream=stream, filesystem=fs)]


def test_a_pack_read_through_blocks_is_the_local_read(pack):
    name, fs = _remote(pack)
    assert fs.type_name != "local"
    for stream in (0, 1):
        assert _prints(name, stream, fs) == _prints(pack, stream)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damage_read_through_blocks_is_caught(pack, tmp_path, damage):
    out = str(tmp_path / "out")
    shutil.copytree(pack, out)
    path = os.path.join(out, shard_file(0, 0))
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF  # inside a record's body
    else:
        del data[len(data) - 100:]
    open(path, "wb").write(bytes(data))
    name, fs = _remote(out)
    with pytest.raises(PackIntegrityError, match="shard-00000"):
        _prints(name, 0, fs)
    with pytest.raises(PackIntegrityError, match="shard-00000"):
        _prints(out, 0)


def test_a_projected_read_through_a_store_reads_what_the_local_one_does(pack):
    from loader.reader import Pack, read_shard
    from schemas.record import RECORD_SCHEMA

    name, fs = _remote(pack)
    columns = [RECORD_SCHEMA.field(0).name]
    local, remote = Pack.open(pack), Pack.open(name, filesystem=fs)
    for shard in local.index(0).shards:
        mine = [(i, r.to_pylist()) for i, r in read_shard(remote, shard, columns=columns)]
        assert mine == [(i, r.to_pylist()) for i, r in read_shard(local, shard, columns=columns)] and mine
