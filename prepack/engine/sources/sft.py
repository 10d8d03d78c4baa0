"""``vlm_sft``: JSONL conversations with images, multiple images or a video.

Lines are read with Python's universal-newline rules (a bare carriage return ends a line, as the
reference's ``readlines()`` does), so row numbering matches; a line that is not valid UTF-8 is one
dropped row instead of a crashed file.  Per file: optional seeded line shuffle, then the first
``num_used_data`` lines.  All files' lines are sorted by (text, image dir) and sliced per stream.
Image and video paths must stay inside the data directory (absolute paths, ``~``, ``..`` and URIs
are refused), on a local disk and on an object store alike.
Data index: the row's position in this stream's slice (an int).
"""

from __future__ import annotations

import io
import json
import os
import random
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator

from prepack.engine.accounting import Drop, Rejected, Warn
from prepack.engine.decode import navit_size
from prepack.engine.sample import PlanItem, Sample, SampleImage
from prepack.engine.sources import files
from prepack.engine.sources.base import Source, StreamContext, slice_for_stream
from prepack.engine.sources.frames import frame_names_in_order, sample_frames
from prepack.engine.sources.readahead import DIRECT, Prefetched, Read, Reads
from schemas.config import GroupConfig
from schemas.kinds import SFT
from schemas.packed_batch import SampleOrigin


@dataclass(frozen=True)
class _Line:
    text: str
    data_dir: str
    path: str
    line_no: int
    dataset: str
    valid_utf8: bool


def read_lines(path: str, ledger) -> list[tuple[str, bool]]:
    """(line, decodes-as-UTF-8) pairs with ``readlines()`` newline semantics."""
    raw = files.read_bytes(path)
    ledger.note_bytes(path, raw)
    text = raw.decode("utf-8", errors="surrogateescape")
    out = []
    for line in io.StringIO(text, newline=None).readlines():
        try:
            line.encode("utf-8")
            out.append((line, True))
        except UnicodeEncodeError:
            out.append((line, False))
    return out


def _inside(data_dir: str, rel) -> str:
    """Join a JSONL path onto the data dir, refusing anything that could leave it."""
    if not isinstance(rel, str):
        raise Rejected(Drop.JSONL_BAD_PATH, f"path is {type(rel).__name__}")
    parts = rel.replace("\\", "/").split("/")
    if os.path.isabs(rel) or rel.startswith(("~", "/")) or ".." in parts or "://" in rel:
        raise Rejected(Drop.UNSAFE_PATH_OUTSIDE_DATA_DIR, rel)
    return files.join(data_dir, rel)


@dataclass(frozen=True)
class _Parsed:
    """One JSONL row as far as its reads go: its JSON value and the paths of its media, in the order
    the row reads them.  The row's reads are described from it (``SftSource._reads``) and the row
    reads its media from it (``SftSource._media``), so nothing a row may not read is fetched."""

    item: Any = None
    error: "Exception | None" = None  # the line's own failure (not UTF-8, not JSON): the row raises it
    media: tuple[str, ...] = ()  # its pictures' paths, or its video's (a trailing slash: a frame folder)
    video: bool = False
    refused: "Exception | None" = None  # a path refusal after ``media``: the row fails there


def _parse(line: _Line) -> _Parsed:
    if not line.valid_utf8:
        return _Parsed(error=Rejected(Drop.JSONL_NOT_UTF8))
    try:
        item = json.loads(line.text)
    except ValueError as e:
        return _Parsed(error=Rejected(Drop.JSONL_PARSE, f"bad JSON: {e}"))
    except Exception as e:  # RecursionError on absurd nesting: raised by the row, not a drop
        return _Parsed(error=e)
    if not isinstance(item, dict):
        return _Parsed(item)
    media: list[str] = []
    video = "image" not in item  # an image takes precedence, as in the reference
    try:
        if not video:
            names = item["image"] if type(item["image"]) is list else [item["image"]]
            for n in names:
                media.append(_inside(line.data_dir, n))  # a refusal ends the row's reads
        elif "video" in item:
            media.append(_inside(line.data_dir, item["video"]))
    except Exception as e:
        return _Parsed(item, media=tuple(media), video=video, refused=e)
    return _Parsed(item, media=tuple(media), video=video)


class SftSource(Source):
    kind = SFT

    def __init__(self, group: GroupConfig, ctx: StreamContext):
        super().__init__(group, ctx)
        lines: list[_Line] = []
        for ds, num in zip(group.datasets, group.num_used_data):
            raw = [(t, ok, i) for i, (t, ok) in enumerate(read_lines(ds.jsonl_path, ctx.ledger))]
            if group.shuffle_lines:
                random.Random(group.shuffle_seed).shuffle(raw)
            lines += [_Line(t, ds.data_dir, ds.jsonl_path, i, ds.name, ok) for t, ok, i in raw[:num]]
        self.lines = slice_for_stream(lines, ctx, group.name, key=lambda ln: (ln.text, ln.data_dir))
        self.pos = 0

    def cursor(self) -> dict:
        return {"row": self.pos}

    def _restore_cursor(self, cursor: dict) -> None:
        self.pos = int(cursor["row"])

    def _remote(self) -> bool:
        return any(files.is_uri(ln.data_dir) for ln in self.lines)

    def pass_rows(self, max_files: int = 16) -> int:
        return len(self.lines)

    def _reads(self, cursor: dict) -> Reads:
        """Per row from the cursor on: its media on a store (a frame folder: its listing, then its
        frames), then an end-of-row mark with the row's parse; a mark ends each pass."""
        row = cursor["row"]
        while True:
            while row < len(self.lines):
                parsed = _parse(self.lines[row])
                for path in parsed.media:
                    if not files.is_uri(path):  # read where the row reads it, as the reference does
                        continue
                    if not (parsed.video and path.endswith("/")):
                        yield Read((row, "read", path), partial(files.read_bytes, path))
                        continue
                    try:
                        names = frame_names_in_order((yield Read((row, "list", path), partial(files.list_names, path),
                                                                 needed=True)))
                    except Exception:  # the row fails at its listing; nothing else of it is read
                        continue
                    for name in names:
                        frame = files.join(path, name)
                        yield Read((row, "read", frame), partial(files.read_bytes, frame))
                yield Read((row, "end", ""), info=parsed)
                row += 1
            yield Read(("pass",))
            row = 0

    def _walk(self, reads) -> Iterator[Sample]:
        fetched: dict[tuple[str, str], list] = {}  # the row's objects so far, by (op, path)
        for read, fut in reads:
            if read.key[0] == "pass":
                self.pos = 0
                self._wrapped()
                continue
            row, op, path = read.key
            if op != "end":
                fetched.setdefault((op, path), []).append(fut)
                continue
            objects, fetched = Prefetched(fetched, self.ctx.ledger), {}
            self.pos = row + 1
            line = self.lines[row]
            origin = SampleOrigin(self.group.name, line.dataset, self.ctx.worker_id, [row], True,
                                  line.path, -1, line.line_no)
            try:
                sample = self._row(line, read.info, origin, objects)
            except Rejected as r:
                self._failed(r, f"{line.path}:{line.line_no + 1}")
                continue
            yield sample

    def _media(self, parsed: _Parsed, objects: Prefetched = DIRECT) -> list:
        """The row's pictures, decoded in the reference's order (may draw for video frames)."""
        ctx, item = self.ctx, parsed.item
        if "image" in item:
            pictures = [ctx.pictures.rgb(objects.media(path)) for path in parsed.media]
            if parsed.refused is not None:
                raise parsed.refused
            return pictures
        if "video" in item:
            if parsed.refused is not None:
                raise parsed.refused
            frames = sample_frames(parsed.media[0], self.group.frame_sampler, ctx, objects)
            convs = item["conversations"]
            first = convs[0]
            if "<video>" not in first["value"]:
                raise Rejected(Drop.JSONL_PARSE, "no <video> placeholder in the first turn")
            first["value"] = first["value"].replace("<video>", "<image>" * len(frames))
            if not frames:
                if ctx.image_policy.strict:
                    raise Rejected(Warn.VIDEO_WITHOUT_FRAMES_PACKED_AS_TEXT.strict)
                ctx.counters.warn(Warn.VIDEO_WITHOUT_FRAMES_PACKED_AS_TEXT)
            return frames
        return []

    def _row(self, line: _Line, parsed: _Parsed, origin: SampleOrigin, objects: Prefetched = DIRECT) -> Sample:
        ctx, args = self.ctx, self.group.image_transform
        if parsed.error is not None:
            raise parsed.error
        item = parsed.item
        try:
            pictures = self._media(parsed, objects) if isinstance(item, dict) else None
        except Rejected:
            raise
        except Exception as e:  # the reference's guard around media loading
            raise Rejected(Drop.JSONL_PARSE, f"{type(e).__name__}: {e}") from None
        if not isinstance(item, dict):
            raise Rejected(Drop.JSONL_NOT_OBJECT, type(item).__name__)
        convs = item.get("conversations")
        if not isinstance(convs, list) or not all(
            isinstance(c, dict) and isinstance(c.get("from"), str) and isinstance(c.get("value"), str) for c in convs
        ):
            raise Rejected(Drop.JSONL_BAD_CONVERSATIONS, "needs a list of {from, value} strings")
        images: list[SampleImage] = []
        tokens = 0
        for pic in pictures:
            target = navit_size(pic.size, max_size=args.max_image_size, min_size=args.min_image_size,
                                stride=args.image_stride, max_pixels=args.max_pixels, img_num=len(pictures))
            images.append(SampleImage.from_transform(pic, target, args))
            tokens += target[0] * target[1] // args.image_stride**2
        plan: list[PlanItem] = []
        texts: list[list[int]] = []
        placeholders = 0

        def add_text(text: str, loss: int) -> None:
            nonlocal tokens
            ids = ctx.tokenizer.encode(text)
            if ids:
                texts.append(ids)
                tokens += len(ids)
                plan.append(PlanItem("text", enable_cfg=0, loss=loss))

        for conv in convs:
            if conv["from"] == "human":
                if "<image>" not in conv["value"]:
                    add_text(conv["value"], 0)
                    continue
                pieces = conv["value"].split("<image>")
                for i, piece in enumerate(pieces):
                    if piece.strip() != "":
                        add_text(piece.strip(), 0)
                    if i != len(pieces) - 1 and i < len(images):
                        plan.append(PlanItem("vit_image", enable_cfg=0, loss=0, video_frame=parsed.video))
                        placeholders += 1
            elif conv["from"] == "gpt":
                add_text(conv["value"], 1)
        if not any(p.loss for p in plan):
            raise Rejected(Drop.NO_LOSS_LABELS)
        if placeholders > len(images):  # the reference would crash packing this row
            raise Rejected(Drop.MORE_IMAGE_PLACEHOLDERS_THAN_IMAGES)
        if placeholders < len(images):
            if ctx.image_policy.strict:
                raise Rejected(Warn.IMAGE_WITHOUT_PLACEHOLDER_COUNTED_NOT_PACKED.strict)
            ctx.counters.warn(Warn.IMAGE_WITHOUT_PLACEHOLDER_COUNTED_NOT_PACKED)
        return Sample(plan, texts, images, tokens, origin)
