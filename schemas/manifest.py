"""Output layout and the manifest: what a finished pack holds and how to check it.

Layout of a pack output directory (every name deterministic, no uuids or timestamps)::

    OUT/pack.json                               run identity: config, fingerprints, W, K (at start)
    OUT/stream-00003/shard-00000.arrow          Arrow IPC file, one record batch per packed batch
    OUT/stream-00003/shard-00000.json           shard index: file digest + per-record digests
    OUT/stream-00003/ckpt-00001.json (+.arrow)  stream state at the start of shard 1
    OUT/stream-00003/done.json                  the stream finished its budget
    OUT/manifest.json                           written last: every stream's shards, totals, drops
    OUT/lineage.parquet                         one row per packed sample (see prepack.run.writer)

A shard index is written (atomically) only after its shard file is durable, and a checkpoint only
after its shard index; so the set of shard indexes is always the set of committed shards.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"
PACK_INFO_NAME = "pack.json"
LINEAGE_NAME = "lineage.parquet"


def stream_dir(stream: int) -> str:
    return f"stream-{stream:05d}"


def shard_file(stream: int, shard: int) -> str:
    return f"{stream_dir(stream)}/shard-{shard:05d}.arrow"


def shard_index_file(stream: int, shard: int) -> str:
    return f"{stream_dir(stream)}/shard-{shard:05d}.json"


def checkpoint_file(stream: int, shard: int, ext: str = "json") -> str:
    return f"{stream_dir(stream)}/ckpt-{shard:05d}.{ext}"


def done_file(stream: int) -> str:
    return f"{stream_dir(stream)}/done.json"


@dataclass
class RecordEntry:
    """One packed batch inside a shard."""

    digest: str  # schemas.record.record_digest of the record
    num_tokens: int  # sequence_length (unpadded)
    num_samples: int


@dataclass
class ShardEntry:
    stream: int
    shard: int
    file: str  # relative to OUT
    nbytes: int
    sha256: str  # of the whole file's bytes
    first_record: int  # index of this shard's first record within its stream
    records: list[RecordEntry] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ShardEntry":
        d = dict(d)
        d["records"] = [RecordEntry(**r) for r in d["records"]]
        return cls(**d)


@dataclass
class StreamEntry:
    stream: int
    rank: int
    worker: int
    seed: int
    shards: list[ShardEntry] = field(default_factory=list)
    num_records: int = 0
    num_tokens: int = 0
    num_samples: int = 0
    drops: dict[str, int] = field(default_factory=dict)  # reason -> samples/rows dropped
    warnings: dict[str, int] = field(default_factory=dict)  # kind -> damaged-but-packed count
    group_samples: dict[str, int] = field(default_factory=dict)  # group -> samples packed
    elapsed_s: float = 0.0  # packing time (not digested; informational)
    cpu_s: float = 0.0  # CPU seconds of the packing process, all threads, worker start-up excluded (informational)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "StreamEntry":
        d = dict(d)
        d["shards"] = [ShardEntry.from_json(s) for s in d["shards"]]
        return cls(**d)


@dataclass
class Manifest:
    """Everything a reader and an auditor need; ``identity`` is pack.json's content."""

    version: int
    record_schema_version: int
    identity: dict[str, Any]
    streams: list[StreamEntry]

    @property
    def world_size(self) -> int:
        return int(self.identity["world_size"])

    @property
    def num_workers(self) -> int:
        return int(self.identity["num_workers"])

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        d = json.loads(text)
        if d.get("version") != MANIFEST_VERSION:
            raise ValueError(f"unsupported manifest version {d.get('version')!r} (this reader: {MANIFEST_VERSION})")
        d["streams"] = [StreamEntry.from_json(s) for s in d["streams"]]
        return cls(**d)
