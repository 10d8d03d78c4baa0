"""``t2i_pretrain``: parquet rows of (``image`` bytes, ``captions`` JSON object) -> caption + VAE target.

Per row, in the reference's order: decode the image (failure: drop), parse the captions (failure:
drop), draw one caption with the stream's ``random`` (one ``choice`` over all captions), tokenize
only the chosen one.  An empty caption object packs the caption ``" "`` as the reference does (a
counted warning; dropped in strict mode).  Data index: ``[file position, row group, row]``.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Iterator

from prepack.engine.accounting import Drop, Rejected, Warn
from prepack.engine.decode import navit_size
from prepack.engine.sample import PlanItem, Sample, SampleImage
from prepack.engine.sources import files
from prepack.engine.sources.base import Source, StreamContext, list_parquet_files, slice_for_stream
from prepack.engine.sources.parquet import ParquetHandle, open_parquet
from prepack.engine.sources.readahead import Read, Reads
from schemas.config import GroupConfig
from schemas.kinds import T2I
from schemas.packed_batch import SampleOrigin


COLUMNS = ("image", "captions")


def _fetch_row_group(handle: ParquetHandle, rg: int):
    return handle.fetch_row_group(rg, COLUMNS)  # decoded by the walk, on the packing thread


class T2ISource(Source):
    kind = T2I

    def __init__(self, group: GroupConfig, ctx: StreamContext):
        super().__init__(group, ctx)
        files: list[tuple[str, str]] = []  # (path, dataset name)
        for info, num in zip(group.datasets, group.num_used_data):
            files += [(p, info.name) for p in list_parquet_files(info.data_dir, num, ctx, group.name)]
        self.files = slice_for_stream(files, ctx, group.name, key=lambda f: f[0])
        self.pos = [0, 0, 0]  # next (file position, row group, row)

    def cursor(self) -> dict:
        return {"file": self.pos[0], "row_group": self.pos[1], "row": self.pos[2]}

    def _restore_cursor(self, cursor: dict) -> None:
        self.pos = [int(cursor["file"]), int(cursor["row_group"]), int(cursor["row"])]

    def _remote(self) -> bool:
        return any(files.is_uri(p) for p, _ in self.files)

    def pass_rows(self, max_files: int = 16) -> int:
        paths = sorted({p for p, _ in self.files})
        step = max(1, len(paths) // max_files)
        counts = []
        for path in paths[::step][:max_files]:
            try:
                counts.append(open_parquet(path).metadata.num_rows)
            except Exception:  # an unreadable file: packing drops it
                counts.append(0)
        return round(sum(counts) / len(counts) * len(self.files)) if counts else 0

    def _reads(self, cursor: dict) -> Reads:
        """Per file from the cursor on: its footer, then its row groups (sized by the footer; those of
        one handle may be read at once); a file that does not open has none.  A mark ends each pass."""
        fpos, rg0 = cursor["file"], cursor["row_group"]
        while True:
            while fpos < len(self.files):
                path = self.files[fpos][0]
                try:
                    handle = yield Read(("open", fpos), partial(open_parquet, path), needed=True)
                    num_groups = handle.num_row_groups
                except Exception:  # the walk drops the file
                    num_groups = 0
                for rg in range(rg0, num_groups):
                    yield Read(("row_group", fpos, rg), partial(_fetch_row_group, handle, rg), handle.row_group_bytes(rg))
                fpos, rg0 = fpos + 1, 0
            yield Read(("pass",))
            fpos = 0

    def _walk(self, reads) -> Iterator[Sample]:
        names: set = set()
        for read, fetched in reads:
            if read.key[0] == "pass":
                self.pos = [0, 0, 0]
                self._wrapped()
                continue
            fpos = read.key[1]
            path, dataset = self.files[fpos]
            if read.key[0] == "open":
                try:
                    handle = fetched.result()
                    names = handle.names
                except Exception as e:  # the reference crashes here; we drop the file
                    self._failed(Drop.PARQUET_FILE_UNREADABLE, f"{path}: {e}")
                    self.pos = [fpos + 1, 0, 0]
                continue
            rg = read.key[2]
            try:
                table = fetched.result().table()
            except Exception as e:  # the reference crashes here; we drop the row group
                self._failed(Drop.PARQUET_ROW_GROUP_UNREADABLE, f"{path} rg {rg}: {e}")
                self.pos = [fpos, rg + 1, 0]
                continue
            self.ctx.ledger.hold_row_group(self, fetched.result())
            images = table.column("image") if "image" in names else None
            captions = table.column("captions") if "captions" in names else None
            self.pos = [fpos, rg, self.pos[2] if self.pos[:2] == [fpos, rg] else 0]
            while self.pos[2] < table.num_rows:
                row = self.pos[2]
                self.pos = [fpos, rg, row + 1]
                origin = SampleOrigin(self.group.name, dataset, self.ctx.worker_id, [fpos, rg, row], False, path, rg, row)
                try:
                    sample = self._row(images, captions, row, origin)
                except Rejected as r:
                    self._failed(r, f"{path} rg {rg} row {row}")
                    continue
                yield sample
            self.pos = [fpos, rg + 1, 0]
            self.ctx.ledger.release(self)

    def _row(self, images, captions, row: int, origin: SampleOrigin) -> Sample:
        ctx, args = self.ctx, self.group.image_transform
        if images is None:
            raise Rejected(Drop.T2I_IMAGE_PARSE, "no 'image' column")
        data = images[row].as_py()
        if not isinstance(data, bytes):
            raise Rejected(Drop.T2I_IMAGE_PARSE, f"image value is {type(data).__name__}, not bytes")
        try:
            picture = ctx.pictures.rgb(data)
        except Rejected:
            raise
        except Exception as e:
            raise Rejected(Drop.T2I_IMAGE_PARSE, str(e)) from None
        target = navit_size(picture.size, max_size=args.max_image_size, min_size=args.min_image_size,
                            stride=args.image_stride, max_pixels=args.max_pixels)
        num_tokens = target[0] * target[1] // args.image_stride**2
        if captions is None:
            raise Rejected(Drop.T2I_CAPTION_PARSE, "no 'captions' column")
        try:
            caption_dict = json.loads(captions[row].as_py())
        except Exception as e:
            raise Rejected(Drop.T2I_CAPTION_PARSE, str(e)) from None
        if not isinstance(caption_dict, dict):
            raise Rejected(Drop.T2I_CAPTION_NOT_OBJECT, type(caption_dict).__name__)
        values = list(caption_dict.values())
        if any(not isinstance(v, str) for v in values):
            raise Rejected(Drop.T2I_CAPTION_NOT_STRING)
        if not values:
            if ctx.image_policy.strict:
                raise Rejected(Warn.T2I_NO_CAPTION_PACKED_AS_SPACE.strict)
            ctx.counters.warn(Warn.T2I_NO_CAPTION_PACKED_AS_SPACE)
            text = " "
        else:
            text = values[ctx.py_rng.choice(range(len(values)))]
            if text == "":
                if ctx.image_policy.strict:
                    raise Rejected(Warn.T2I_EMPTY_CAPTION.strict)
                ctx.counters.warn(Warn.T2I_EMPTY_CAPTION)
        ids = ctx.tokenizer.encode(text)
        plan = [PlanItem("text", enable_cfg=1, loss=0), PlanItem("vae_image", enable_cfg=0, loss=1)]
        return Sample(plan, [ids], [SampleImage.from_transform(picture, target, args)], num_tokens + len(ids), origin)
