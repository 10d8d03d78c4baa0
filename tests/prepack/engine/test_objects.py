"""The object clients a source reads a store with (``prepack/engine/sources/objects.py``) and the
parquet reads built on them (``prepack/engine/sources/parquet.py``), on the real S3 test server."""

from __future__ import annotations

import errno
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prepack.engine.sources import files, objects
from prepack.engine.sources.parquet import FOOTER_READ, ParquetHandle, RecentHandles, _Spans
from schemas.errors import ConfigError

pytest.importorskip("obstore")


def _put(s3, uri: str, data: bytes) -> None:
    with s3.filesystem().open_output_stream(uri.split("://", 1)[1]) as f:
        f.write(data)


def _clients(s3, uri: str) -> dict[str, objects.ObjectClient]:
    authority = uri.split("://", 1)[1].split("/", 1)[0]
    fs = files._filesystem("s3", authority)
    return {which: objects.make_client("s3", authority, fs, {**os.environ, objects.CLIENT_ENV: which})
            for which in ("obstore", "pyarrow")}


def test_both_clients_read_the_same_bytes_ranges_and_tails(s3):
    uri = s3.new_prefix("objects")
    data = np.random.RandomState(0).bytes(300_000)
    _put(s3, f"{uri}/a.bin", data)
    _put(s3, f"{uri}/empty.bin", b"")
    key = f"{uri}/a.bin".split("://", 1)[1]
    clients = _clients(s3, uri)
    assert clients["obstore"].name == "obstore" and clients["pyarrow"].name == "pyarrow"
    for name, c in clients.items():
        assert c.get(key) == data, name
        assert c.get(key.replace("a.bin", "empty.bin")) == b"", name
        assert c.get_range(key, 1000, 70_000) == data[1000:70_000], name
        assert c.get_range(key, 299_990, 300_500) == data[299_990:], name  # past the end: what there is
        assert c.get_range(key, 5, 5) == b"", name
        assert c.tail(key, 4096) == (data[-4096:], len(data)), name
        assert c.tail(key, 10 << 20) == (data, len(data)), name  # a tail longer than the object


def test_a_missing_object_is_file_not_found_naming_it_with_either_client(s3):
    uri = s3.new_prefix("objects-missing")
    _put(s3, f"{uri}/there.bin", b"x")
    key = f"{uri}/not-there.jpg".split("://", 1)[1]
    for name, c in _clients(s3, uri).items():
        for call in (lambda: c.get(key), lambda: c.get_range(key, 0, 10), lambda: c.tail(key, 10)):
            with pytest.raises(FileNotFoundError) as e:
                call()
            assert "not-there.jpg" in str(e.value), name


def test_auto_reads_s3_with_obstore_when_the_keys_are_in_the_environment(s3, monkeypatch):
    uri = s3.new_prefix("objects-auto")
    _put(s3, f"{uri}/a.bin", b"hello")
    monkeypatch.delenv(objects.CLIENT_ENV, raising=False)
    client, key = files.objects_and_key(f"{uri}/a.bin")
    assert client.get(key) == b"hello"
    assert client.name == "obstore"
    monkeypatch.setenv(objects.CLIENT_ENV, "pyarrow")
    client, key = files.objects_and_key(f"{uri}/a.bin")
    assert client.name == "pyarrow" and client.get(key) == b"hello"


def test_a_bad_client_choice_is_one_clear_error():
    with pytest.raises(ConfigError, match="PREPACK_OBJECT_CLIENT"):
        objects.choice({objects.CLIENT_ENV: "boto"})
    assert objects.choice({}) == "auto" and objects.choice({objects.CLIENT_ENV: " PyArrow "}) == "pyarrow"


def test_credentials_from_a_profile_are_told_apart(tmp_path):
    home = str(tmp_path)
    assert not objects.credentials_from_profile({"HOME": home})  # nothing: instance or container credentials
    assert not objects.credentials_from_profile({"HOME": home, "AWS_ACCESS_KEY_ID": "k"})
    assert objects.credentials_from_profile({"HOME": home, "AWS_PROFILE": "research"})
    assert not objects.credentials_from_profile({"HOME": home, "AWS_PROFILE": "x", "AWS_WEB_IDENTITY_TOKEN_FILE": "/t"})
    os.makedirs(tmp_path / ".aws")
    (tmp_path / ".aws" / "credentials").write_text("[default]\naws_access_key_id = k\n")
    assert objects.credentials_from_profile({"HOME": home})
    fs = pa.fs.LocalFileSystem()
    assert objects.make_client("s3", "b", fs, {"HOME": home}).name == "pyarrow"  # object_store reads no profile
    assert objects.make_client("gs", "b", fs, {"HOME": home, "AWS_ACCESS_KEY_ID": "k"}).name == "pyarrow"


class _Fake:
    def __init__(self, name, fail=None):
        self.name, self.fail, self.calls = name, fail, 0

    def get(self, key):
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        return f"{self.name}:{key}".encode()


def test_obstore_failing_where_pyarrow_reads_hands_the_bucket_to_pyarrow_for_good():
    primary, fallback = _Fake("obstore", OSError(errno.EIO, "no credentials")), _Fake("pyarrow")
    c = objects._FirstUseFallback(primary, fallback, "s3://b")
    assert c.get("b/x") == b"pyarrow:b/x" and c.name == "pyarrow"
    assert c.get("b/y") == b"pyarrow:b/y" and primary.calls == 1  # not asked again


def test_a_missing_object_or_a_failing_store_does_not_decide_the_client():
    primary, fallback = _Fake("obstore", FileNotFoundError(errno.ENOENT, "no such object", "s3://b/x")), _Fake("pyarrow")
    c = objects._FirstUseFallback(primary, fallback, "s3://b")
    with pytest.raises(FileNotFoundError):
        c.get("b/x")
    assert fallback.calls == 0
    primary.fail = None
    assert c.get("b/y") == b"obstore:b/y" and c.name == "obstore"
    both = objects._FirstUseFallback(_Fake("obstore", OSError("down")), _Fake("pyarrow", OSError("down too")), "s3://b")
    with pytest.raises(OSError, match="down"):
        both.get("b/z")
    assert both._settled is None  # neither could read: decided by a later request


# -- parquet ------------------------------------------------------------------------------------

def _parquet(path, rows: int, row_group_size: int, wide: int = 0) -> pa.Table:
    rs = np.random.RandomState(rows)
    cols = {"image": [rs.bytes(int(rs.randint(100, 3000))) for _ in range(rows)],
            "captions": [f'{{"a": "caption {i}"}}' for i in range(rows)],
            "other": list(range(rows))}
    cols.update({f"extra_{i:04d}_{'x' * 40}": list(range(rows)) for i in range(wide)})  # a big footer
    table = pa.table(cols)
    pq.write_table(table, path, row_group_size=row_group_size)
    return table


class _Counting:
    def __init__(self, inner):
        self.inner, self.calls = inner, []

    @property
    def name(self):
        return self.inner.name

    def get(self, key):
        self.calls.append("get")
        return self.inner.get(key)

    def get_range(self, key, start, end):
        self.calls.append("range")
        return self.inner.get_range(key, start, end)

    def tail(self, key, n):
        self.calls.append("tail")
        return self.inner.tail(key, n)


@pytest.mark.parametrize("wide", [0, 400], ids=["small-footer", "footer-over-64KiB"])
def test_a_parquet_file_on_s3_reads_the_same_tables_with_one_request_per_row_group(s3, tmp_path, monkeypatch, wide):
    local = str(tmp_path / "f.parquet")
    _parquet(local, 40, 7, wide)
    uri = s3.new_prefix("pq") + "/f.parquet"
    _put(s3, uri, open(local, "rb").read())
    counting = _Counting(files.objects_and_key(uri)[0])
    monkeypatch.setattr(files, "objects_and_key", lambda u: (counting, u.split("://", 1)[1]))
    remote, near = ParquetHandle(uri), ParquetHandle(local)
    footer_len = int.from_bytes(open(local, "rb").read()[-8:-4], "little")
    assert (footer_len > FOOTER_READ) == bool(wide)
    assert counting.calls == ["tail"] + ["range"] * (footer_len + 8 > FOOTER_READ)  # the footer: one request if it fits
    assert remote.names == near.names and remote.num_row_groups == near.num_row_groups == 6
    for columns in (("image", "captions"), ("captions",), ("other", "image", "absent")):
        for rg in range(near.num_row_groups):
            del counting.calls[:]
            assert remote.read_row_group(rg, columns).equals(near.read_row_group(rg, columns)), (columns, rg)
            assert counting.calls == ["range"], (columns, rg, counting.calls)
            fetched = remote.fetch_row_group(rg, columns)  # on an I/O thread: the request; the decode is the packer's
            assert counting.calls == ["range"] * 2 and fetched.nbytes > 0
            assert fetched.table().equals(near.fetch_row_group(rg, columns).table())
            assert counting.calls == ["range"] * 2, (columns, rg, counting.calls)  # decoding asks the store nothing


def test_reads_outside_the_fetched_spans_are_fetched_not_guessed(s3):
    uri = s3.new_prefix("spans") + "/o.bin"
    data = bytes(range(256)) * 40
    _put(s3, uri, data)
    client, key = files.objects_and_key(uri)
    view = _Spans(client, key, len(data), {100: data[100:200], 5000: b"\0" * 10})  # a wrong span is never read past
    assert view.seek(120) == 120 and view.read(50) == data[120:170]
    view.seek(150)
    assert view.read(100) == data[150:250]  # crosses the span's end: fetched
    view.seek(-6, os.SEEK_END)
    assert view.read() == data[-6:] and view.read(5) == b""


def test_recent_handles_open_a_file_once_and_forget_failures(tmp_path, monkeypatch):
    good = str(tmp_path / "g.parquet")
    _parquet(good, 10, 5)
    opened = []
    import prepack.engine.sources.parquet as parquet

    real = parquet.open_parquet
    monkeypatch.setattr(parquet, "open_parquet", lambda p: (opened.append(p), real(p))[1])
    cache = RecentHandles(size=2)
    assert cache.open(good) is cache.open(good) and opened == [good]
    bad = str(tmp_path / "bad.parquet")
    open(bad, "wb").write(b"garbage")
    for _ in range(2):
        with pytest.raises(Exception):
            cache.open(bad)
    assert opened.count(bad) == 2  # each row group of a bad file fails at its own read
