"""Image decoding under an explicit per-run policy, and the NaViT resize rule, in uint8.

The reference decodes with PIL globals it sets at import (truncated images accepted, a raised
pixel limit, a 1 GiB PNG text-chunk limit).  We reproduce exactly that decoding, but only inside a
scoped context around each decode (restored afterwards; nothing changes at import), and with our
own pixel limit checked from the header before any pixel is decoded.  Damaged-but-decodable input
is counted as a warning (default) or refused (strict).
"""

from __future__ import annotations

import contextlib
import io
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
from PIL import Image, ImageFile, PngImagePlugin

from prepack.engine.accounting import Drop, Rejected, Warn
from schemas.pixel_index import DecodeFacts

_HIGH_BIT_DEPTH_MODES = {"I", "F", "I;16", "I;16B", "I;16L", "I;16N"}
_ALPHA_MODES_WITHOUT_COMPOSITE = {"LA", "La", "PA"}


@dataclass(frozen=True)
class ImagePolicy:
    """Per-run decoding policy: the pixel limit and whether damaged input is refused."""

    max_pixels: int
    strict: bool = False


# PIL's settings are process-wide: two decodes in threads of one process (two packers in threads,
# a packer beside a thread that audits) must not interleave their save and restore, or the settings
# stay changed for the rest of the process (and whatever else decodes there sees them).
_PIL_SETTINGS = threading.Lock()


@contextlib.contextmanager
def _pil_scope(load_truncated: bool) -> Iterator[None]:
    with _PIL_SETTINGS:
        saved = (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES, PngImagePlugin.MAX_TEXT_CHUNK)
        Image.MAX_IMAGE_PIXELS = None  # our own limit is checked from the header instead
        ImageFile.LOAD_TRUNCATED_IMAGES = load_truncated
        PngImagePlugin.MAX_TEXT_CHUNK = 1024 * 2**20
        try:
            yield
        finally:
            Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES, PngImagePlugin.MAX_TEXT_CHUNK = saved


def _open(source: bytes | str, policy: ImagePolicy, load_truncated: bool) -> Image.Image:
    with _pil_scope(load_truncated):
        img = Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source)
        try:
            w, h = img.size
            if w * h > policy.max_pixels:
                raise Rejected(Drop.IMAGE_OVER_PIXEL_LIMIT, f"{w}x{h} > {policy.max_pixels} pixels")
            img.load()
        except BaseException:
            img.close()
            raise
    return img


def _load(source: bytes | str, policy: ImagePolicy) -> tuple[Image.Image, bool]:
    """Decode fully (as the reference's PIL settings would): (image, whether it was truncated)."""
    if not isinstance(source, (bytes, bytearray, memoryview, str)):
        raise Rejected(Drop.IMAGE_NOT_BYTES, type(source).__name__)
    try:
        return _open(source, policy, load_truncated=False), False
    except Rejected:
        raise
    except OSError:
        pass  # maybe truncated: the reference accepts truncated images, retry as it decodes
    return _open(source, policy, load_truncated=True), True


def observed_damage(img: Image.Image) -> tuple[str, ...]:
    """What the reference's RGB conversion silently damages in ``img`` (policy-free), as the keys
    of the ``Warn`` kinds (what a pixel index stores)."""
    kinds = []
    if img.mode in _HIGH_BIT_DEPTH_MODES:
        kinds.append(Warn.HIGH_BIT_DEPTH_IMAGE_SATURATED.key)
    if img.mode in _ALPHA_MODES_WITHOUT_COMPOSITE and img.info.get("transparency") is None:
        kinds.append(Warn.ALPHA_DROPPED_WITHOUT_COMPOSITE.key)
    if getattr(img, "n_frames", 1) > 1:
        kinds.append(Warn.ANIMATED_IMAGE_FIRST_FRAME_ONLY.key)
    return tuple(kinds)


def decode_observed(source: bytes | str, policy: ImagePolicy) -> tuple[Image.Image, DecodeFacts]:
    """Decode fully and say what the decode saw (size, damage), before any policy but the pixel
    limit (checked from the header, before decoding).  ``apply_facts`` then counts or refuses."""
    img, truncated = _load(source, policy)
    damage = ((Warn.TRUNCATED_IMAGE.key,) if truncated else ()) + observed_damage(img)
    return img, DecodeFacts(img.size[0], img.size[1], damage)


def apply_facts(facts: DecodeFacts, policy: ImagePolicy, warn: Callable[[Warn], None]) -> None:
    """Count (or refuse, in strict mode) a decode's damage, in the order a decode meets it; the
    same call for a picture decoded now and for one whose facts an earlier pack recorded."""
    if facts.width * facts.height > policy.max_pixels:
        raise Rejected(Drop.IMAGE_OVER_PIXEL_LIMIT, f"{facts.width}x{facts.height} > {policy.max_pixels} pixels")
    for key in facts.damage:
        kind = Warn(key)
        if policy.strict and kind.strict is not None:
            raise Rejected(kind.strict)
        warn(kind)


def load_image(source: bytes | str, policy: ImagePolicy, warn: Callable[[Warn], None]) -> Image.Image:
    """Decode fully (as the reference's PIL settings would), counting truncation via ``warn``."""
    img, truncated = _load(source, policy)
    if truncated:
        if policy.strict:
            raise Rejected(Warn.TRUNCATED_IMAGE.strict)
        warn(Warn.TRUNCATED_IMAGE)
    return img




def to_rgb(img: Image.Image) -> Image.Image:
    """RGB, compositing transparency on white (RGBA or a transparency key), as the reference does."""
    if img.mode == "RGBA" or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba.split()[3])
        return white
    if img.mode == "RGB":
        return img  # convert("RGB") would only copy
    return img.convert("RGB")


def to_plain_rgb(img: Image.Image) -> Image.Image:
    """``convert("RGB")`` without compositing (the reference's frame folders)."""
    return img if img.mode == "RGB" else img.convert("RGB")


def decode_rgb(source: bytes | str, policy: ImagePolicy, warn: Callable[[Warn], None]) -> Image.Image:
    """Bytes or a path -> a loaded RGB image (reference ``pil_img2rgb(Image.open(...))``)."""
    img, facts = decode_observed(source, policy)
    apply_facts(facts, policy, warn)
    return to_rgb(img)


def decode_plain_rgb(path: bytes | str, policy: ImagePolicy, warn: Callable[[Warn], None]) -> Image.Image:
    """Frame-folder decoding: the reference uses ``.convert("RGB")`` there, with no compositing."""
    img, facts = decode_observed(path, policy)
    apply_facts(facts, policy, warn)
    return to_plain_rgb(img)


def _make_divisible(value: float, stride: int) -> int:
    return max(stride, int(round(value / stride) * stride))


def _apply_scale(width: int, height: int, scale: float, stride: int) -> tuple[int, int]:
    return _make_divisible(round(width * scale), stride), _make_divisible(round(height * scale), stride)


def navit_size(size: tuple[int, int], *, max_size, min_size, stride: int, max_pixels, img_num: int = 1) -> tuple[int, int]:
    """Target (width, height) of the NaViT resize of a picture of ``size`` (width, height): long edge
    <= max, short edge >= min, both divisible by ``stride``, total pixels <= max_pixels / img_num.
    Same float arithmetic and order as the reference resize, so sizes agree exactly."""
    width, height = size
    scale = min(max_size / max(width, height), 1.0)
    scale = max(scale, min_size / min(width, height))
    new_w, new_h = _apply_scale(width, height, scale, stride)
    if new_w * new_h > max_pixels / img_num:
        scale = max_pixels / img_num / (new_w * new_h)
        new_w, new_h = _apply_scale(new_w, new_h, scale, stride)
    if max(new_w, new_h) > max_size:
        scale = max_size / max(new_w, new_h)
        new_w, new_h = _apply_scale(new_w, new_h, scale, stride)
    return new_w, new_h


def raw_pixels(img: Image.Image, rawmode: str, channels: int) -> np.ndarray:
    """(h, w, channels) uint8 pixels of an RGB image in ``rawmode``, packed by PIL's raw encoder
    in one call ("RGB": the pixels; "RGBX": PIL's own 4-byte storage, for the resize kernel).

    ``np.asarray(img)`` / ``tobytes()`` pack 64 KiB chunks and then join them: a second copy of
    every picture (~1% of packing CPU).  Asking the encoder for the whole image at once gives the
    same bytes in one buffer; should PIL's encoder interface change, the ordinary path is taken.
    """
    w, h = img.size
    if img.mode == "RGB" and w and h:
        try:
            encoder = Image._getencoder("RGB", "raw", rawmode)
            try:
                encoder.setimage(img.im, (0, 0, w, h))
                _, status, data = encoder.encode(w * h * channels + w * 4)
            finally:
                encoder.cleanup()
            if status == 1 and len(data) == w * h * channels:
                return np.frombuffer(data, dtype=np.uint8).reshape(h, w, channels)
        except (AttributeError, TypeError, ValueError, OSError):
            pass
    return np.frombuffer(img.tobytes("raw", rawmode), dtype=np.uint8).reshape(h, w, channels)


def rgb_array(img: Image.Image) -> np.ndarray:
    """(h, w, 3) uint8 pixels of an RGB image."""
    if img.mode != "RGB":
        return np.asarray(img, dtype=np.uint8)
    return raw_pixels(img, "RGB", 3)
