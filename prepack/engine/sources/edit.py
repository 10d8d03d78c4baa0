"""``unified_edit``: parquet rows of (``image_list``, ``instruction_list``) -> an edit chain.

The unit of slicing is a (file, row group) pair, taken from ``parquet_info`` (files absent from it
are ignored, as in the reference; both mismatches are counted).  Per row the reference draws, in
order: the chain start, the chain end, (for chains longer than one step) whether to merge the
instructions, and one paraphrase per step; images are decoded between those draws, and we decode
at the same points so a failing row consumes exactly the draws it consumes there.
Data index: ``[row-group position, row]``.
"""

from __future__ import annotations

import json
import os
from functools import partial
from typing import Iterator

from prepack.engine.accounting import Drop, Rejected, Warn
from prepack.engine.decode import navit_size
from prepack.engine.sample import PlanItem, Sample, SampleImage
from prepack.engine.sources import files
from prepack.engine.sources.base import Source, StreamContext, list_parquet_files, slice_for_stream
from prepack.engine.sources.parquet import RecentHandles, open_parquet
from prepack.engine.sources.readahead import Read, Reads
from schemas.config import ConfigError, GroupConfig, TransformArgs
from schemas.kinds import EDIT
from schemas.packed_batch import SampleOrigin


def _load_parquet_info(paths: list[str], base: str, ledger) -> dict:
    """Merged ``parquet_info`` files; relative keys resolve against the config's folder."""
    info: dict = {}
    for p in paths:
        try:
            raw = files.read_bytes(p)
            ledger.note_bytes(p, raw)
            d = json.loads(raw.decode("utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"parquet_info_path {p}: cannot read JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"parquet_info_path {p}: must be a JSON object of path -> {{num_row_groups}}")
        info.update({k if os.path.isabs(k) or "://" in k else os.path.normpath(os.path.join(base, k)): v
                     for k, v in d.items()})
    return info


COLUMNS = ("image_list", "instruction_list")


def _fetch_row_group(path: str, rg: int, handles: RecentHandles):
    """One row group's edit columns, fetched (the walk decodes them, on the packing thread).  A local
    file is opened (its footer read) per row group, as the reference does; a file on a store once
    while it is among the last ones read (``handles``)."""
    handle = handles.open(path) if files.is_uri(path) else open_parquet(path)
    return handle.fetch_row_group(rg, COLUMNS)


class EditSource(Source):
    kind = EDIT

    def __init__(self, group: GroupConfig, ctx: StreamContext):
        super().__init__(group, ctx)
        info = _load_parquet_info([d.parquet_info_path for d in group.datasets if d.parquet_info_path],
                                  ctx.config_dir, ctx.ledger)
        listed: set[str] = set()
        row_groups: list[tuple[str, int, str]] = []
        for ds, num in zip(group.datasets, group.num_used_data):
            for path in list_parquet_files(ds.data_dir, num, ctx, group.name):
                listed.add(path)
                if path not in info:
                    ctx.counters.warn(Warn.EDIT_FILE_MISSING_FROM_PARQUET_INFO, path)
                    continue
                try:
                    n = int(info[path]["num_row_groups"])
                except (KeyError, TypeError, ValueError):
                    raise ConfigError(f"parquet_info entry for {path} needs an integer 'num_row_groups'") from None
                row_groups += [(path, rg, ds.name) for rg in range(n)]
        for path in info:
            if path not in listed and not files.exists(path):
                ctx.counters.warn(Warn.PARQUET_INFO_ENTRY_WITHOUT_FILE, path)
        self.row_groups = slice_for_stream(row_groups, ctx, group.name, key=lambda t: (t[0], t[1]))
        self.pos = [0, 0]  # next (row-group position, row)

    def cursor(self) -> dict:
        return {"row_group_pos": self.pos[0], "row": self.pos[1]}

    def _restore_cursor(self, cursor: dict) -> None:
        self.pos = [int(cursor["row_group_pos"]), int(cursor["row"])]

    def _remote(self) -> bool:
        return any(files.is_uri(p) for p, _, _ in self.row_groups)

    def pass_rows(self, max_files: int = 16) -> int:
        by_file: dict[str, list[int]] = {}
        for path, rg, _ in self.row_groups:
            by_file.setdefault(path, []).append(rg)
        paths = sorted(by_file)
        step = max(1, len(paths) // max_files)
        counts = []
        for path in paths[::step][:max_files]:
            try:
                md = open_parquet(path).metadata
                counts += [md.row_group(rg).num_rows if rg < md.num_row_groups else 0 for rg in by_file[path]]
            except Exception:  # an unreadable file: packing drops its row groups
                counts += [0] * len(by_file[path])
        return round(sum(counts) / len(counts) * len(self.row_groups)) if counts else 0

    def _reads(self, cursor: dict) -> Reads:
        """One fetch per row group from the cursor on; a mark ends each pass."""
        gpos = cursor["row_group_pos"]
        handles = RecentHandles()  # on a store, row groups of one file read its footer once
        while True:
            while gpos < len(self.row_groups):
                path, rg, _ = self.row_groups[gpos]
                yield Read(("row_group", gpos), partial(_fetch_row_group, path, rg, handles))
                gpos += 1
            yield Read(("pass",))
            gpos = 0

    def _walk(self, reads) -> Iterator[Sample]:
        for read, fetched in reads:
            if read.key[0] == "pass":
                self.pos = [0, 0]
                self._wrapped()
                continue
            gpos = read.key[1]
            path, rg, dataset = self.row_groups[gpos]
            try:
                table = fetched.result().table()
            except Exception as e:  # the reference drops the row group (or crashes on a missing file)
                self._failed(Drop.PARQUET_ROW_GROUP_PARSE, f"{path} rg {rg}: {e}")
                self.pos = [gpos + 1, 0]
                continue
            self.ctx.ledger.hold_row_group(self, fetched.result())
            self.pos = [gpos, self.pos[1] if self.pos[0] == gpos else 0]
            while self.pos[1] < table.num_rows:
                row = self.pos[1]
                self.pos = [gpos, row + 1]
                origin = SampleOrigin(self.group.name, dataset, self.ctx.worker_id, [gpos, row], False, path, rg, row)
                try:
                    sample = self._row(table, row, origin)
                except Rejected as r:
                    self._failed(r, f"{path} rg {rg} row {row}")
                    continue
                except Exception as e:  # the reference's parse_row guard
                    self._failed(Drop.PARQUET_ROW_PARSE, f"{path} rg {rg} row {row}: {type(e).__name__}: {e}")
                    continue
                yield sample
            self.pos = [gpos + 1, 0]
            self.ctx.ledger.release(self)

    def _row(self, table, row: int, origin: SampleOrigin) -> Sample:
        ctx, py = self.ctx, self.ctx.py_rng
        vae_args, vit_args = self.group.image_transform, self.group.vit_image_transform
        images = table.column("image_list")[row].as_py()
        instructions = table.column("instruction_list")[row].as_py()
        n = len(images)
        start = py.choice(range(n - 1))
        end = py.choice(range(start + 1, min(start + 3, n)))
        plan: list[PlanItem] = []
        texts: list[list[int]] = []
        slots: list[SampleImage] = []
        tokens = 0

        def picture(i: int):
            data = images[i]
            if not isinstance(data, bytes):
                raise Rejected(Drop.EDIT_IMAGE_NOT_BYTES)
            return ctx.pictures.rgb(data)

        def add_text(text: str) -> None:
            nonlocal tokens
            ids = ctx.tokenizer.encode(text)
            tokens += len(ids)
            texts.append(ids)
            plan.append(PlanItem("text", enable_cfg=1, loss=0))

        def sized(pic, args: TransformArgs) -> SampleImage:
            nonlocal tokens
            target = navit_size(pic.size, max_size=args.max_image_size, min_size=args.min_image_size,
                                stride=args.image_stride, max_pixels=args.max_pixels)
            tokens += target[0] * target[1] // args.image_stride**2
            return SampleImage.from_transform(pic, target, args)

        def add_image(pic, *, loss: bool, vae: bool, vit: bool) -> None:
            nonlocal tokens
            vae_image = None
            if loss:
                vae_image = sized(pic, vae_args)
                plan.append(PlanItem("vae_image", enable_cfg=0, loss=1))
                slots.append(vae_image)
            if vae:
                if vae_image is None:
                    vae_image = sized(pic, vae_args)
                else:  # same picture, same resize: reuse the pixels, count the tokens again
                    tokens += vae_image.width * vae_image.height // vae_args.image_stride**2
                plan.append(PlanItem("vae_image", enable_cfg=1, loss=0))
                slots.append(vae_image)
            if vit:
                plan.append(PlanItem("vit_image", enable_cfg=1, loss=0))
                slots.append(sized(pic, vit_args))

        add_image(picture(start), loss=False, vae=True, vit=True)
        if end - start > 1 and py.random() < 0.5:
            if end == n - 1:
                end -= 1
            merged = ""
            for idx in range(start + 1, end + 1):
                merged += py.choice(instructions[idx - 1]) + ". "
            add_text(merged.rstrip())
            add_image(picture(end), loss=True, vae=False, vit=False)
        else:
            for idx in range(start + 1, end + 1):
                add_text(py.choice(instructions[idx - 1]))
                add_image(picture(idx), loss=True, vae=idx != end, vit=idx != end)
        return Sample(plan, texts, slots, tokens, origin)
