"""What identifies a pack: config, tokenizer and code fingerprints (``pack.json``).

A resume over an existing output, and an audit, are refused when these differ: a different
config or tokenizer would silently mix two datasets in one output, and different code may pack
differently.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from prepack import __version__
from schemas.config import PrepackConfig
from schemas.manifest import MANIFEST_VERSION
from schemas.record import RECORD_SCHEMA_VERSION


# The modules whose code decides the bytes of a pack (the CLI, driver and reports do not).
_CONTENT_MODULES = (
    "prepack/engine", "schemas/checkpoint.py", "schemas/config.py", "schemas/record.py",
)


def code_fingerprint() -> str:
    """Hash of the code that decides a pack's content, so an audit knows it re-packs the same way."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for rel in _CONTENT_MODULES:
        target = root / rel
        for path in sorted(target.rglob("*.py")) if target.is_dir() else [target]:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def pack_identity(cfg: PrepackConfig, tokenizer_fp: str, special) -> dict:
    return {
        "manifest_version": MANIFEST_VERSION,
        "record_schema_version": RECORD_SCHEMA_VERSION,
        "prepack_version": __version__,
        "code_fingerprint": code_fingerprint(),
        "config_hash": cfg.content_hash(),
        "config": cfg.to_dict(),
        "config_path": cfg.config_path,
        "tokenizer_fingerprint": tokenizer_fp,
        "special_tokens": {k: int(v) for k, v in vars(special).items()} if hasattr(special, "__dict__") else dict(special),
        "world_size": cfg.world_size,
        "num_workers": cfg.num_workers,
        "num_streams": cfg.num_streams,
        "use_flex": cfg.knobs.use_flex,
        "max_num_tokens": cfg.knobs.max_num_tokens,
        "stream_seeds": [cfg.stream_seed(s) for s in range(cfg.num_streams)],
    }


def identity_mismatch(existing: dict, new: dict, *, check_code: bool = False) -> str | None:
    """A one-line reason why ``new`` may not continue/audit ``existing``, or None."""
    if existing.get("config_hash") != new["config_hash"]:
        return "the config differs from the one this output was packed with (config_hash)"
    if existing.get("tokenizer_fingerprint") != new["tokenizer_fingerprint"]:
        return "the tokenizer differs from the one this output was packed with"
    if check_code and existing.get("code_fingerprint") != new["code_fingerprint"]:
        return (f"the packing code differs (code fingerprint {new['code_fingerprint']} vs "
                f"{existing.get('code_fingerprint')} in the manifest)")
    return None


def record_metadata(identity: dict) -> dict[str, str]:
    """Self-describing metadata written into every shard's schema."""
    return {
        "prepack.config_hash": identity["config_hash"],
        "prepack.tokenizer_fingerprint": identity["tokenizer_fingerprint"],
        "prepack.code_fingerprint": identity["code_fingerprint"],
        "prepack.use_flex": str(identity["use_flex"]),
    }


def default_cache_env() -> dict[str, str]:
    """Environment Ray workers need to find the same tokenizer cache as the driver."""
    env = {}
    for key in ("BAGEL_PREPACK_CACHE", "HF_HOME", "TRANSFORMERS_OFFLINE", "HF_HUB_OFFLINE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env
