"""DirectFile: exact bytes through O_DIRECT (aligned staging, padded tail, truncate), and the
fallbacks to the page cache when a filesystem refuses O_DIRECT at open or at a write."""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np
import pytest

import prepack.run.commit.direct_file as direct_file
from prepack.run.commit.direct_file import DirectFile
from tests.helpers.fakepack import stream_batches
from schemas.layout import shard_file
from tests.prepack.run.test_writer import write_stream

STAGING = direct_file._STAGING


def _chunks(seed: int, total: int) -> list[bytes]:
    """Random pieces (1 byte to just over a staging buffer) adding up to ``total`` bytes."""
    rs = np.random.RandomState(seed)
    out, n = [], 0
    while n < total:
        size = int(min(total - n, rs.choice([1, 7, 4095, 4096, 4097, 65_537, STAGING - 3, STAGING + 5])))
        out.append(rs.randint(0, 256, size, dtype=np.uint8).tobytes())
        n += size
    return out


def _direct_supported(path) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.remove(path)
    return True


@pytest.mark.parametrize("total", [0, 1, 4096, 5000, STAGING, 3 * STAGING + 12_345])
def test_bytes_and_size_are_exact(tmp_path, total):
    chunks = _chunks(total, total)
    path = tmp_path / "f.bin"
    with DirectFile(str(path)) as f:
        for c in chunks:
            assert f.write(c) == len(c)
        assert f.tell() == total
    assert path.read_bytes() == b"".join(chunks)


def test_files_sharing_one_staging_buffer_each_hold_exactly_their_bytes(tmp_path):
    """A writer lends one buffer to each shard in turn: a shorter file after a longer one must not
    carry the longer one's leftover bytes, and the lent buffer outlives each file."""
    staging = direct_file.staging_buffer()
    sizes = [STAGING + 70_001, 5_000, 0, 2 * STAGING + 3, 1]
    for i, total in enumerate(sizes):
        chunks = _chunks(100 + i, total)
        path = tmp_path / f"f{i}.bin"
        with DirectFile(str(path), staging) as f:
            for c in chunks:
                f.write(c)
        assert path.read_bytes() == b"".join(chunks), total
    assert not staging.closed
    with pytest.raises(ValueError, match="staging buffer"):
        DirectFile(str(tmp_path / "bad.bin"), staging=mmap.mmap(-1, 4096))
    assert not (tmp_path / "bad.bin").exists()  # refused before the file was made


def test_flush_midway_then_more_writes(tmp_path):
    """A flush writes the padded tail and truncates; later writes rewrite that block in place."""
    chunks = _chunks(1, 2 * STAGING + 999)
    path = tmp_path / "f.bin"
    f = DirectFile(str(path))
    written = b""
    for i, c in enumerate(chunks):
        f.write(c)
        written += c
        if i % 2 == 0:
            f.flush()
            assert os.path.getsize(path) == len(written)
            assert path.read_bytes() == written
    f.close()
    f.close()  # idempotent
    assert path.read_bytes() == written


def test_uses_o_direct_where_the_filesystem_allows_it(tmp_path):
    if not _direct_supported(str(tmp_path / "probe")):
        pytest.skip("this filesystem has no O_DIRECT")
    with DirectFile(str(tmp_path / "f.bin")) as f:
        f.write(b"x" * 10_000)
        assert f.direct


def test_open_refused_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    chunks = _chunks(2, STAGING + 77)
    with DirectFile(str(tmp_path / "f.bin")) as f:
        for c in chunks:
            f.write(c)
        assert not f.direct
    assert (tmp_path / "f.bin").read_bytes() == b"".join(chunks)


def test_write_refused_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    if not _direct_supported(str(tmp_path / "probe")):
        pytest.skip("this filesystem has no O_DIRECT")
    real_pwrite = os.pwrite
    refused = []

    def refuse_once(fd, data, offset):
        if not refused:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refuse_once)
    chunks = _chunks(3, 2 * STAGING + 4321)
    with DirectFile(str(tmp_path / "f.bin")) as f:
        for c in chunks:
            f.write(c)
    assert refused and not f.direct
    assert (tmp_path / "f.bin").read_bytes() == b"".join(chunks)


def test_other_errors_are_raised(tmp_path, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    f = DirectFile(str(tmp_path / "f.bin"))
    f.write(b"abc")
    with pytest.raises(OSError, match="No space"):
        f.flush()
    monkeypatch.undo()
    f.close()
    assert (tmp_path / "f.bin").read_bytes() == b"abc"


def test_shards_are_the_same_bytes_with_and_without_o_direct(tmp_path, monkeypatch):
    batches = stream_batches(4, 5)
    direct_entries, _ = write_stream(tmp_path / "direct", batches)
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    buffered_entries, _ = write_stream(tmp_path / "buffered", batches)
    assert [e.xxh3 for e in direct_entries] == [e.xxh3 for e in buffered_entries]
    for e in direct_entries:
        rel = shard_file(0, e.shard)
        assert (tmp_path / "direct" / rel).read_bytes() == (tmp_path / "buffered" / rel).read_bytes()


def test_environment_can_turn_o_direct_off(tmp_path, monkeypatch):
    monkeypatch.setenv(direct_file.DIRECT_IO_ENV, "0")
    chunks = _chunks(4, 70_000)
    with DirectFile(str(tmp_path / "f.bin")) as f:
        for c in chunks:
            f.write(c)
        assert not f.direct
    assert (tmp_path / "f.bin").read_bytes() == b"".join(chunks)
