"""How a raw config value is checked: unknown keys (with the closest valid name), types, paths.

The config model (``schemas.config``) parses each section with these, so every mistake is one
``ConfigError`` line that names the key.
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any, Mapping


from schemas.errors import ConfigError
from schemas.location import redact_uri, refuse_credentials


def closest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(valid))}"


def check_keys(where: str, given: Mapping[str, Any], valid: list[str]) -> None:
    for key in given:
        if key not in valid:
            raise ConfigError(f"unknown key '{key}' in {where}{closest(str(key), valid)}")


def typed(where: str, value: Any, typ: type | tuple, name: str) -> Any:
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, bool) and typ in (int, float):
        raise ConfigError(f"{where}.{name} must be a number, got {value!r}")
    if not isinstance(value, typ):
        tname = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise ConfigError(f"{where}.{name} must be {tname}, got {value!r}")
    return value


def resolve(base: str, p: Any, where: str) -> str:
    if not isinstance(p, str) or not p:
        raise ConfigError(f"{where} must be a non-empty path string, got {p!r}")
    if "://" in p:
        refuse_credentials(p, where)
        return p
    p = os.path.expanduser(p)
    if os.path.isabs(p):
        # kept verbatim: the reference joins and compares these strings as given (parquet_info
        # keys, sort order of file paths), so normalising them could change which files match
        return p
    return os.path.normpath(os.path.join(base, p))


def is_kind(path: str, directory: bool) -> bool:
    """Whether ``path`` (local, or a URI read through pyarrow) is a directory / a file."""
    if "://" not in path:
        return os.path.isdir(path) if directory else os.path.isfile(path)
    import pyarrow.fs as pafs

    try:
        fs, p = pafs.FileSystem.from_uri(path)
        kind = fs.get_file_info(p).type
    except OSError as e:  # unreachable store, unknown bucket, no credentials: say so in one line
        raise ConfigError(f"cannot reach {redact_uri(path)}: {str(e).splitlines()[0]}") from None
    return kind == (pafs.FileType.Directory if directory else pafs.FileType.File)


def load_mapping(base: str, d: Mapping, key: str) -> dict:
    inline, path = d.get(key), d.get(f"{key}_path")
    if path is not None:
        full = resolve(base, path, f"dataset.{key}_path")
        if not os.path.isfile(full):
            raise ConfigError(f"dataset.{key}_path: file not found: {full}")
        with open(full) as f:
            import yaml  # here: the loader-only install has no PyYAML

            value = yaml.safe_load(f) if full.endswith((".yaml", ".yml")) else json.load(f)
    elif inline is not None:
        value = inline
    else:
        raise ConfigError(f"dataset needs '{key}' or '{key}_path'")
    if not isinstance(value, Mapping):
        raise ConfigError(f"dataset.{key} must be a mapping, got {type(value).__name__}")
    return dict(value)
