"""What every source shares: the stream it serves, its slice of the data, and failure bounds.

Slicing follows the reference exactly: the item list (files, row groups or JSONL lines) is sorted,
shuffled with ``random.Random(data_seed)``, cut into ``world_size`` equal rank slices (tail
dropped), and — when the emulated DataLoader has workers (K >= 1) — into K equal worker slices,
the worker's slice reversed.  With K = 0 (in-process iteration) the rank's whole list is used in
order.  Each source then cycles over its slice forever, as the reference does; a cursor (the next
item and row to read) is the whole of its resumable state.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from concurrent.futures import Future
from typing import Any, Callable, ClassVar, Generator, Iterator

import numpy as np

from prepack.engine.accounting import Counters, Drop, Rejected, Warn
from prepack.engine.decode import ImagePolicy
from prepack.engine.reuse.source_pictures import PictureStore
from prepack.engine.sources import files
from prepack.engine.sources.ledger import NoLedger, SourceLedger
from prepack.engine.sources.readahead import IOPool, Read, ReadAhead, Reads, plan_of, read_along
from prepack.engine.sample import Sample
from schemas.config import GroupConfig
from schemas.errors import ConfigError, SourceStalled  # noqa: F401  (SourceStalled: raised by sources)
from schemas.kinds import SourceKind

log = logging.getLogger(__name__)


@dataclass
class StreamContext:
    """Everything a source needs to know about the stream it feeds."""

    rank: int
    worker: int
    world_size: int
    num_workers: int  # K as configured; 0 = in-process iteration (no worker slicing, no reversal)
    data_seed: int
    tokenizer: Any
    py_rng: random.Random
    np_rng: np.random.RandomState
    counters: Counters
    image_policy: ImagePolicy
    max_consecutive_failures: int
    config_dir: str = ""  # relative paths inside data files (parquet_info keys) resolve here
    io: IOPool | None = None  # the stream's I/O threads: sources on an object store read ahead (None: never)
    pictures: PictureStore | None = None  # decodes pictures (and finds earlier pixels); made from the policy if None
    ledger: "SourceLedger | NoLedger" = field(default_factory=NoLedger)  # what the sources read, per shard

    def __post_init__(self) -> None:
        if self.pictures is None:
            self.pictures = PictureStore(self.image_policy, self.counters.warn)

    @property
    def worker_id(self) -> int:
        """The worker id the reference records in ``data_indexes`` (0 without workers)."""
        return self.worker if self.num_workers > 0 else 0


def slice_for_stream(items: list, ctx: StreamContext, name: str, key: Callable | None = None) -> list:
    """This stream's share of ``items``: sort, seeded shuffle, rank slice, worker slice reversed."""
    if not items:
        raise ConfigError(f"group {name}: no data found (no files, row groups or lines to read)")
    ordered = sorted(items, key=key) if key else sorted(items)
    random.Random(ctx.data_seed).shuffle(ordered)
    per_rank = len(ordered) // ctx.world_size
    if per_rank == 0:
        raise ConfigError(
            f"group {name}: {len(ordered)} item(s) for world_size={ctx.world_size}: some rank would get no data"
        )
    mine = ordered[ctx.rank * per_rank : (ctx.rank + 1) * per_rank]
    if ctx.num_workers == 0:
        return mine
    per_worker = per_rank // ctx.num_workers
    if per_worker == 0:
        raise ConfigError(
            f"group {name}: {per_rank} item(s) per rank for num_workers={ctx.num_workers}: some worker would get no data"
        )
    return mine[ctx.worker * per_worker : (ctx.worker + 1) * per_worker][::-1]


def list_parquet_files(data_dir: str, num_files: int, ctx: "StreamContext", group: str) -> list[str]:
    """The reference's file list for one directory: ``os.listdir`` order, cycled to ``num_files``.

    Listing order decides which files are used when ``num_files`` is not a multiple of the file
    count; we use the same call so the same files are chosen on the same machine (an object
    store lists in key order).
    """
    listed = files.list_names(data_dir)
    ctx.ledger.note_listing(data_dir, listed)
    names = [n for n in listed if n.endswith(".parquet")]
    if not names:
        raise ConfigError(f"group {group}: no .parquet files in {data_dir}")
    if num_files % len(names):
        ctx.counters.warn(Warn.PARQUET_FILE_CHOICE_DEPENDS_ON_LISTING_ORDER, data_dir)
    paths = [files.join(data_dir, n) for n in names]
    return (paths * (num_files // len(paths) + 1))[:num_files]


class Source:
    """Base of the sources, one per kind: an endless sample iterator with a JSON cursor.

    A source describes its reads once (``_reads``); ``_walk`` turns them into samples, taking each
    object from the read-ahead when the data is on a store (the same description is its plan),
    else reading it as it gets there.
    """

    kind: ClassVar[SourceKind]  # the kind it implements (``prepack.engine.sources`` checks one per kind)

    def __init__(self, group: GroupConfig, ctx: StreamContext):
        self.group = group
        self.ctx = ctx
        self.passes = 0  # completed passes over this stream's slice
        self._fails_in_row = 0
        self._yields_this_pass = 0
        self._iter: Generator[Sample, None, None] | None = None
        self._ra: ReadAhead | None = None

    # -- subclass API -------------------------------------------------------------------------
    def _reads(self, cursor: dict) -> Reads:
        """The objects this source reads from ``cursor`` on, forever, in its order (``readahead.Read``)."""
        raise NotImplementedError

    def _walk(self, reads: Iterator[tuple[Read, Future]]) -> Generator[Sample, None, None]:
        """Samples from the cursor on, forever, from each read of ``_reads`` and its future."""
        raise NotImplementedError

    def _remote(self) -> bool:
        """Whether this source reads from an object store (only then does it read ahead)."""
        raise NotImplementedError

    def pass_rows(self, max_files: int = 16) -> int:
        """Rows in one pass over this stream's slice (parquet: from up to ``max_files`` footers)."""
        raise NotImplementedError

    def cursor(self) -> dict:
        raise NotImplementedError

    def _restore_cursor(self, cursor: dict) -> None:
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"cursor": self.cursor(), "passes": self.passes, "yields_this_pass": self._yields_this_pass}

    def restore(self, state: dict) -> None:
        self.close()
        self._restore_cursor(state["cursor"])
        self.passes = int(state["passes"])
        self._yields_this_pass = int(state["yields_this_pass"])

    def start(self) -> None:
        """Begin at the cursor; a remote source's read-ahead starts filling now, before its first sample."""
        if self._iter is not None:
            return
        io = self.ctx.io
        if io is not None and io.enabled and self._remote():
            self._ra = io.read_ahead(plan_of(self._reads(self.cursor())), self.group.name)
        self._iter = self._walk(read_along(self._reads(self.cursor()), self._ra))

    def close(self) -> None:
        """End the sample iterator and its read-ahead; the next sample starts again at the cursor."""
        if self._iter is not None:
            self._iter.close()
            self._iter = None
        if self._ra is not None:
            self._ra.close()
            self._ra = None

    def next_sample(self) -> Sample:
        if self._iter is None:
            self.start()
        self.ctx.ledger.touch(self)  # what it holds, a restore of this shard reads again to go on
        sample = next(self._iter)
        self._fails_in_row = 0
        self._yields_this_pass += 1
        self.ctx.counters.samples_read[self.group.name] = self.ctx.counters.samples_read.get(self.group.name, 0) + 1
        return sample

    def _failed(self, err: Rejected | Drop, detail: str = "") -> None:
        """Count a dropped row (under this group); stop the stream when the source keeps failing."""
        reason = err.reason if isinstance(err, Rejected) else err
        detail = detail or (err.detail if isinstance(err, Rejected) else "")
        self.ctx.counters.drop(reason, detail, group=self.group.name)
        self._fails_in_row += 1
        if self._fails_in_row >= self.ctx.max_consecutive_failures:
            raise SourceStalled(
                f"group {self.group.name}: {self._fails_in_row} consecutive rows failed (last: {reason} {detail}); "
                "check data_dir and the data (prepack.max_consecutive_failures bounds this)"
            )

    def _wrapped(self) -> None:
        """End of a pass over the slice: the reference starts over; we refuse an empty pass."""
        if self._yields_this_pass == 0:
            raise SourceStalled(
                f"group {self.group.name}: a whole pass over this stream's data produced no sample; "
                "every row failed (see the drop counts) — the reference would loop forever here"
            )
        self.passes += 1
        self._yields_this_pass = 0
        log.info("group %s: pass %d done (rank %d worker %d)", self.group.name, self.passes, self.ctx.rank, self.ctx.worker)
