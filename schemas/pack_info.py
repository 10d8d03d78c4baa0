"""``pack.json``: what a pack is (its format, config, tokenizer, streams and budget), read in one place.

Every reader of a pack (the loader, verify, audit, stats, reuse, a resumed or extended run)
opens ``pack.json`` through ``PackInfo.read``: the checksum (``schemas.documents``), then the
on-disk format (one line saying what to do with a pack of another format), then every field's
type.  ``PackInfo.config()`` turns the stored config back into the ``PrepackConfig`` it was
packed with (not the YAML, which may have changed since).  Making and extending it is
``prepack.run.identity``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from schemas.cost import CostModel
from schemas.documents import Document, dump_checked, load_checked, read_document
from schemas.errors import DamagedFile, NotAPack, PackFormatError
from schemas.layout import PACK_INFO_NAME
from schemas.record import RECORD_SCHEMA_VERSION

if TYPE_CHECKING:
    from schemas.config import PrepackConfig
    from schemas.location import PackLocation

# Of the whole layout (schemas.layout); pack.json names it.  3: stream indexes are sealed; 4: one
# pixel frame per image and a pixel index per shard, for reuse; 5: record digests by image, frame
# formats and frame digests in the pixel index, so a later pack passes frames through; 6: a pack may
# continue another (``parent``): its streams are the parent's first records, then its own; 7: each
# record's compute terms in the stream index (``schemas.cost``), each shard's sources (``schemas.sources``).
FORMAT_VERSION = 7

# What a loader state is tied to: the pack's content, not its budget (an extended pack keeps every
# record, so a state taken before the extension still applies).
_FINGERPRINT_KEYS = ("format_version", "config_hash", "tokenizer_fingerprint", "world_size", "num_workers",
                     "stream_seeds")

# (shard metadata key, field): the pack's part of every shard file's schema metadata
SHARD_KEYS = (("prepack.config_hash", "config_hash"), ("prepack.tokenizer_fingerprint", "tokenizer_fingerprint"),
              ("prepack.code_fingerprint", "code_fingerprint"), ("prepack.use_flex", "use_flex"))


def check_format(identity: Any, where: str) -> dict:
    """``identity`` (pack.json's content) if this code reads its format; else one line saying what to do."""
    if not isinstance(identity, dict):
        raise DamagedFile(f"{where}: not a JSON object")
    version = identity.get("format_version")
    if version != FORMAT_VERSION:
        old = version if version is not None else f"1 (manifest_version {identity.get('manifest_version')})"
        raise PackFormatError(
            f"{where}: this pack has on-disk format {old}; this bagel-prepack reads format {FORMAT_VERSION}. "
            "Re-pack it with 'prepack run' into a new --out (or read it with the bagel-prepack that wrote it)"
        )
    return identity


@dataclass(frozen=True)
class ParentLink(Document):
    """What a continuation continues: stream s of this pack is the parent's first ``after[s]`` records
    (the parent's own chain counted whole), then this pack's own.  ``last[s]`` is the digest of the
    parent's record ``after[s] - 1`` ("" where ``after[s]`` is 0), so a parent that changed since is
    refused, not read."""

    uri: str  # where the parent is, as given to --continue (relative paths resolve against the cwd)
    fingerprint: str  # the parent's PackInfo.fingerprint
    after: list[int]  # per stream: how many of the parent's records come first
    last: list[str]  # per stream: the digest of the last of them


@dataclass(frozen=True)
class PackInfo(Document):
    """``pack.json``.  Fields a run always writes but a hand-made pack may lack default to None and are
    then not written back (``to_dict`` gives exactly the dict that was read)."""

    format_version: int
    record_schema_version: int
    world_size: int
    num_workers: int
    num_streams: int
    config_hash: str
    tokenizer_fingerprint: str
    stream_seeds: list[int]
    budget: dict[str, int]
    prepack_version: str | None = None
    code_fingerprint: str | None = None
    config: dict | None = None  # PrepackConfig.to_dict(): see config()
    config_path: str | None = None
    special_tokens: dict[str, int] | None = None
    use_flex: bool | None = None
    max_num_tokens: int | None = None
    parent: ParentLink | None = None  # a continuation (``prepack run --continue``): what it continues

    # -- reading ---------------------------------------------------------------------------------
    @classmethod
    def parse(cls, data: "bytes | str", where: str) -> "PackInfo":
        """Checksum, format, then each field's type (DamagedFile / PackFormatError naming ``where``)."""
        return cls.from_dict(check_format(load_checked(data, where), where), where)

    @classmethod
    def read(cls, loc: "PackLocation") -> "PackInfo | None":
        """The pack's ``pack.json``, or None when ``loc`` has none (yet)."""
        return read_document(loc, PACK_INFO_NAME, cls.parse)

    @classmethod
    def open(cls, loc: "PackLocation") -> "PackInfo":
        """``read``, with ``NotAPack`` where there is no pack."""
        info = cls.read(loc)
        if info is None:
            raise NotAPack(f"{loc.path('')} is not a pack (no {PACK_INFO_NAME}); pack into it with 'prepack run'")
        return info

    def check_record_schema(self, where: str) -> None:
        """A reader of records reads one record schema: DamagedFile naming it otherwise."""
        if self.record_schema_version != RECORD_SCHEMA_VERSION:
            raise DamagedFile(f"{where}: record schema version {self.record_schema_version}, "
                              f"this reader reads {RECORD_SCHEMA_VERSION}")

    # -- writing ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """pack.json's content: every field, less those a hand-made pack left out (None)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def to_bytes(self) -> bytes:
        return dump_checked(self.to_dict())

    def with_budget(self, budget: dict[str, int], config: dict) -> "PackInfo":
        """The same pack extended to a larger ``budget`` (its config now states that budget)."""
        return replace(self, budget=budget, config=config)

    # -- what readers derive from it -------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """What a loader state is tied to (``_FINGERPRINT_KEYS``, and the parent link of a continuation)."""
        d = self.to_dict()
        keys = _FINGERPRINT_KEYS + (("parent",) if self.parent is not None else ())
        blob = json.dumps({k: d.get(k) for k in keys}, sort_keys=True, default=str)
        return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()

    def shard_metadata(self) -> dict[str, str]:
        """The pack's part of every shard file's schema metadata (``schemas.manifest.shard_metadata``)."""
        d = self.to_dict()
        return {key: str(d[name]) for key, name in SHARD_KEYS}

    def cost_model(self) -> "CostModel":
        """What a batch of this pack costs: its config's ``prepack.cost_model``, else the default."""
        return CostModel.of(self.config or {})

    def balances_samples(self) -> bool:
        """Whether each step's samples were re-split among its batches at pack time (``prepack: balance:
        samples``): the steps are those of the pack's world size."""
        return ((self.config or {}).get("prepack") or {}).get("balance") == "samples"

    def stored_config(self) -> "PrepackConfig":
        """The ``PrepackConfig`` the pack was made with, rebuilt from the stored one (not re-read from a
        YAML that may have changed or moved since).  Callers that must trust it compare its
        ``content_hash()`` with ``config_hash`` (verify, audit)."""
        from schemas.config import PrepackConfig

        if self.config is None:
            raise DamagedFile(f"{PACK_INFO_NAME}: holds no config")
        return PrepackConfig.from_dict(self.config, self.config_path or "")
