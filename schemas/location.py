"""Where a pack lives: one resolver for local paths, ``file://`` and any pyarrow filesystem URI.

Shared by the writer and the loader so both agree on how ``OUT`` names a directory and whether
durability calls (fsync, atomic rename) apply: only a local filesystem has them.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

import pyarrow.fs as pafs

from schemas.errors import CredentialsInUri

# Object stores publish an object only when its upload completes, and "rename" is a full copy
# there; writers may skip the temporary name on these.
ATOMIC_PUT_FILESYSTEMS = frozenset({"s3", "gcs"})


# query parameters that may carry a secret (pyarrow and other clients accept some of these)
_SECRET_QUERY_WORDS = ("secret", "password", "token", "access_key", "credential", "signature", "key_id")


def redact_uri(uri: str) -> str:
    """``uri`` with any user info and query string replaced by ``***`` (safe to print)."""
    if "://" not in uri:
        return uri
    parts = urlsplit(uri)
    host = parts.netloc.rsplit("@", 1)[-1]
    netloc = f"***@{host}" if "@" in parts.netloc else host
    query = "?***" if parts.query else ""
    return f"{parts.scheme}://{netloc}{parts.path}{query}"


def refuse_credentials(uri: str, what: str = "a URI") -> None:
    """Raise ``CredentialsInUri`` if ``uri`` carries a secret: secrets belong in the environment
    (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``), where nothing of ours ever writes them down;
    a URI is printed in summaries, stored in ``pack.json`` and shown by ``ps``."""
    if "://" not in uri:
        return
    parts = urlsplit(uri)
    secret_query = any(w in k.lower() for k, _ in parse_qsl(parts.query) for w in _SECRET_QUERY_WORDS)
    if "@" in parts.netloc or secret_query:
        raise CredentialsInUri(f"{what} {redact_uri(uri)} carries credentials: refused. Put them in the environment "
                               "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) instead")


@dataclass(frozen=True)
class PackLocation:
    """A pack directory on some filesystem; ``base`` is the filesystem's own path (no scheme)."""

    fs: pafs.FileSystem
    base: str

    @property
    def is_local(self) -> bool:
        return self.fs.type_name == "local"

    @property
    def atomic_put(self) -> bool:
        return self.fs.type_name in ATOMIC_PUT_FILESYSTEMS

    def path(self, relpath: str) -> str:
        """Filesystem path of ``relpath`` (``/``-separated, relative to the pack directory)."""
        return f"{self.base.rstrip('/')}/{relpath}" if relpath else self.base

    def reopened(self) -> "PackLocation":
        """The same location with a filesystem object of this process's own.

        An S3 client's connections do not survive ``fork``: a DataLoader worker forked from a
        process that already read the pack would share its sockets with the parent and read
        another request's bytes.  A filesystem rebuilt from its own options (the reconstructor
        pyarrow declares through ``__reduce__``; nothing is serialised) opens its own."""
        if self.is_local:
            return self
        rebuild, args = self.fs.__reduce__()[:2]
        return PackLocation(rebuild(*args), self.base)

    def read_bytes(self, relpath: str) -> bytes:
        with self.fs.open_input_stream(self.path(relpath)) as f:
            return f.read()

    def make_dirs(self, path: str) -> None:
        """Create the folder ``path`` (a filesystem path) and its parents where folders exist.

        An object store has none: pyarrow would HEAD the bucket and PUT an empty marker object
        per level, five requests in a row before a stream's file, for nothing a reader needs."""
        if not self.atomic_put:
            self.fs.create_dir(path, recursive=True)

    def open_output(self, path: str):
        """A write stream to ``path`` (a filesystem path).

        On S3 the stream opens with its first bytes, so an object that fits in one part (every
        JSON file, index, lineage and checkpoint of a pack) is one PUT; pyarrow's default opens a
        multipart upload at once, three requests in a row.  Errors are the same, raised by the
        write or the close, which every writer here checks."""
        return self._output_fs.open_output_stream(path)

    @functools.cached_property
    def _output_fs(self) -> pafs.FileSystem:
        if self.fs.type_name != "s3":
            return self.fs
        rebuild, args = self.fs.__reduce__()[:2]
        try:
            return rebuild(dict(args[0], allow_delayed_open=True))
        except (TypeError, ValueError, IndexError):  # a pyarrow without the option: opened at once, as before
            return self.fs

    def list(self, relpath: str, recursive: bool = False, attempts: int = 3) -> "list[pafs.FileInfo]":
        """What is under ``relpath`` ([] when it does not exist).

        pyarrow's local listing fails as not-found, ``allow_not_found`` or not, when the folder
        is created (by another run, or the packer a follower reads behind) between its failed
        open and its existence check: that is listed again."""
        selector = pafs.FileSelector(self.path(relpath), recursive=recursive, allow_not_found=True)
        for attempt in range(attempts):
            try:
                return self.fs.get_file_info(selector)
            except FileNotFoundError:
                if attempt == attempts - 1:
                    raise
        return []


def resolve_location(
    out: "str | os.PathLike | PackLocation", filesystem: pafs.FileSystem | None = None
) -> PackLocation:
    """Resolve a local path, ``file://`` URI or pyarrow URI (s3://, gs://, hdfs://, ...)."""
    if isinstance(out, PackLocation):
        return out
    out = os.fspath(out)
    if filesystem is not None:
        return PackLocation(filesystem, out)
    if "://" in out:
        refuse_credentials(out, "the pack location")
        fs, path = pafs.FileSystem.from_uri(out)
        return PackLocation(fs, path)
    return PackLocation(pafs.LocalFileSystem(), os.path.abspath(out))
