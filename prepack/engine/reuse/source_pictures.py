"""Source pictures that know what they are: content key, decode facts, and pixels on demand.

A source decodes a picture to learn its size (the NaViT target) and its damage (warnings, strict
drops); the resize runs later, when the sample is packed.  ``PictureStore.rgb``/``plain`` do the
first part once per picture and remember its identity (``schemas.pixel_index.PictureSource``: the
XXH3-128 of its encoded bytes and how they are decoded), so the writer can index where its
pixels land, and a later pack can take them instead of decoding and resizing again.

With a reuse provider (``prepack.engine.reuse.earlier_pixels``), a picture whose decode facts are known is not
decoded at all: the facts are replayed through the same policy as a fresh decode (same drops,
same warnings, same order), and each resize target is first looked up; only a miss (or a reused
frame that fails its check) decodes the kept bytes.  Nothing here changes a byte of the output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import PIL
from PIL import Image

from prepack.engine.decode import ImagePolicy, apply_facts, decode_observed, to_plain_rgb, to_rgb
from prepack.engine.resize import resize_pixels
from schemas.pixel_index import DecodeFacts, PictureSource, content_key
from schemas.pixel_table import StoredImage

log = logging.getLogger(__name__)

# The resize's exact implementation: the pixels of a target depend on this and nothing else.
RESIZE_IMPL = f"pillow-{PIL.__version__}-bicubic-antialias"


class PixelProvider(Protocol):
    """Where earlier pixels come from (``prepack.engine.reuse.PixelReuse``)."""

    def facts(self, key: tuple[bytes, str]) -> DecodeFacts | None: ...

    def fetch(self, source: PictureSource, width: int, height: int) -> StoredImage | None:
        """The pixels stored for this picture and target, checked (coded, or a frame the writer
        passes through); None: none (or none that holds)."""

    def prefetch(self, source: PictureSource, width: int, height: int) -> None:
        """This target will be fetched: a provider on a store may start reading it now."""

    counts: "ReuseCounts"  # where the provider counts its fallbacks: the store counts into the same


@dataclass
class ReuseCounts:
    """How the stream's resizes were served (done.json's ``reuse``; never in a checkpoint, so a
    reused pack's checkpoints are a fresh pack's bytes)."""

    images: int = 0  # resizes asked for (every packed image, video frames included)
    reused: int = 0  # served from earlier pixels
    frames_passed: int = 0  # of them, frames written as they were stored (not decompressed nor compressed)
    frames_recompressed: int = 0  # of them, frames of another format than the writer's: decompressed, compressed anew
    frames_read_ahead: int = 0  # frames on a store whose read started before they were asked for
    decodes_saved: int = 0  # pictures never decoded
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> reused pixels refused, decoded instead

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def to_json(self) -> dict:
        return {"images": self.images, "reused": self.reused, "frames_passed": self.frames_passed,
                "frames_recompressed": self.frames_recompressed, "frames_read_ahead": self.frames_read_ahead,
                "decodes_saved": self.decodes_saved,
                "fallbacks": dict(sorted(self.fallbacks.items()))}


class Picture:
    """A decoded-on-demand source picture: its identity and size are known, its pixels are made
    (or taken from earlier ones) per resize target."""

    __slots__ = ("source", "size", "_image", "_data", "_store", "_load")

    def __init__(self, source: PictureSource, image: Image.Image | None, data: bytes | None, store: "PictureStore",
                 load: "Callable[[], Image.Image] | None" = None):
        self.source = source
        self.size = (source.facts.width, source.facts.height)
        self._image = image
        self._data = data  # the encoded bytes while no image is decoded
        self._store = store
        self._load = load  # how a video frame is decoded when a target misses (no bytes of its own)

    @property
    def width(self) -> int:
        return self.size[0]

    @property
    def height(self) -> int:
        return self.size[1]

    def image(self) -> Image.Image:
        """The decoded RGB picture (decoded now if it was not: its facts were counted already)."""
        if self._image is None:
            if self._load is not None:
                self._image, self._load = self._load(), None
            else:
                self._image = self._store.decode_again(self.source, self._data)
                self._data = None
            self._store.counts.decodes_saved -= 1
        return self._image

    def will_resize(self, width: int, height: int) -> None:
        """``resized(width, height)`` will be asked for (when the sample is packed): earlier pixels
        on a store start their read now."""
        provider = self._store.provider
        if provider is not None:
            provider.prefetch(self.source, width, height)

    def resized(self, width: int, height: int) -> "np.ndarray | StoredImage":
        """The resize's (height, width, 3) uint8 pixels, or an earlier table's (``StoredImage``) when
        they are provably these."""
        got = self.earlier(width, height)
        return got if got is not None else resize_pixels(self.image(), width, height)

    def earlier(self, width: int, height: int) -> StoredImage | None:
        """One resize to (width, height) asked for (counted): an earlier table's pixels when they
        are provably these, else None, and the caller resizes ``image()`` (``resized``, or
        ``SampleImage.code_into`` straight into its table slot)."""
        store = self._store
        store.counts.images += 1
        if store.provider is not None:
            got = store.provider.fetch(self.source, width, height)
            if got is not None:
                store.counts.reused += 1
                store.counts.frames_passed += got.frame is not None
                return got
        return None


class PictureStore:
    """Decodes a stream's source pictures under its policy, counting into its warnings."""

    def __init__(self, policy: ImagePolicy, warn: Callable[[str], None], provider: PixelProvider | None = None):
        self.policy = policy
        self.warn = warn
        self.provider = provider
        self.counts = provider.counts if provider is not None else ReuseCounts()

    def rgb(self, data: "bytes | str") -> Picture:
        """The reference's ``pil_img2rgb(Image.open(...))``: transparency composited on white."""
        return self._picture(data, "rgb")

    def plain(self, data: "bytes | str") -> Picture:
        """Frame folders: ``Image.open(...).convert("RGB")``, no compositing."""
        return self._picture(data, "plain")

    def _picture(self, data: "bytes | str", decode: str) -> Picture:
        if isinstance(data, str):
            with open(data, "rb") as f:  # by content, not path: the key needs the bytes
                data = f.read()
        key = content_key(data)
        known = self.provider.facts((key, decode)) if self.provider is not None else None
        if known is not None:
            apply_facts(known, self.policy, self.warn)  # the same drops and warnings as a decode
            self.counts.decodes_saved += 1  # until a target misses (``Picture.image``)
            return Picture(PictureSource(key, decode, known), None, data, self)
        img, facts = decode_observed(data, self.policy)
        apply_facts(facts, self.policy, self.warn)
        return Picture(PictureSource(key, decode, facts), _convert(img, decode), None, self)

    def video_frames(self, video: bytes, indices: "list[int]", images: "list[Image.Image] | None" = None,
                     decode: "Callable[[], np.ndarray] | None" = None) -> "list[Picture] | None":
        """Keyed frames of a video file (decord): each frame's key is the video's content key and its
        frame index.  With ``images`` (decoded) they are wrapped as they are; without, the frames are
        served from earlier pixels when every frame's facts are known, ``decode()`` (the (n, h, w, 3)
        frames, decoded once for all) running only if a target misses — else None (decode them)."""
        video_key = content_key(video)
        keys = [content_key(video_key + int(i).to_bytes(8, "little")) for i in indices]
        if images is not None:
            return [Picture(PictureSource(k, "video", DecodeFacts(*im.size)), im, None, self)
                    for k, im in zip(keys, images)]
        if self.provider is None or decode is None:
            return None
        facts = [self.provider.facts((k, "video")) for k in keys]
        if not keys or any(f is None for f in facts):
            return None
        decoded: list[np.ndarray] = []

        def frame(j: int) -> Image.Image:
            if not decoded:
                decoded.append(decode())
            return Image.fromarray(decoded[0][j])

        self.counts.decodes_saved += len(keys)  # until a target misses (``Picture.image``)
        return [Picture(PictureSource(k, "video", f), None, None, self, load=lambda j=j: frame(j))
                for j, (k, f) in enumerate(zip(keys, facts))]

    def decode_again(self, source: PictureSource, data: bytes) -> Image.Image:
        """Decode bytes whose facts were replayed (a reused picture that one target missed)."""
        img, facts = decode_observed(data, ImagePolicy(max_pixels=max(self.policy.max_pixels, facts_pixels(source)),
                                                       strict=False))
        if facts != source.facts:  # the same bytes decode the same way: anything else is a bug
            raise RuntimeError(f"picture {source.content.hex()} decoded as {facts}, its index said {source.facts}")
        return _convert(img, source.decode)


def facts_pixels(source: PictureSource) -> int:
    return source.facts.width * source.facts.height


def _convert(img: Image.Image, decode: str) -> Image.Image:
    return to_rgb(img) if decode == "rgb" else to_plain_rgb(img)
