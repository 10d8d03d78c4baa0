"""Files of a pack written whole or not at all: temporary name, durable, renamed (or one PUT).

Every file of a pack that a reader or a resumed run may see is written through here: a crash
leaves either the old file or the new one, never a half-written one under a real name.  Names
come from ``schemas.layout``; in what order a shard's files are written is ``prepack.run.commit.writer``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import asdict, is_dataclass
from typing import Any

from prepack.run.commit.direct_file import DirectFile
from schemas.layout import temporary
from schemas.location import PackLocation, resolve_location


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicFile:
    """A file written under a temporary name and published by ``commit`` (durably on local disk).

    On object stores (atomic PUT, rename = copy) the final name is written directly: the object
    only appears once complete, and the stream index remains the commit marker.  ``direct``: a
    local file is written past the page cache (``DirectFile``; shard files, written once and
    large, and only ever by the stream's lease holder: under the layout's one temporary name;
    ``staging``: its staging buffer, lent by the writer).
    Every other file may be written by several jobs at once (``pack.json``, the manifest), so each
    writer's temporary name is its own: with one shared name, one job renamed the other's
    half-written file, or found its own gone.
    """

    def __init__(self, loc: PackLocation, relpath: str, *, direct: bool = False, staging=None):
        self.loc = loc
        self.final = loc.path(relpath)
        self.tmp = self.final if loc.atomic_put else temporary(self.final, "" if direct else secrets.token_hex(6))
        if loc.is_local:
            os.makedirs(os.path.dirname(self.final), exist_ok=True)
            self.raw = DirectFile(self.tmp, staging) if direct else open(self.tmp, "wb")
        else:
            loc.make_dirs(self.final.rsplit("/", 1)[0])
            self.raw = loc.open_output(self.tmp)

    def commit(self) -> None:
        self.raw.flush()
        if self.loc.is_local:
            os.fsync(self.raw.fileno())
        self.raw.close()
        if self.tmp == self.final:
            return
        if self.loc.is_local:
            os.replace(self.tmp, self.final)
            _fsync_dir(os.path.dirname(self.final))
        else:
            self.loc.fs.move(self.tmp, self.final)

    def abort(self) -> None:
        if not self.raw.closed:
            try:
                self.raw.close()
            except OSError:  # e.g. the disk filled up: the file is deleted below anyway
                pass
        try:
            self.loc.fs.delete_file(self.tmp)
        except FileNotFoundError:
            pass


def _json_text(obj: Any) -> str:
    if isinstance(obj, str):
        return obj
    if hasattr(obj, "to_json"):
        value = obj.to_json()
        return value if isinstance(value, str) else json.dumps(value, indent=1, sort_keys=True)
    if is_dataclass(obj):
        obj = asdict(obj)
    return json.dumps(obj, indent=1, sort_keys=True)


def write_bytes_atomic(fs_or_out: "PackLocation | str | os.PathLike", relpath: str, data: bytes) -> None:
    """Write ``data`` at ``relpath`` atomically: tmp + fsync + rename + directory fsync (local)."""
    f = AtomicFile(resolve_location(fs_or_out), relpath)
    try:
        f.raw.write(data)
        f.commit()
    except BaseException:
        f.abort()
        raise


def write_json_atomic(fs_or_out: "PackLocation | str | os.PathLike", relpath: str, obj: Any) -> None:
    """Write ``obj`` as JSON at ``relpath`` atomically (see ``write_bytes_atomic``).

    ``obj`` may be a JSON string, an object with ``to_json()`` (e.g. ``ShardEntry``, ``Manifest``),
    a dataclass or plain JSON data.  Keys are sorted so the bytes are deterministic.
    """
    write_bytes_atomic(fs_or_out, relpath, _json_text(obj).encode())


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
