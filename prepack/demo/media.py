"""Demo dataset pictures and videos: photo loading, random views, edits, JPEG/PNG and MPEG-4."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from fractions import Fraction

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from prepack.demo.text import Photo

JPEG_QUALITY = 88


def scale_channels(image: Image.Image, factors: tuple[float, float, float]) -> Image.Image:
    channels = [band.point(lambda v, f=f: min(255, int(v * f + 0.5))) for band, f in zip(image.split(), factors)]
    return Image.merge("RGB", channels)


def zoom(image: Image.Image, rng: np.random.RandomState) -> Image.Image:
    keep = rng.uniform(0.7, 0.85)
    w, h = image.size
    cw, ch = int(w * keep), int(h * keep)
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    return image.crop((x0, y0, x0 + cw, y0 + ch)).resize((w, h), Image.Resampling.BICUBIC)


EDIT_FUNCS: dict[str, Callable[[Image.Image, np.random.RandomState], Image.Image]] = {
    "mirror": lambda im, rng: ImageOps.mirror(im),
    "upside_down": lambda im, rng: ImageOps.flip(im),
    "rotate": lambda im, rng: im.transpose(Image.Transpose.ROTATE_270),
    "warm": lambda im, rng: scale_channels(im, (1.15, 1.05, 0.8)),
    "cool": lambda im, rng: scale_channels(im, (0.8, 0.95, 1.2)),
    "grey": lambda im, rng: ImageOps.grayscale(im).convert("RGB"),
    "zoom": zoom,
    "blur": lambda im, rng: im.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(1.5, 3.5)))),
    "brighter": lambda im, rng: ImageEnhance.Brightness(im).enhance(float(rng.uniform(1.25, 1.5))),
    "darker": lambda im, rng: ImageEnhance.Brightness(im).enhance(float(rng.uniform(0.5, 0.7))),
    "contrast": lambda im, rng: ImageEnhance.Contrast(im).enhance(1.6),
    "vivid": lambda im, rng: ImageEnhance.Color(im).enhance(1.8),
    "invert": lambda im, rng: ImageOps.invert(im),
    "posterize": lambda im, rng: ImageOps.posterize(im, 3),
}


class PhotoCache:
    """Loads each scikit-image photo once per run, as a PIL image."""

    def __init__(self) -> None:
        self._cache: dict[str, Image.Image] = {}

    def get(self, photo: Photo) -> Image.Image:
        if photo.key not in self._cache:
            from skimage import data

            array = getattr(data, photo.key)()
            if isinstance(array, tuple):  # stereo_motorcycle: (left, right, disparity)
                array = array[0]
            image = Image.fromarray(np.ascontiguousarray(array))
            if photo.grey:
                image = image.convert("L")
            elif image.mode not in ("RGB", "RGBA"):
                image = image.convert("RGB")
            self._cache[photo.key] = image
        return self._cache[photo.key]


def random_view(
    rng: np.random.RandomState, image: Image.Image, lo: int = 200, hi: int = 900
) -> tuple[Image.Image, float]:
    """A random crop with a random aspect ratio, rescaled so each side lies in [lo, hi].

    Returns the view and the fraction of the photo's area it covers (used to word captions).
    """
    w, h = image.size
    aspect = float(np.exp(rng.uniform(np.log(0.55), np.log(1.9))))  # width / height
    area = rng.uniform(0.35, 1.0) * w * h
    cw = int(min(w, round(np.sqrt(area * aspect))))
    ch = int(min(h, round(cw / aspect)))
    cw = int(min(w, max(cw, round(ch * 0.55))))
    x0 = int(rng.randint(0, w - cw + 1))
    y0 = int(rng.randint(0, h - ch + 1))
    crop = image.crop((x0, y0, x0 + cw, y0 + ch))
    smin = lo / min(cw, ch)
    smax = hi / max(cw, ch)
    scale = float(rng.uniform(smin, smax)) if smin < smax else smax
    size = (max(lo, min(hi, round(cw * scale))), max(lo, min(hi, round(ch * scale))))
    return crop.resize(size, Image.Resampling.LANCZOS), (cw * ch) / (w * h)


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    if fmt == "JPEG":
        image.save(buffer, format="JPEG", quality=JPEG_QUALITY, **options)
    else:
        image.save(buffer, format="PNG", **options)
    return buffer.getvalue()


def yuv420_frame(rgb: np.ndarray) -> object:
    """A yuv420p frame (BT.601, limited range) converted here, with every byte of each plane set.

    Encoders read a little past the visible width; frames converted by PyAV leave that padding
    uninitialised, which made the output bytes vary from run to run.
    """
    import av

    height, width = rgb.shape[:2]
    r, g, b = (rgb[..., i].astype(np.float64) for i in range(3))
    y = 16.0 + (65.481 * r + 128.553 * g + 24.966 * b) / 255.0
    cb = 128.0 + (-37.797 * r - 74.203 * g + 112.0 * b) / 255.0
    cr = 128.0 + (112.0 * r - 93.786 * g - 18.214 * b) / 255.0

    def subsample(plane: np.ndarray) -> np.ndarray:
        return plane.reshape(height // 2, 2, width // 2, 2).mean(axis=(1, 3))

    frame = av.VideoFrame(width, height, "yuv420p")
    for plane, values in zip(frame.planes, (y, subsample(cb), subsample(cr))):
        padded = np.zeros((plane.height, plane.line_size), np.uint8)
        padded[: values.shape[0], : values.shape[1]] = np.clip(np.rint(values), 0, 255).astype(np.uint8)
        plane.update(padded.tobytes())
    return frame


def write_video(path: str, frames: Sequence[np.ndarray], fps: int) -> None:
    """An MPEG-4 part 2 mp4 that decord reads, byte-identical on rerun.

    Not H.264: libx264 reads past the visible frame, and its bytes changed between identical
    single-threaded runs.  Frames are converted here so no uninitialised byte reaches the encoder.
    """
    import av

    height, width = frames[0].shape[:2]
    if height % 16 or width % 16:
        raise ValueError(f"video size must be a multiple of 16, got {width}x{height}")
    with av.open(path, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(fps, 1))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.thread_count = 1
        stream.bit_rate = 600_000
        for frame in frames:
            for packet in stream.encode(yuv420_frame(frame)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def pan_frames(
    rng: np.random.RandomState, image: Image.Image, size: tuple[int, int], count: int
) -> tuple[list[np.ndarray], str]:
    """Frames of a camera panning across ``image``; returns them and the direction in words."""
    width, height = size
    base = image.convert("RGB")
    zoom = rng.uniform(1.6, 2.2)
    scale = zoom * max(width / base.width, height / base.height)
    big = np.asarray(base.resize((round(base.width * scale), round(base.height * scale)), Image.Resampling.BICUBIC))
    span_x, span_y = big.shape[1] - width, big.shape[0] - height
    horizontal = span_x >= span_y
    forward = bool(rng.randint(2))
    frames = []
    for i in range(count):
        t = i / (count - 1)
        t = t if forward else 1.0 - t
        x = round(t * span_x) if horizontal else span_x // 2
        y = round(t * span_y) if not horizontal else span_y // 2
        frames.append(np.ascontiguousarray(big[y : y + height, x : x + width]))
    if horizontal:
        direction = "from left to right" if forward else "from right to left"
    else:
        direction = "from top to bottom" if forward else "from bottom to top"
    return frames, direction

