"""Typed JSON documents: a dataclass declares the fields once; reading checks every type.

Why: metadata files (done.json, manifest.json, pack.json, checkpoints) are read back by other
processes, other machines and later versions; a wrong or damaged field must fail at the read,
naming the file, not later as a KeyError deep in the packer.  ``dump_checked`` adds a sha256 of
the content so a damaged file names itself even where no index records its digest, and
``load_checked`` accepts only the exact bytes ``dump_checked`` writes (Python's JSON output is
stable), so a changed byte that decodes to the same content (whitespace, key order, escapes) is
damage too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from schemas.errors import DamagedFile

if TYPE_CHECKING:
    from schemas.location import PackLocation

CHECKSUM_KEY = "checksum"
T = TypeVar("T")


def dump_checked(d: dict) -> bytes:
    """JSON bytes of ``d`` with a ``checksum`` of its own content, so a damaged file names itself."""
    body = {k: v for k, v in d.items() if k != CHECKSUM_KEY}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return json.dumps({**body, CHECKSUM_KEY: digest}, indent=1, sort_keys=True).encode()


def load_checked(data: "bytes | str", where: str) -> dict:
    """The dict ``dump_checked`` wrote (without its checksum); DamagedFile when it does not match."""
    try:
        d = json.loads(data)
    except ValueError as e:
        raise DamagedFile(f"{where}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise DamagedFile(f"{where}: not a JSON object")
    if CHECKSUM_KEY not in d:
        if "manifest_version" in d:
            return d  # written by format 1, which had no checksums: check_format says what to do
        raise DamagedFile(f"{where}: damaged (no checksum)")
    body = {k: v for k, v in d.items() if k != CHECKSUM_KEY}
    if hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest() != d[CHECKSUM_KEY]:
        raise DamagedFile(f"{where}: damaged (its checksum does not match its content)")
    if dump_checked(body) != (data.encode() if isinstance(data, str) else bytes(data)):
        raise DamagedFile(f"{where}: damaged (same content, but its bytes are not the ones written)")
    return body


def read_document(loc: "PackLocation", name: str, parse: "Callable[[bytes, str], T]") -> "T | None":
    """``parse(data, path)`` of the file ``name`` of ``loc``, or None when it is absent (not written
    yet, or optional).  Every other failure is the parser's to name, with the path."""
    try:
        data = loc.read_bytes(name)
    except FileNotFoundError:
        return None
    return parse(data, loc.path(name))


def _check(value: Any, hint: Any, where: str) -> Any:
    """``value`` if it has type ``hint`` (the subset of typing our documents use), else DamagedFile."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(hint):
            try:
                return _check(value, arm, where)
            except DamagedFile:
                pass
        raise DamagedFile(f"{where}: {value!r} is not {hint}")
    if hint is type(None):
        if value is None:
            return value
    elif origin is list:
        if isinstance(value, list):
            (arm,) = typing.get_args(hint) or (Any,)
            return [_check(v, arm, f"{where}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            _, arm = typing.get_args(hint) or (str, Any)
            return {str(k): _check(v, arm, f"{where}.{k}") for k, v in value.items()}
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, dict):
            return hint.from_dict(value, where)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(hint, type) and isinstance(value, hint):
        return value
    raise DamagedFile(f"{where}: {value!r} is not {getattr(hint, '__name__', hint)}")


_ATOMS = frozenset((int, float, str, bool, type(None)))


def _plain(value: Any) -> Any:
    """``asdict`` for JSON: the same dict, without deep-copying every leaf (a checkpoint holds
    thousands of ints: RNG states, buffered token ids)."""
    if type(value) in _ATOMS:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


class Document:
    """A dataclass saved as JSON: fields declared once, every field type-checked on read."""

    def to_json(self) -> str:
        return dump_checked(_plain(self)).decode()

    @classmethod
    def from_dict(cls, d: Any, where: str = ""):
        where = where or cls.__name__
        if not isinstance(d, dict):
            raise DamagedFile(f"{where}: expected a JSON object")
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in d:
                kwargs[f.name] = _check(d[f.name], hints[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise DamagedFile(f"{where}: missing field '{f.name}'")
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: "str | bytes", where: str = ""):
        return cls.from_dict(load_checked(text, where or cls.__name__), where)
