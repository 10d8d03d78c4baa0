"""Where a pack lives: one resolver for local paths, ``file://`` and any pyarrow filesystem URI.

Shared by the writer and the loader so both agree on how ``OUT`` names a directory and whether
durability calls (fsync, atomic rename) apply: only a local filesystem has them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyarrow.fs as pafs

# Object stores publish an object only when its upload completes, and "rename" is a full copy
# there; writers may skip the temporary name on these.
ATOMIC_PUT_FILESYSTEMS = frozenset({"s3", "gcs"})


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

    def read_bytes(self, relpath: str) -> bytes:
        with self.fs.open_input_stream(self.path(relpath)) as f:
            return f.read()


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
        fs, path = pafs.FileSystem.from_uri(out)
        return PackLocation(fs, path)
    return PackLocation(pafs.LocalFileSystem(), os.path.abspath(out))
