"""Video frame sampling (mp4 through decord, or a folder of extracted frames), reference draws.

The number of frames is drawn with NumPy (``randint(min, max + 1)``), then one frame per equal
interval with ``random.choice``; when an interval is empty the draw falls back to a NumPy
permutation (after whatever ``choice`` calls already happened, as in the reference).
"""

from __future__ import annotations

import os
import random
import re
import numpy as np
from PIL import Image

from prepack.engine.accounting import Drop, Rejected
from prepack.engine.decode import decode_plain_rgb
from prepack.engine.reuse.source_pictures import Picture
from prepack.engine.sources import files
from prepack.engine.sources.base import StreamContext
from prepack.engine.sources.readahead import DIRECT, Prefetched
from schemas.config import FrameSamplerArgs

_FRAME_NUMBER = re.compile(r"_(\d+).jpg$")


def frame_indices(num_frames: int, vlen: int, mode: str, rngs: "tuple[random.Random, np.random.RandomState]",
                  input_fps: float = 1, max_num_frames: int = -1) -> list[int]:
    """Indices of the frames to keep (reference ``get_frame_indices`` semantics; its ``fix_start``,
    which no caller of the reference's samplers passes, is left out); ``rngs``: the stream's two."""
    py, rs = rngs
    if mode in ("rand", "middle"):
        count = min(num_frames, vlen)
        edges = np.linspace(start=0, stop=vlen, num=count + 1).astype(int)
        spans = [(int(edges[i]), int(edges[i + 1]) - 1) for i in range(len(edges) - 1)]
        if mode == "rand":
            picked: list = []
            try:
                for lo, hi in spans:
                    picked.append(py.choice(range(lo, hi)))
            except IndexError:
                perm = rs.permutation(vlen)[:count]
                perm.sort()
                picked = list(perm)
        else:
            picked = [(lo + hi) // 2 for lo, hi in spans]
        if len(picked) < num_frames:
            padded = [picked[-1]] * num_frames  # IndexError on an empty video, as in the reference
            padded[: len(picked)] = picked
            picked = padded
        return picked
    if mode.startswith("fps"):
        out_fps = float(mode[3:])
        duration = float(vlen) / input_fps
        delta = 1 / out_fps
        seconds = np.arange(0 + delta / 2, duration + delta / 2, delta)
        idx = [e for e in np.around(seconds * input_fps).astype(int) if e < vlen]
        if max_num_frames > 0 and len(idx) > max_num_frames:
            idx = idx[:max_num_frames]
        return idx
    raise ValueError(f"unknown frame sampling mode {mode!r}")


def _frame_number(name: str) -> int:
    m = _FRAME_NUMBER.search(name)
    return int(m.group(1)) if m else -1


def frame_names_in_order(names: list[str]) -> list[str]:
    """A frame folder's file names in the order they are read: by the ``_NNN.jpg`` suffix (others first)."""
    return sorted(names, key=lambda n: _frame_number(os.path.basename(n)))


def read_video_file(path: str, args: FrameSamplerArgs, ctx: "StreamContext",
                    objects: Prefetched = DIRECT) -> "list[Picture | Image.Image]":
    """Frames of an mp4 (or anything decord reads).  With the stream's ``pictures`` the frames are
    keyed by the video's content and frame index; when earlier pixels hold every sampled frame, none
    is decoded (the container is still opened: its length and rate decide which frames are drawn)."""
    rs, policy, pictures = ctx.np_rng, ctx.image_policy, ctx.pictures
    import decord  # heavy and only needed for video rows

    source = objects.video_source(path)
    reader = decord.VideoReader(source, num_threads=1)
    vlen = len(reader)
    fps = reader.get_avg_fps()
    count = rs.randint(args.min_num_frames, args.max_num_frames + 1)
    idx = frame_indices(count, vlen, args.sample, (ctx.py_rng, rs), input_fps=fps)
    video = _video_bytes(source) if pictures is not None else b""
    if pictures is not None and len(idx):
        known = pictures.video_frames(video, [int(i) for i in idx], decode=lambda: reader.get_batch(idx).asnumpy())
        if known is not None:
            if known[0].width * known[0].height > policy.max_pixels:
                raise Rejected(Drop.IMAGE_OVER_PIXEL_LIMIT, f"video frame {known[0].width}x{known[0].height}")
            return known
    height, width = reader[int(idx[0])].shape[:2] if len(idx) else (0, 0)
    if height * width > policy.max_pixels:
        raise Rejected(Drop.IMAGE_OVER_PIXEL_LIMIT, f"video frame {width}x{height}")
    frames = reader.get_batch(idx).asnumpy()
    images = [Image.fromarray(frames[i]) for i in range(frames.shape[0])]
    if pictures is not None:
        return pictures.video_frames(video, [int(i) for i in idx], images)
    return images


def _video_bytes(source) -> bytes:
    """The bytes decord reads (a path, or the in-memory file of an object): the frames' key."""
    if isinstance(source, str):
        with open(source, "rb") as f:
            return f.read()
    return source.getvalue()


def read_frame_folder(path: str, args: FrameSamplerArgs, ctx: "StreamContext",
                      objects: Prefetched = DIRECT) -> "list[Picture | Image.Image]":
    """Frames of a folder of images, ordered by the ``_NNN.jpg`` suffix (others first)."""
    rs, pictures = ctx.np_rng, ctx.pictures
    names = frame_names_in_order(objects.list_names(path))
    if pictures is not None:
        frames = [pictures.plain(objects.media(files.join(path, n))) for n in names]
    else:
        frames = [decode_plain_rgb(objects.media(files.join(path, n)), ctx.image_policy, ctx.counters.warn)
                  for n in names]
    count = rs.randint(args.min_num_frames, args.max_num_frames + 1)
    if len(frames) > count:
        frames = [frames[i] for i in frame_indices(count, len(frames), args.sample, (ctx.py_rng, rs))]
    return frames


def sample_frames(path: str, args: FrameSamplerArgs, ctx: "StreamContext",
                  objects: Prefetched = DIRECT) -> "list[Picture | Image.Image]":
    """A trailing slash names a frame folder, anything else a video file (reference rule).  ``ctx``:
    the stream's random generators, image policy, warnings and picture store; ``objects``: where the
    bytes come from (what a read-ahead fetched; by default direct reads).
    """
    if path.endswith("/"):
        return read_frame_folder(path, args, ctx, objects)
    return read_video_file(path, args, ctx, objects)
