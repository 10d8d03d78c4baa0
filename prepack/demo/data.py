"""A small, deterministic BAGEL-format dataset of all three kinds, made from scikit-image's photos.

Why: the packer, the loader and the comparison with the reference need real-looking inputs of every
kind (t2i parquet, edit parquet with ``parquet_info.json``, LLaVA-style JSONL with images, videos and
frame folders) without downloading anything.  The same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from prepack.demo.media import EDIT_FUNCS, PhotoCache, encode, pan_frames, random_view, write_video
from prepack.demo.text import (
    COMPARE_QUESTIONS,
    EDIT_OPS,
    LOGO,
    LONG_QUESTIONS,
    PHOTOS,
    SHORT_QUESTIONS,
    TEXT_ONLY,
    Photo,
    gpt,
    human,
    long_text,
    make_captions,
    pick,
    video_turns,
)

logger = logging.getLogger(__name__)

T2I_FILES = 4
T2I_ROWS_PER_GROUP = 5
EDIT_FILES = 4
EDIT_ROWS_PER_GROUP = 4
ROW_GROUPS = 2
VIDEO_FRAMES = 30


@dataclass(frozen=True)
class DemoData:
    """Absolute paths of everything :func:`write_demo_data` wrote."""

    root: str
    t2i_dir: str
    t2i_files: tuple[str, ...]
    edit_image_dir: str
    edit_files: tuple[str, ...]
    edit_parquet_info: str
    vlm_image_dir: str
    vlm_jsonl: str
    videos: tuple[str, ...]
    frame_dirs: tuple[str, ...]
    num_t2i_rows: int
    num_edit_rows: int
    num_vlm_rows: int
    files: tuple[str, ...]


# --------------------------------------------------------------------------------------------------
# helpers


def _write_parquet(path: str, columns: dict[str, object], schema: object, rows_per_group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pydict(columns, schema=schema)
    pq.write_table(table, path, row_group_size=rows_per_group, compression="zstd")


def _remove_stale_parquet(directory: str, keep: Sequence[str]) -> None:
    """The reference reads every ``*.parquet`` in a data dir, so leftovers would join the dataset."""
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(".parquet") and path not in keep:
            logger.warning("removing stale %s", path)
            os.remove(path)


# --------------------------------------------------------------------------------------------------
# the three kinds


def _write_t2i(root: str, seed: int, photos: PhotoCache, written: list[str]) -> tuple[str, list[str], int]:
    import pyarrow as pa

    rng = np.random.RandomState([seed, 1])
    out = os.path.join(root, "t2i")
    os.makedirs(out, exist_ok=True)
    rows_per_file = T2I_ROWS_PER_GROUP * ROW_GROUPS
    total = T2I_FILES * rows_per_file
    order = [PHOTOS[i % len(PHOTOS)] for i in rng.permutation(total)]
    rgba_row, palette_row, png_rows = 3, 17, {11, 29}
    files = []
    schema = pa.schema([("image", pa.binary()), ("captions", pa.string())])
    for file_idx in range(T2I_FILES):
        images, captions = [], []
        for row in range(file_idx * rows_per_file, (file_idx + 1) * rows_per_file):
            photo = order[row]
            if row == rgba_row:
                photo = LOGO
                view, coverage = random_view(rng, photos.get(LOGO).convert("RGBA"), hi=700)
                payload = encode(view, "PNG")
                note = ""
            elif row == palette_row:
                view, coverage = random_view(rng, photos.get(photo).convert("RGB"))
                palette = view.quantize(colors=48, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
                payload = encode(palette, "PNG", transparency=0)
                note = "with a reduced colour palette"
            else:
                view, coverage = random_view(rng, photos.get(photo))
                payload = encode(view, "PNG" if row in png_rows else "JPEG")
                note = ""
            images.append(payload)
            captions.append(json.dumps(make_captions(rng, photo, coverage, note)))
        path = os.path.join(out, f"part-{file_idx:05d}.parquet")
        _write_parquet(path, {"image": images, "captions": captions}, schema, T2I_ROWS_PER_GROUP)
        files.append(path)
        written.append(path)
    _remove_stale_parquet(out, files)
    logger.info("t2i: %d rows in %d files under %s", total, len(files), out)
    return out, files, total


def _write_edit(root: str, seed: int, photos: PhotoCache, written: list[str]) -> tuple[str, list[str], str, int]:
    import pyarrow as pa

    rng = np.random.RandomState([seed, 2])
    out = os.path.join(root, "edit", "images")
    os.makedirs(out, exist_ok=True)
    colour = [p for p in PHOTOS if not p.grey]
    ops = sorted(EDIT_OPS)
    rows_per_file = EDIT_ROWS_PER_GROUP * ROW_GROUPS
    schema = pa.schema(
        [("image_list", pa.list_(pa.binary())), ("instruction_list", pa.list_(pa.list_(pa.string())))]
    )
    files, info = [], {}
    for file_idx in range(EDIT_FILES):
        image_lists, instruction_lists = [], []
        for _ in range(rows_per_file):
            photo = colour[rng.randint(len(colour))]
            current, _ = random_view(rng, photos.get(photo).convert("RGB"), lo=200, hi=640)
            chain = [encode(current, "JPEG")]
            instructions = []
            for op in pick(rng, ops, int(rng.randint(1, 4))):
                current = EDIT_FUNCS[op](current, rng)
                chain.append(encode(current, "JPEG"))
                instructions.append(pick(rng, EDIT_OPS[op], int(rng.randint(1, 4))))
            image_lists.append(chain)
            instruction_lists.append(instructions)
        path = os.path.abspath(os.path.join(out, f"edit-{file_idx:05d}.parquet"))
        _write_parquet(path, {"image_list": image_lists, "instruction_list": instruction_lists}, schema,
                       EDIT_ROWS_PER_GROUP)
        files.append(path)
        written.append(path)
        info[path] = {"num_row_groups": ROW_GROUPS}
    _remove_stale_parquet(out, files)
    info_path = os.path.join(root, "edit", "parquet_info.json")
    with open(info_path, "w") as handle:
        handle.write(json.dumps(info, indent=2, sort_keys=True) + "\n")
    written.append(info_path)
    total = EDIT_FILES * rows_per_file
    logger.info("edit: %d rows in %d files under %s", total, len(files), out)
    return out, files, info_path, total


def _write_vlm(root: str, seed: int, photos: PhotoCache, written: list[str]) -> tuple[str, str, list[str], list[str], int]:
    rng = np.random.RandomState([seed, 3])
    image_dir = os.path.join(root, "vlm", "images")
    os.makedirs(image_dir, exist_ok=True)
    counter = [0]

    def save_image(photo: Photo) -> str:
        index = counter[0]
        counter[0] += 1
        view, _ = random_view(rng, photos.get(photo))
        ext = "png" if index % 5 == 4 else "jpg"
        name = f"img_{index:03d}.{ext}"
        with open(os.path.join(image_dir, name), "wb") as handle:
            handle.write(encode(view, "PNG" if ext == "png" else "JPEG"))
        written.append(os.path.join(image_dir, name))
        return name

    def any_photo() -> Photo:
        return PHOTOS[rng.randint(len(PHOTOS))]

    rows: list[dict[str, object]] = []
    for i in range(20):  # single image: short and long answers
        photo = any_photo()
        name = save_image(photo)
        if i % 3 == 0:
            question = SHORT_QUESTIONS[rng.randint(len(SHORT_QUESTIONS))]
            answer = photo.short[rng.randint(len(photo.short))]
        elif i % 3 == 1:
            question, answer = photo.qa[rng.randint(len(photo.qa))]
        else:
            question = LONG_QUESTIONS[rng.randint(len(LONG_QUESTIONS))]
            answer = long_text(rng, photo, 90, 220)
        prompt = f"<image>\n{question}" if rng.randint(4) else f"{question}\n<image>"
        rows.append({"image": name, "conversations": [human(prompt), gpt(answer)]})

    for _ in range(6):  # two images
        a, b = (PHOTOS[int(k)] for k in rng.permutation(len(PHOTOS))[:2])
        names = [save_image(a), save_image(b)]
        question = COMPARE_QUESTIONS[rng.randint(len(COMPARE_QUESTIONS))]
        answer = " ".join(
            [f"The first image shows {a.noun}, while the second shows {b.noun}.", a.details[0]]
            + pick(rng, a.details[1:], int(rng.randint(1, 3)))
            + ["The second picture is quite different.", b.details[0]]
            + pick(rng, b.details[1:], int(rng.randint(1, 3)))
            + ["Apart from both being pictures, they have little in common."]
        )
        layout = rng.randint(2)
        prompt = (f"Image 1: <image>\nImage 2: <image>\n{question}" if layout
                  else f"<image>\n<image>\n{question}")
        rows.append({"image": names, "conversations": [human(prompt), gpt(answer)]})

    for _ in range(5):  # multi-turn about one image
        photo = any_photo()
        name = save_image(photo)
        turns = [human("<image>\n" + SHORT_QUESTIONS[rng.randint(len(SHORT_QUESTIONS))]),
                 gpt(photo.short[rng.randint(len(photo.short))])]
        for question, answer in pick(rng, photo.qa):
            turns += [human(question), gpt(answer)]
        turns += [human(LONG_QUESTIONS[rng.randint(len(LONG_QUESTIONS))]), gpt(long_text(rng, photo, 120, 230))]
        rows.append({"image": name, "conversations": turns})

    for question, sentences in pick(rng, TEXT_ONLY, 4):  # text only
        rows.append({"conversations": [human(question), gpt(" ".join(sentences))]})

    videos, frame_dirs = [], []
    video_dir = os.path.join(image_dir, "videos")
    os.makedirs(video_dir, exist_ok=True)
    for index, size in enumerate([(160, 96), (128, 128), (144, 112)]):
        photo = any_photo()
        frames, direction = pan_frames(rng, photos.get(photo), size, VIDEO_FRAMES)
        path = os.path.join(video_dir, f"clip_{index}.mp4")
        write_video(path, frames, fps=10)
        videos.append(path)
        written.append(path)
        rows.append({"video": f"videos/clip_{index}.mp4", "conversations": video_turns(rng, photo, direction)})

    for label, size, count in (("a", (160, 120), 16), ("b", (120, 160), 12)):
        photo = any_photo()
        frames, direction = pan_frames(rng, photos.get(photo), size, count)
        folder = os.path.join(image_dir, "frames", f"clip_{label}")
        os.makedirs(folder, exist_ok=True)
        for i, frame in enumerate(frames, start=1):
            path = os.path.join(folder, f"frame_{i:05d}.jpg")
            with open(path, "wb") as handle:
                handle.write(encode(Image.fromarray(frame), "JPEG"))
            written.append(path)
        frame_dirs.append(folder)
        rows.append({"video": f"frames/clip_{label}/", "conversations": video_turns(rng, photo, direction)})

    order = rng.permutation(len(rows))
    jsonl = os.path.join(root, "vlm", "train.jsonl")
    with open(jsonl, "w") as handle:
        for i, position in enumerate(order):
            row = {"id": f"demo-{i:03d}", **rows[int(position)]}
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    written.append(jsonl)
    logger.info("vlm: %d rows, %d images, %d videos, %d frame folders under %s",
                len(rows), counter[0], len(videos), len(frame_dirs), image_dir)
    return image_dir, jsonl, videos, frame_dirs, len(rows)


def write_demo_data(out_dir: str | os.PathLike[str], *, seed: int = 0) -> DemoData:
    """Write the demo dataset under ``out_dir``; the same seed rewrites the same bytes.

    Paths stored in data files are absolute (``os.path.abspath``) where the reference needs them:
    the keys of ``edit/parquet_info.json`` must equal ``os.path.join(data_dir, name)``.
    """
    root = os.path.abspath(os.fspath(out_dir))
    os.makedirs(root, exist_ok=True)
    logger.info("writing demo data (seed %d) to %s", seed, root)
    photos = PhotoCache()
    written: list[str] = []
    t2i_dir, t2i_files, t2i_rows = _write_t2i(root, seed, photos, written)
    edit_dir, edit_files, info_path, edit_rows = _write_edit(root, seed, photos, written)
    vlm_dir, jsonl, videos, frame_dirs, vlm_rows = _write_vlm(root, seed, photos, written)
    return DemoData(
        root=root,
        t2i_dir=t2i_dir,
        t2i_files=tuple(t2i_files),
        edit_image_dir=edit_dir,
        edit_files=tuple(edit_files),
        edit_parquet_info=info_path,
        vlm_image_dir=vlm_dir,
        vlm_jsonl=jsonl,
        videos=tuple(videos),
        frame_dirs=tuple(frame_dirs),
        num_t2i_rows=t2i_rows,
        num_edit_rows=edit_rows,
        num_vlm_rows=vlm_rows,
        files=tuple(sorted(written)),
    )
