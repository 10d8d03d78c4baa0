"""Bad inputs of every kind the packer must survive (bytes built in memory)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

from tests.helpers.datagen import jpeg, photo, png


def truncated_jpeg(rs) -> bytes:
    data = jpeg(photo(1, rs, 120, 200))
    return data[: len(data) * 2 // 3]


def png16(rs) -> bytes:
    arr = (np.asarray(photo(2, rs).convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")  # uint16 -> a 16-bit greyscale PNG
    return buf.getvalue()


def grey_alpha_png(rs) -> bytes:
    return png(photo(3, rs).convert("LA"))


def palette_alpha_png(rs) -> bytes:
    img = photo(4, rs).convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    buf = io.BytesIO()
    img.save(buf, format="PNG", transparency=0)
    return buf.getvalue()


def cmyk_jpeg(rs) -> bytes:
    buf = io.BytesIO()
    photo(5, rs).convert("CMYK").save(buf, format="JPEG")
    return buf.getvalue()


def animated_gif(rs) -> bytes:
    frames = [photo(i, rs, 80, 81).convert("P") for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    return buf.getvalue()


def rgba_png(rs) -> bytes:
    img = photo(6, rs).convert("RGBA")
    a = np.asarray(img).copy()
    a[:, : a.shape[1] // 2, 3] = 0
    return png(Image.fromarray(a, "RGBA"))


def pixel_bomb_png(width: int = 25000, height: int = 20000) -> bytes:
    """A valid PNG header announcing width x height pixels, with a token IDAT: decoding it would
    need gigabytes, so only a header check can refuse it cheaply."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


NOT_AN_IMAGE = b"this is not an image at all"
