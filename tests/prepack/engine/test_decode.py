"""``prepack.engine.decode``: the NaViT target size and bicubic resize against the reference's
own transform, and decoding under the per-run policy.

Oracles (NeMo AutoModel 0.7.0, ``nemo_automodel/components/datasets/multimodal``):
- ``transforms.MaxLongEdgeMinShortEdgeResize`` for target sizes (its pixel operation intercepted,
  so huge sizes cost nothing) and, run for real, for resized pixels;
- ``transforms.ImageTransform`` (resize + ToTensor + Normalize, the ViT/VAE transform) for the
  floats the model finally sees from our uint8 pixels;
- ``utils.pil_img2rgb(Image.open(...))`` under the PIL settings the reference installs at import,
  for decoded pixels of good and damaged input; ``video.read_frames_folder`` for frame folders;
- PIL's own decompression-bomb check under those settings, for the default pixel limit.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile, PngImagePlugin

from prepack.engine.accounting import Rejected
from prepack.engine.decode import ImagePolicy, decode_plain_rgb, decode_rgb, load_image, navit_size
from prepack.engine.resize import resize_pixels
from schemas.config import DEFAULT_MAX_IMAGE_PIXELS
from tests.helpers import badgen as bg
from tests.helpers import datagen as dg
from tests.helpers.paths import REPO

ref_transforms = pytest.importorskip("nemo_automodel.components.datasets.multimodal.transforms")
ref_utils = pytest.importorskip("nemo_automodel.components.datasets.multimodal.utils")
ref_video = pytest.importorskip("nemo_automodel.components.datasets.multimodal.video")
pytest.importorskip("nemo_automodel.components.datasets.multimodal.datasets")  # sets the reference's PIL globals

_PIL_KNOBS = ((Image, "MAX_IMAGE_PIXELS"), (ImageFile, "LOAD_TRUNCATED_IMAGES"), (PngImagePlugin, "MAX_TEXT_CHUNK"))


def _pil_settings() -> tuple:
    return tuple(getattr(mod, name) for mod, name in _PIL_KNOBS)


# The PIL settings the reference decodes under: as its import left them (nothing else sets them).
REFERENCE_PIL = _pil_settings()


@contextlib.contextmanager
def _pil_settings_as(values: tuple):
    saved = _pil_settings()
    for (mod, name), v in zip(_PIL_KNOBS, values):
        setattr(mod, name, v)
    try:
        yield
    finally:
        for (mod, name), v in zip(_PIL_KNOBS, saved):
            setattr(mod, name, v)


def reference_rgb(data: bytes) -> np.ndarray:
    with _pil_settings_as(REFERENCE_PIL):
        return np.asarray(ref_utils.pil_img2rgb(Image.open(io.BytesIO(data))))


class _Warnings(list):
    def __call__(self, kind: str) -> None:
        self.append(kind)


DEFAULT = ImagePolicy(max_pixels=DEFAULT_MAX_IMAGE_PIXELS)
STRICT = ImagePolicy(max_pixels=DEFAULT_MAX_IMAGE_PIXELS, strict=True)


# -- NaViT target size ---------------------------------------------------------------------------


def reference_target(width, height, *, max_size, min_size, stride, max_pixels, img_num=1) -> tuple[int, int]:
    """(width, height) the reference resize would produce, with its pixel operation intercepted."""
    from torchvision.transforms import functional

    seen = []

    def record(img, size, *args, **kwargs):
        seen.append(tuple(size))
        return img

    resize = ref_transforms.MaxLongEdgeMinShortEdgeResize(max_size=max_size, min_size=min_size, stride=stride,
                                                          max_pixels=max_pixels)
    with mock.patch.object(functional, "resize", record):
        resize(SimpleNamespace(size=(width, height)), img_num=img_num)
    (h, w), = seen
    return w, h


def _check_size(width, height, max_size, min_size, stride, max_pixels, img_num):
    kw = dict(max_size=max_size, min_size=min_size, stride=stride, max_pixels=max_pixels, img_num=img_num)
    ours = navit_size((width, height), **kw)
    assert ours == reference_target(width, height, **kw), kw
    assert all(type(v) is int for v in ours)


# configured transforms: the repo's demo (VAE, ViT, SFT) and BAGEL's own (VAE 16/1024/512, ViT 14/980/378)
TRANSFORMS = [(512, 256, 16, 14 * 14 * 9 * 1024), (490, 224, 14, 14 * 14 * 9 * 1024), (490, 224, 14, 200704),
              (1024, 512, 16, 14 * 14 * 9 * 1024), (980, 378, 14, 14 * 14 * 9 * 1024), (280, 56, 14, 60000)]


@settings(max_examples=400, deadline=None)
@given(width=st.integers(1, 12000), height=st.integers(1, 12000),
       stride=st.one_of(st.sampled_from([14, 16, 28, 32]), st.integers(1, 64)),
       max_size=st.integers(1, 2048), min_size=st.integers(1, 1024),
       max_pixels=st.one_of(st.integers(1, 4 * 10**6), st.sampled_from([200704, 14 * 14 * 9 * 1024])),
       img_num=st.integers(1, 12))
@example(width=24, height=40, stride=16, max_size=512, min_size=1, max_pixels=10**6, img_num=1)  # x.5 / stride: half-even
@example(width=1, height=12000, stride=14, max_size=490, min_size=224, max_pixels=200704, img_num=1)  # extreme aspect
@example(width=3000, height=2000, stride=14, max_size=980, min_size=378, max_pixels=1, img_num=3)  # pixel cap < stride^2
def test_navit_size_equals_reference(width, height, stride, max_size, min_size, max_pixels, img_num):
    _check_size(width, height, max_size, min_size, stride, max_pixels, img_num)


@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda t: "-".join(map(str, t)))
def test_navit_size_grid_for_configured_transforms(transform):
    max_size, min_size, stride, max_pixels = transform
    sides = sorted({1, 2, stride - 1, stride, stride + 1, min_size - 1, min_size, min_size + 1, max_size - 1, max_size,
                    max_size + 1, 2 * max_size, 333, 640, 1080, 1920, 4000} - {0})
    for w in sides:
        for h in sides:
            for img_num in (1, 2, 5):
                _check_size(w, h, max_size, min_size, stride, max_pixels, img_num)


# -- resized pixels ------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(photo=st.integers(0, 7), seed=st.integers(0, 2**31 - 1), stride=st.sampled_from([8, 14, 16, 28, 32]),
       max_size=st.integers(32, 448), min_size=st.integers(8, 256), max_pixels=st.integers(2000, 200000),
       img_num=st.integers(1, 3))
def test_resize_pixels_equal_reference(photo, seed, stride, max_size, min_size, max_pixels, img_num):
    img = dg.photo(photo, np.random.RandomState(seed), 20, 400)
    kw = dict(max_size=max_size, min_size=min_size, stride=stride, max_pixels=max_pixels)
    ref = ref_transforms.MaxLongEdgeMinShortEdgeResize(**kw)(img, img_num=img_num)
    w, h = navit_size(img.size, **kw, img_num=img_num)
    ours = resize_pixels(img, w, h)
    expected = np.asarray(ref)
    assert ours.dtype == np.uint8 and ours.shape == (h, w, 3)
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("norm", [((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
                                  ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))],
                         ids=["half", "clip"])
@pytest.mark.parametrize("transform", [(512, 256, 16, 14 * 14 * 9 * 1024), (490, 224, 14, 200704)], ids=["vae", "vit"])
def test_uint8_pixels_give_the_reference_transform_floats(norm, transform):
    """Our stored uint8 pixels, normalised by the loader's tables, are bit for bit the floats of the
    reference ViT/VAE ``ImageTransform`` (resize + ToTensor + Normalize)."""
    from loader.normalize import norm_table

    mean, std = norm
    max_size, min_size, stride, max_pixels = transform
    ref_t = ref_transforms.ImageTransform(max_image_size=max_size, min_image_size=min_size, image_stride=stride,
                                          max_pixels=max_pixels, image_mean=mean, image_std=std)
    rs = np.random.RandomState(11)
    for i in range(3):
        img = dg.photo(i, rs, 150, 700)
        expected = ref_t(img)
        w, h = navit_size(img.size, max_size=max_size, min_size=min_size, stride=stride, max_pixels=max_pixels)
        px = torch.from_numpy(resize_pixels(img, w, h).copy()).permute(2, 0, 1).to(torch.int64)  # CHW
        table = norm_table((tuple(mean), tuple(std))).view(3, 256)
        ours = torch.stack([table[c][px[c]] for c in range(3)])
        assert ours.dtype == expected.dtype == torch.float32
        assert torch.equal(ours.view(torch.int32), expected.view(torch.int32))


# -- decoding: good and damaged input -----------------------------------------------------------


@pytest.fixture(scope="module")
def inputs() -> dict[str, bytes]:
    rs = np.random.RandomState(5)
    return {
        "jpeg": dg.jpeg(dg.photo(0, rs)),
        "png": dg.png(dg.photo(1, rs)),
        "truncated_jpeg": bg.truncated_jpeg(rs),
        "png16": bg.png16(rs),
        "grey_alpha_png": bg.grey_alpha_png(rs),
        "palette_alpha_png": bg.palette_alpha_png(rs),
        "rgba_png": bg.rgba_png(rs),
        "cmyk_jpeg": bg.cmyk_jpeg(rs),
        "animated_gif": bg.animated_gif(rs),
        "big_text_png": _png_with_big_text(rs),
    }


def _png_with_big_text(rs) -> bytes:
    """A PNG with a 3 MiB compressed text chunk: over PIL's default text limit, under the reference's."""
    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "x" * (3 * 2**20), zip=True)
    buf = io.BytesIO()
    dg.photo(2, rs).save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()


# kind -> the warnings the default mode counts (in order); the pixels must equal the reference's
EXPECTED_WARNINGS = {
    "jpeg": [], "png": [], "palette_alpha_png": [], "rgba_png": [], "cmyk_jpeg": [], "big_text_png": [],
    "truncated_jpeg": ["truncated_image"],
    "png16": ["high_bit_depth_image_saturated"],
    "grey_alpha_png": ["alpha_dropped_without_composite"],
    "animated_gif": ["animated_image_first_frame_only"],
}


@pytest.mark.parametrize("kind", sorted(EXPECTED_WARNINGS))
def test_decode_rgb_equals_reference_and_counts_damage(inputs, kind):
    data = inputs[kind]
    warn = _Warnings()
    img = decode_rgb(data, DEFAULT, warn)
    assert img.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(img), reference_rgb(data))
    assert warn == EXPECTED_WARNINGS[kind]


def test_decode_from_a_path_equals_decode_from_bytes(inputs, tmp_path):
    for kind in ("jpeg", "truncated_jpeg", "png16"):
        p = tmp_path / f"{kind}.img"
        p.write_bytes(inputs[kind])
        wa, wb = _Warnings(), _Warnings()
        np.testing.assert_array_equal(np.asarray(decode_rgb(str(p), DEFAULT, wa)),
                                      np.asarray(decode_rgb(inputs[kind], DEFAULT, wb)))
        assert wa == wb == EXPECTED_WARNINGS[kind]


@pytest.mark.parametrize("kind", ["truncated_jpeg", "png16", "grey_alpha_png"])
def test_strict_mode_refuses_damaged_input(inputs, kind):
    warn = _Warnings()
    with pytest.raises(Rejected) as info:
        decode_rgb(inputs[kind], STRICT, warn)
    assert info.value.reason == f"strict_{EXPECTED_WARNINGS[kind][0]}"
    assert warn == []


@pytest.mark.parametrize("kind", ["jpeg", "png", "palette_alpha_png", "rgba_png", "cmyk_jpeg", "big_text_png"])
def test_strict_mode_accepts_undamaged_input(inputs, kind):
    warn = _Warnings()
    np.testing.assert_array_equal(np.asarray(decode_rgb(inputs[kind], STRICT, warn)), reference_rgb(inputs[kind]))
    assert warn == []


def test_truncated_jpeg_is_really_truncated(inputs):
    """The premise of the truncated-image tests: plain PIL (truncation not accepted) refuses it."""
    with _pil_settings_as((Image.MAX_IMAGE_PIXELS, False, PngImagePlugin.MAX_TEXT_CHUNK)):
        with pytest.raises(OSError):
            Image.open(io.BytesIO(inputs["truncated_jpeg"])).load()


def test_high_bit_depth_png_saturates_to_white():
    """As the architecture notes say: a 16-bit grey PNG is packed saturated (values over 255 become
    255), exactly as the reference packs it, and counted."""
    values = np.array([[0, 1, 128, 254, 255, 256, 257, 1000, 32768, 65535]], dtype=np.uint16)
    buf = io.BytesIO()
    Image.fromarray(values).save(buf, format="PNG")
    warn = _Warnings()
    out = np.asarray(decode_rgb(buf.getvalue(), DEFAULT, warn))
    assert warn == ["high_bit_depth_image_saturated"]
    np.testing.assert_array_equal(out, reference_rgb(buf.getvalue()))
    expected = np.minimum(values, 255).astype(np.uint8)
    for c in range(3):
        np.testing.assert_array_equal(out[..., c], expected)


def test_grey_alpha_png_drops_alpha_without_compositing():
    """Grey+alpha: the grey value is kept whatever the alpha (no compositing on white), as the
    reference does, and counted."""
    grey = np.array([[10, 100, 200, 250]], dtype=np.uint8)
    alpha = np.array([[0, 0, 128, 255]], dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(np.stack([grey, alpha], axis=-1), "LA").save(buf, format="PNG")
    warn = _Warnings()
    out = np.asarray(decode_rgb(buf.getvalue(), DEFAULT, warn))
    assert warn == ["alpha_dropped_without_composite"]
    np.testing.assert_array_equal(out, reference_rgb(buf.getvalue()))
    for c in range(3):
        np.testing.assert_array_equal(out[..., c], grey)


def test_frame_folder_decoding_equals_reference(inputs, tmp_path):
    """Frames are converted with a plain ``convert("RGB")`` (no compositing), as the reference's
    frame-folder reader does."""
    for kind in ("rgba_png", "palette_alpha_png", "jpeg", "grey_alpha_png"):
        d = tmp_path / kind
        d.mkdir()
        (d / "frame_0.jpg").write_bytes(inputs[kind])
        saved = np.random.get_state()
        try:
            with _pil_settings_as(REFERENCE_PIL):
                (ref,) = ref_video.read_frames_folder(str(d), num_frames=1, min_num_frames=1)
        finally:
            np.random.set_state(saved)
        warn = _Warnings()
        ours = decode_plain_rgb(str(d / "frame_0.jpg"), DEFAULT, warn)
        assert ours.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))
        assert warn == EXPECTED_WARNINGS[kind]


def test_not_an_image_raises_and_non_bytes_are_rejected():
    with pytest.raises(OSError):
        decode_rgb(bg.NOT_AN_IMAGE, DEFAULT, _Warnings())
    with pytest.raises(OSError):
        decode_rgb(b"", DEFAULT, _Warnings())
    with pytest.raises(Rejected) as info:
        decode_rgb(12345, DEFAULT, _Warnings())
    assert info.value.reason == "image_not_bytes"


# -- the pixel limit: refused from the header, before any pixel is decoded -----------------------


class _Decoding(Exception):
    """Raised by the spy in place of decoding pixels."""


@pytest.fixture
def no_pixel_decoding(monkeypatch):
    """Any attempt to decode pixels raises ``_Decoding`` instead (and is recorded)."""
    calls = []

    def spy(self, *args, **kwargs):
        calls.append(self.size)
        raise _Decoding(self.size)

    monkeypatch.setattr(ImageFile.ImageFile, "load", spy)
    return calls


@pytest.mark.parametrize("policy", [DEFAULT, STRICT], ids=["default", "strict"])
def test_pixel_bomb_refused_before_decoding(no_pixel_decoding, policy):
    warn = _Warnings()
    with pytest.raises(Rejected) as info:
        load_image(bg.pixel_bomb_png(25000, 20000), policy, warn)
    assert info.value.reason == "image_over_pixel_limit"
    assert no_pixel_decoding == [] and warn == []


def test_spy_sees_decoding(no_pixel_decoding, inputs):
    """The premise of the test above: a decode under the limit does reach the spied loader."""
    with pytest.raises(_Decoding):
        load_image(inputs["png"], DEFAULT, _Warnings())
    assert no_pixel_decoding


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("size", [(20000, 20000), (20000, 20001), (20001, 20000), (25000, 20000), (40000, 10001)])
def test_default_limit_is_the_reference_effective_limit(no_pixel_decoding, size):
    """The default refuses exactly the headers that PIL refuses under the reference's settings."""
    data = bg.pixel_bomb_png(*size)
    with _pil_settings_as(REFERENCE_PIL):
        try:
            Image.open(io.BytesIO(data))
            reference_refuses = False
        except Image.DecompressionBombError:
            reference_refuses = True
    if reference_refuses:
        with pytest.raises(Rejected):
            load_image(data, DEFAULT, _Warnings())
        assert no_pixel_decoding == []
    else:
        with pytest.raises(_Decoding):  # accepted: it went on to decode
            load_image(data, DEFAULT, _Warnings())
    assert reference_refuses == (size[0] * size[1] > 4 * 10**8)


def test_pixel_limit_boundary_on_a_real_image(inputs):
    img = Image.open(io.BytesIO(inputs["png"]))
    n = img.size[0] * img.size[1]
    warn = _Warnings()
    assert load_image(inputs["png"], ImagePolicy(max_pixels=n), warn).size == img.size
    for strict in (False, True):
        with pytest.raises(Rejected) as info:
            load_image(inputs["png"], ImagePolicy(max_pixels=n - 1, strict=strict), warn)
        assert info.value.reason == "image_over_pixel_limit"
    with pytest.raises(Rejected):  # a truncated image over the limit is refused too, not retried
        load_image(inputs["truncated_jpeg"], ImagePolicy(max_pixels=100), warn)
    assert warn == []


# -- PIL global settings are scoped to each decode ----------------------------------------------


SENTINELS = (1000, False, 64)  # tiny pixel and text limits, truncation refused


@pytest.mark.parametrize("kind", ["jpeg", "truncated_jpeg", "big_text_png", "png16", "bomb", "not_an_image"])
def test_pil_globals_unchanged_by_a_decode(inputs, kind):
    """Whatever the process-wide PIL settings (here: limits that would refuse every input), a decode
    uses the run's policy, and leaves the settings as they were — also when it raises."""
    data = {"bomb": bg.pixel_bomb_png(25000, 20000), "not_an_image": bg.NOT_AN_IMAGE}.get(kind) or inputs[kind]
    with _pil_settings_as(SENTINELS):
        try:
            img = decode_rgb(data, DEFAULT, _Warnings())
        except (Rejected, OSError):
            assert kind in ("bomb", "not_an_image")
        else:
            assert kind not in ("bomb", "not_an_image")
            np.testing.assert_array_equal(np.asarray(img), reference_rgb(data))
        assert _pil_settings() == SENTINELS


def test_decodes_in_two_threads_leave_the_pil_globals_as_they_were(inputs, monkeypatch):
    """Two packers in threads of one process (a test's two jobs, a user's threads): their decodes'
    saves and restores of PIL's process-wide settings must not interleave, or the settings stay
    changed for the rest of the process.  Each open is slowed so that, unguarded, the two overlap."""
    real_open, inside, most = Image.open, [0], [0]
    count = threading.Lock()

    def slow_open(*args, **kwargs):
        with count:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.02)
            return real_open(*args, **kwargs)
        finally:
            with count:
                inside[0] -= 1

    monkeypatch.setattr(Image, "open", slow_open)
    with _pil_settings_as(SENTINELS):
        def decode_many():
            for _ in range(8):
                decode_rgb(inputs["truncated_jpeg"], DEFAULT, _Warnings())

        threads = [threading.Thread(target=decode_many) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert most[0] == 1  # one decode at a time inside PIL's settings
        assert _pil_settings() == SENTINELS


def test_importing_the_engine_leaves_pil_alone():
    """Import in a fresh interpreter: PIL's settings are its defaults after importing the engine."""
    import subprocess
    import sys

    code = ("from PIL import Image, ImageFile, PngImagePlugin\n"
            "before = (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES, PngImagePlugin.MAX_TEXT_CHUNK)\n"
            "import prepack.engine.decode, prepack.engine.sources\n"
            "after = (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES, PngImagePlugin.MAX_TEXT_CHUNK)\n"
            "assert before == after, (before, after)\n")
    env = dict(os.environ, PYTHONPATH=REPO)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=120)
