"""Source files on a local disk or an object store, behind the few calls the sources make.

The reference reads only local files.  A ``data_dir``, ``jsonl_path``, ``parquet_info_path`` or
media path given as a URI (``s3://bucket/dir``, ``gs://...``) is read through pyarrow's
filesystem instead, with the same results: the same listing semantics (names of the entries of
one directory), the same bytes.  Local paths go on using the very calls the reference makes
(``os.listdir``, ``open``, a path handed to PIL or parquet), so local behaviour is unchanged.

One filesystem object per (scheme, bucket) and process: creating an S3 client costs far more
than a request, and a stream reads thousands of objects.  Listings go through the filesystem;
object reads go through the bucket's ``objects`` client (obstore on S3 where it can, which costs
the packer a third of the CPU per request).  Parquet files are opened in ``parquet``.
"""

from __future__ import annotations

import functools
import io
import os

import pyarrow.fs as pafs

from prepack.engine.sources import objects


def is_uri(path: str) -> bool:
    return "://" in path


@functools.lru_cache(maxsize=64)
def _filesystem(scheme: str, authority: str) -> pafs.FileSystem:
    fs, _ = pafs.FileSystem.from_uri(f"{scheme}://{authority}/")
    return fs


def _split(uri: str) -> tuple[str, str, str]:
    """(scheme, bucket, ``bucket/key``) of a URI."""
    scheme, rest = uri.split("://", 1)
    authority, _, key = rest.partition("/")
    return scheme, authority, f"{authority}/{key}".rstrip("/")


def fs_and_path(uri: str) -> tuple[pafs.FileSystem, str]:
    """The (cached) filesystem of ``uri`` and the object path inside it (``bucket/key``)."""
    scheme, authority, key = _split(uri)
    return _filesystem(scheme, authority), key


def objects_and_key(uri: str) -> "tuple[objects.ObjectClient, str]":
    """The (cached) object client of ``uri``'s bucket and the key inside it (``bucket/key``)."""
    scheme, authority, key = _split(uri)
    return _objects(scheme, authority, objects.choice()), key


@functools.lru_cache(maxsize=64)
def _objects(scheme: str, authority: str, which: str) -> "objects.ObjectClient":
    return objects.make_client(scheme, authority, _filesystem(scheme, authority), {**os.environ, objects.CLIENT_ENV: which})


def join(directory: str, name: str) -> str:
    """``name`` inside ``directory`` (``/`` on URIs, ``os.path.join`` locally)."""
    return f"{directory.rstrip('/')}/{name}" if is_uri(directory) else os.path.join(directory, name)


def list_names(directory: str) -> list[str]:
    """Entry names of one directory (``os.listdir`` locally; the store's listing order on URIs)."""
    if not is_uri(directory):
        return os.listdir(directory)
    fs, path = fs_and_path(directory)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=False))
    return [i.base_name for i in infos]


def exists(path: str) -> bool:
    if not is_uri(path):
        return os.path.exists(path)
    fs, p = fs_and_path(path)
    return fs.get_file_info(p).type != pafs.FileType.NotFound


def read_bytes(path: str) -> bytes:
    if not is_uri(path):
        with open(path, "rb") as f:
            return f.read()
    client, key = objects_and_key(path)
    return client.get(key)


def read_text(path: str) -> str:
    """A small text file (JSON), UTF-8."""
    return read_bytes(path).decode("utf-8")


def media(path: str) -> "str | bytes":
    """What to hand a decoder: the path itself locally (as the reference does), the bytes on a URI."""
    return read_bytes(path) if is_uri(path) else path


def video_source(path: str):
    """What decord opens: the path locally, an in-memory file of the object on a URI."""
    return io.BytesIO(read_bytes(path)) if is_uri(path) else path
