"""What identifies a pack (``pack.json``): made, checked and extended here, and nowhere else.

Reading it is ``schemas.pack_info.PackInfo``.  A resume over an existing output, and an audit,
are refused when config or tokenizer differ: they would silently mix two datasets in one output
(different code may pack differently: audits check it too).  ``settle_identity`` is the one step a run takes: create ``pack.json`` once (several jobs
may start on one output at the same moment: each reads back what landed and checks it), check it,
or extend its budget.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from prepack import __version__
from prepack.run.commit.atomic_files import write_bytes_atomic
from schemas.config import PrepackConfig
from schemas.errors import PackRefused
from schemas.layout import MANIFEST_NAME, PACK_INFO_NAME
from schemas.location import PackLocation, redact_uri
from schemas.pack_info import FORMAT_VERSION, PackInfo, ParentLink
from schemas.record import RECORD_SCHEMA_VERSION


log = logging.getLogger(__name__)

# The modules whose code decides the bytes of a pack (the CLI, driver and reports do not).
_CONTENT_MODULES = (
    "prepack/engine", "schemas/checkpoint.py", "schemas/config.py", "schemas/config_checks.py",
    "schemas/pixel_table.py", "schemas/record.py",
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


def pack_identity(cfg: PrepackConfig, tokenizer_fp: str, special, parent: ParentLink | None = None) -> PackInfo:
    """The ``pack.json`` a run of ``cfg`` with this tokenizer writes (``parent``: what it continues)."""
    return PackInfo(
        format_version=FORMAT_VERSION,
        record_schema_version=RECORD_SCHEMA_VERSION,
        prepack_version=__version__,
        code_fingerprint=code_fingerprint(),
        config_hash=cfg.content_hash(),
        config=cfg.to_dict(),
        config_path=cfg.config_path,
        tokenizer_fingerprint=tokenizer_fp,
        special_tokens={k: int(v) for k, v in vars(special).items()} if hasattr(special, "__dict__") else dict(special),
        world_size=cfg.world_size,
        num_workers=cfg.num_workers,
        num_streams=cfg.num_streams,
        use_flex=cfg.knobs.use_flex,
        max_num_tokens=cfg.knobs.max_num_tokens,
        stream_seeds=[cfg.stream_seed(s) for s in range(cfg.num_streams)],
        budget=cfg.prepack.budget(),
        parent=parent,
    )


def identity_mismatch(existing: PackInfo, new: PackInfo, *, check_code: bool = False) -> str | None:
    """A one-line reason why ``new`` may not continue/audit ``existing``, or None."""
    if existing.config_hash != new.config_hash:
        return "the config differs from the one this output was packed with (config_hash)"
    if existing.tokenizer_fingerprint != new.tokenizer_fingerprint:
        return "the tokenizer differs from the one this output was packed with"
    if existing.parent != new.parent:
        if existing.parent is None:
            return "this output is a pack of its own, not a continuation"
        was = existing.parent
        after = sorted(set(was.after))
        return (f"this output continues {was.uri} after {'record ' + str(after[0]) if len(after) == 1 else 'a loader state'}"
                + (" (the same switch, but that pack has changed since)" if new.parent is not None
                   and new.parent.after == was.after else ""))
    if check_code and existing.code_fingerprint != new.code_fingerprint:
        return (f"the packing code differs (code fingerprint {new.code_fingerprint} vs "
                f"{existing.code_fingerprint} in pack.json)")
    return None


def budget_change(existing: PackInfo, new: PackInfo) -> str | None:
    """Why the new budget cannot continue the packed one (smaller, or another kind), or None.

    Every packed stream is a prefix of the reference's endless stream, so a budget of the same
    kind that is at least as large continues it; anything else would have to rewrite packed bytes.
    """
    old, want = existing.budget or {}, new.budget
    if set(old) != set(want):
        return (f"the budget changed kind ({_fmt(old)} -> {_fmt(want)}); a pack can only be extended with a "
                "larger value of the same budget")
    smaller = [k for k in want if want[k] < old[k]]
    if smaller:
        return (f"the config's budget {_fmt({k: want[k] for k in smaller})} is smaller than the "
                f"{_fmt({k: old[k] for k in smaller})} already packed; use a new --out for a smaller pack")
    return None


def _fmt(budget: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(budget.items())) or "none"


def write_identity(out, info: PackInfo) -> None:
    """Write ``pack.json`` (with its checksum), atomically."""
    write_bytes_atomic(out, PACK_INFO_NAME, info.to_bytes())


@dataclass(frozen=True)
class SettledIdentity:
    """The identity a run packs under: pack.json as stored, and the metadata every shard carries."""

    info: PackInfo
    extended: bool  # this run raised the budget of an existing pack

    @property
    def metadata(self) -> dict[str, str]:
        return self.info.shard_metadata()

    @property
    def budget(self) -> dict:
        return self.info.budget


def settle_identity(loc: PackLocation, cfg: PrepackConfig, tokenizer_fp: str, special,
                    other_jobs=lambda: [], parent: ParentLink | None = None) -> SettledIdentity:
    """Create, check or extend ``pack.json`` for a run of ``cfg`` over ``loc``.

    A new output gets this run's identity; a concurrent job may have written its own at the same
    moment, so what is read back is what counts, checked like any existing one: it must hold this
    format, config and tokenizer; a larger budget of the same kind is an extension (refused while
    ``other_jobs()`` names live jobs packing the output: they pack to the old budget).
    """
    where = redact_uri(loc.base)
    mine = pack_identity(cfg, tokenizer_fp, special, parent)
    existing = PackInfo.read(loc)
    if existing is None:
        write_identity(loc, mine)
        existing = PackInfo.read(loc) or mine
    why = identity_mismatch(existing, mine) or budget_change(existing, mine)
    if why:
        raise PackRefused(f"{where}: {why}; use a new --out or the original config")
    if existing.budget == mine.budget:
        return SettledIdentity(existing, False)  # keep the stored identity (code fingerprint of the first run)
    busy = other_jobs()
    if busy:
        raise PackRefused(f"{where}: extending the budget to {_fmt(mine.budget)} needs the output to itself, but "
                          f"{len(busy)} other prepack run(s) are packing it (e.g. pid {busy[0].get('pid')} on "
                          f"{busy[0].get('host')}); wait for them to finish")
    extended = existing.with_budget(mine.budget, mine.config)
    try:
        loc.fs.delete_file(loc.path(MANIFEST_NAME))  # no longer complete; rewritten when it is
    except FileNotFoundError:
        pass
    write_identity(loc, extended)
    log.info("extending %s from %s to %s", where, _fmt(existing.budget), _fmt(mine.budget))
    return SettledIdentity(extended, True)
