"""Small crafted datasets for tests: good rows from real photos, plus any bad rows a test wants."""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from PIL import Image

_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "immunohistochemistry", "hubble_deep_field", "coins")


def photo(i: int, rs: np.random.RandomState, lo: int = 80, hi: int = 300) -> Image.Image:
    """A random crop of a real photograph (skimage.data), resized to a random size in [lo, hi]."""
    import skimage.data

    name = _PHOTOS[i % len(_PHOTOS)]
    arr = getattr(skimage.data, name)()
    img = Image.fromarray(arr).convert("RGB")
    w, h = img.size
    cw, ch = rs.randint(w // 2, w + 1), rs.randint(h // 2, h + 1)
    x, y = rs.randint(0, w - cw + 1), rs.randint(0, h - ch + 1)
    img = img.crop((x, y, x + cw, y + ch))
    return img.resize((int(rs.randint(lo, hi)), int(rs.randint(lo, hi))), Image.Resampling.BILINEAR)


def jpeg(img: Image.Image, quality: int = 85) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


WORDS = ("a photo of the red bird flying over calm water near old stone bridge with trees and "
         "mountains under bright sky while people walk along the path holding umbrellas").split()


def sentence(rs: np.random.RandomState, lo: int = 4, hi: int = 30) -> str:
    return " ".join(WORDS[i] for i in rs.randint(0, len(WORDS), rs.randint(lo, hi))).capitalize() + "."


@dataclass
class Dataset:
    root: str
    groups: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def config(self, *, knobs: dict | None = None, prepack: dict | None = None, num_workers: int = 1,
               seed: int = 42, tokenizer: str = "qwen2-offline") -> str:
        """Write a config YAML next to the data and return its path."""
        cfg = {
            "seed": seed,
            "tokenizer": tokenizer,
            "dataloader": {"num_workers": num_workers},
            "dataset": {"grouped_datasets": self.groups, "dataset_info": self.info, **(knobs or {})},
            "prepack": {"world_size": 1, "batches_per_stream": 4, **(prepack or {})},
        }
        path = os.path.join(self.root, "config.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        return path


VAE_ARGS = {"image_stride": 16, "max_image_size": 256, "min_image_size": 64}
VIT_ARGS = {"image_stride": 14, "max_image_size": 224, "min_image_size": 56}


def add_t2i(ds: Dataset, rows_per_file: list[list[dict]], *, row_group_size: int = 3, weight: float = 1.0,
            mandatory: bool = False, num_used: int | None = None, name: str = "t2i") -> None:
    """rows: dicts with 'image' (bytes) and 'captions' (str), or any columns a test wants."""
    d = os.path.join(ds.root, name)
    os.makedirs(d, exist_ok=True)
    for i, rows in enumerate(rows_per_file):
        table = pa.Table.from_pylist(rows)
        pq.write_table(table, os.path.join(d, f"part-{i:05d}.parquet"), row_group_size=row_group_size)
    ds.groups["t2i_pretrain"] = {
        "dataset_names": [name], "image_transform_args": dict(VAE_ARGS), "is_mandatory": mandatory,
        "num_used_data": [num_used or len(rows_per_file)], "weight": weight,
    }
    ds.info["t2i_pretrain"] = {name: {"data_dir": d}}


def add_edit(ds: Dataset, rows_per_file: list[list[dict]], *, row_group_size: int = 2, weight: float = 1.0,
             mandatory: bool = False, name: str = "edit") -> None:
    d = os.path.join(ds.root, name, "images")
    os.makedirs(d, exist_ok=True)
    info = {}
    for i, rows in enumerate(rows_per_file):
        path = os.path.abspath(os.path.join(d, f"edit-{i:05d}.parquet"))
        table = pa.Table.from_pylist(rows)
        pq.write_table(table, path, row_group_size=row_group_size)
        info[path] = {"num_row_groups": pq.ParquetFile(path).num_row_groups}
    info_path = os.path.join(ds.root, name, "parquet_info.json")
    with open(info_path, "w") as f:
        json.dump(info, f)
    ds.groups["unified_edit"] = {
        "dataset_names": [name], "image_transform_args": dict(VAE_ARGS), "vit_image_transform_args": dict(VIT_ARGS),
        "is_mandatory": mandatory, "num_used_data": [len(rows_per_file)], "weight": weight,
    }
    ds.info["unified_edit"] = {name: {"data_dir": d, "parquet_info_path": info_path}}


def add_sft(ds: Dataset, lines: list[str | bytes], files: dict[str, bytes] | None = None, *, weight: float = 1.0,
            mandatory: bool = False, frames: dict | None = None, shuffle_lines: bool = False,
            name: str = "vlm", num_used: int | None = None) -> None:
    """lines: raw JSONL lines (str or bytes, newline added if missing); files: relpath -> bytes."""
    d = os.path.join(ds.root, name, "images")
    os.makedirs(d, exist_ok=True)
    for rel, data in (files or {}).items():
        p = os.path.join(d, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
    jsonl = os.path.join(ds.root, name, "train.jsonl")
    with open(jsonl, "wb") as f:
        for line in lines:
            b = line.encode() if isinstance(line, str) else line
            f.write(b if b.endswith((b"\n", b"\r")) else b + b"\n")
    ds.groups["vlm_sft"] = {
        "dataset_names": [name],
        "image_transform_args": {"image_stride": 14, "max_image_size": 280, "min_image_size": 56, "max_pixels": 60000},
        "frame_sampler_args": frames or {"max_num_frames": 6, "min_num_frames": 3},
        "is_mandatory": mandatory, "shuffle_lines": shuffle_lines, "shuffle_seed": 0,
        "num_used_data": [num_used or len(lines)], "weight": weight,
    }
    ds.info["vlm_sft"] = {name: {"data_dir": d, "jsonl_path": jsonl}}


def captioned_rows(rs: np.random.RandomState, n: int, side: int, words: int) -> list[dict]:
    """t2i rows of one ``side``-pixel picture and a caption of ``words`` to ``words + 20`` words."""
    return [{"image": jpeg(photo(i, rs, side, side + 1)),
             "captions": json.dumps({"c": sentence(rs, words, words + 20)})} for i in range(n)]


def good_t2i_rows(rs: np.random.RandomState, n: int, start: int = 0) -> list[dict]:
    rows = []
    for i in range(n):
        caps = {f"caption_{j}": sentence(rs) for j in range(rs.randint(1, 4))}
        rows.append({"image": jpeg(photo(start + i, rs)), "captions": json.dumps(caps)})
    return rows


def good_edit_rows(rs: np.random.RandomState, n: int, start: int = 0) -> list[dict]:
    rows = []
    for i in range(n):
        k = rs.randint(2, 5)
        base = photo(start + i, rs)
        imgs = [jpeg(base)] + [jpeg(base.rotate(15 * (j + 1)).resize(base.size)) for j in range(k - 1)]
        instr = [[sentence(rs, 3, 10) for _ in range(rs.randint(1, 4))] for _ in range(k - 1)]
        rows.append({"image_list": imgs, "instruction_list": instr})
    return rows


def good_sft(rs: np.random.RandomState, n: int) -> tuple[list[str], dict[str, bytes]]:
    lines, files = [], {}
    for i in range(n):
        kind = i % 4
        if kind == 3:
            lines.append(json.dumps({"conversations": [
                {"from": "human", "value": sentence(rs)}, {"from": "gpt", "value": sentence(rs, 10, 60)}]}))
            continue
        names = [f"img_{i}_{j}.jpg" for j in range(1 if kind < 2 else 2)]
        for nm in names:
            files[nm] = jpeg(photo(i, rs))
        q = "".join("<image>\n" for _ in names) + sentence(rs)
        lines.append(json.dumps({"image": names if len(names) > 1 or kind == 1 else names[0], "conversations": [
            {"from": "human", "value": q}, {"from": "gpt", "value": sentence(rs, 10, 60)},
            {"from": "human", "value": sentence(rs)}, {"from": "gpt", "value": sentence(rs, 5, 40)}]}))
    return lines, files


def mp4(frames: list[np.ndarray], fps: int = 8) -> bytes:
    """Encode RGB frames as an mp4 with PyAV (decord reads it back)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height = frames[0].shape[1], frames[0].shape[0]
        s.pix_fmt = "yuv420p"
        for f in frames:
            for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    return buf.getvalue()
