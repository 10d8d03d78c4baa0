"""The resizer's decision: kernel only when enabled, on the pinned Pillow and self-tested; else
Pillow, said once.  And the packer's resizes go through it."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from PIL import Image

from prepack.engine.resize import router
from prepack.engine.resize.router import ENV_SWITCH, PINNED_PILLOW, Resizer, default_resizer, pillow_resize

ON_PINNED = Image.__version__ == PINNED_PILLOW


def _noise(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == router.__name__ and r.levelno >= logging.WARNING]


@pytest.fixture
def fresh_default():
    default_resizer.cache_clear()
    yield
    default_resizer.cache_clear()


@pytest.mark.skipif(not ON_PINNED, reason="the kernel mirrors the pinned Pillow")
def test_this_install_uses_the_kernel(caplog):
    import shutil

    resizer = Resizer.create(env={"PATH": os.environ.get("PATH", "")})
    assert resizer.fast and resizer.reason == "self-tested" and not _warnings(caplog)
    assert resizer.name == ("native" if shutil.which("cc") or shutil.which("gcc") else "numba")
    img = _noise(90, 70)
    np.testing.assert_array_equal(resizer.resize(img, 41, 33), pillow_resize(img, 41, 33))


def test_another_pillow_release_means_pillow_and_one_warning(caplog, monkeypatch, fresh_default):
    def no_kernel():
        raise AssertionError("the kernel must not be loaded for another Pillow")

    monkeypatch.setattr(router.PIL, "__version__", "12.1.0")
    monkeypatch.setattr(router, "numba_kernel", no_kernel)
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    img = _noise(60, 50)
    for _ in range(3):  # the decision is taken once per process: one warning
        out = router.resize_pixels(img, 30, 20)
    np.testing.assert_array_equal(out, pillow_resize(img, 30, 20))
    assert not default_resizer().fast and default_resizer().reason == "pillow 12.1.0"
    warned = _warnings(caplog)
    assert len(warned) == 1 and "12.1.0" in warned[0].getMessage()


def test_one_differing_value_in_the_self_test_means_pillow(caplog):
    calls = []

    def off_by_one(img, width, height):
        out = pillow_resize(img, width, height).copy()
        calls.append((img.size, width, height))
        if len(calls) == 5:  # one value of one case
            out[0, 0, 1] ^= 1
        return out

    resizer = Resizer.create(env={}, pillow_version=PINNED_PILLOW, make_kernel=lambda: off_by_one)
    assert not resizer.fast and resizer.reason == "self-test mismatch" and len(calls) > 5
    assert len(_warnings(caplog)) == 1
    img = _noise(20, 10)
    np.testing.assert_array_equal(resizer.resize(img, 7, 3), pillow_resize(img, 7, 3))


def test_an_exact_stand_in_kernel_passes_the_self_test(caplog):
    resizer = Resizer.create(env={}, pillow_version=PINNED_PILLOW, make_kernel=lambda: pillow_resize)
    assert resizer.fast and not _warnings(caplog)


def test_a_kernel_that_cannot_load_means_pillow(caplog):
    def broken():
        raise ImportError("No module named 'numba'")

    resizer = Resizer.create(env={}, pillow_version=PINNED_PILLOW, make_kernel=broken)
    assert not resizer.fast and "ImportError" in resizer.reason
    assert len(_warnings(caplog)) == 1


def test_without_a_c_compiler_the_numba_kernel_resizes(caplog, tmp_path):
    """No compiler (a slim container): the C kernel cannot be built, numba takes over, quietly."""
    caplog.set_level(logging.INFO, logger=router.__name__)
    env = {"CC": str(tmp_path / "no-such-cc"), "PREPACK_CACHE_DIR": str(tmp_path)}
    resizer = Resizer.create(env=env, pillow_version=PINNED_PILLOW)
    assert resizer.fast and resizer.name == "numba" and not _warnings(caplog)
    assert any("native kernel failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("value", ["native", "numba"])
def test_the_setting_can_ask_for_one_kernel(monkeypatch, tmp_path, value):
    calls = []
    monkeypatch.setattr(router, "native_kernel", lambda env=None: calls.append("native") or pillow_resize)
    monkeypatch.setattr(router, "numba_kernel", lambda: calls.append("numba") or pillow_resize)
    resizer = Resizer.create(env={ENV_SWITCH: value}, pillow_version=PINNED_PILLOW)
    assert resizer.fast and resizer.name == value and calls == [value]


def test_no_kernel_loading_means_pillow_and_one_warning(monkeypatch, caplog):
    def broken(*args):
        raise OSError("nothing loads here")

    monkeypatch.setattr(router, "native_kernel", broken)
    monkeypatch.setattr(router, "numba_kernel", broken)
    resizer = Resizer.create(env={}, pillow_version=PINNED_PILLOW)
    assert not resizer.fast and resizer.reason == "kernel error: OSError"
    warned = _warnings(caplog)
    assert len(warned) == 1 and "numba" in warned[0].getMessage()


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_the_setting_turns_the_kernel_off_quietly(caplog, value):
    def no_kernel():
        raise AssertionError("not loaded when off")

    resizer = Resizer.create(env={ENV_SWITCH: value}, pillow_version=PINNED_PILLOW, make_kernel=no_kernel)
    assert not resizer.fast and resizer.reason == "disabled" and not _warnings(caplog)


def test_only_rgb_pictures_with_real_sizes_reach_the_kernel():
    seen = []

    def kernel(img, w, h):
        seen.append(img.mode)
        return pillow_resize(img, w, h)

    resizer = Resizer(kernel, "test")
    grey = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8))
    np.testing.assert_array_equal(resizer.resize(grey, 4, 4), np.asarray(grey.resize((4, 4), Image.Resampling.BICUBIC)))
    resizer.resize(_noise(8, 8), 4, 4)
    with pytest.raises(ValueError):  # Pillow's own error for an empty target
        resizer.resize(_noise(8, 8), 0, 4)
    assert seen == ["RGB"]


def test_sample_images_are_resized_through_the_router(monkeypatch):
    from prepack.engine.sample import SampleImage

    seen = []

    def spy(img, w, h):
        seen.append((w, h))
        return pillow_resize(img, w, h)

    monkeypatch.setattr(router, "default_resizer", lambda: Resizer(spy, "spy"))
    px = SampleImage(_noise(50, 40), 32, 16, (0.5,) * 6).pixels()
    assert seen == [(32, 16)] and px.shape == (16, 32, 3)


@pytest.mark.slow  # compiles the kernel cold in a fresh process (a few seconds)
@pytest.mark.skipif(not ON_PINNED, reason="the kernel mirrors the pinned Pillow")
def test_no_writable_numba_cache_falls_back_to_a_temporary_folder(tmp_path):
    """A worker where numba finds no writable cache location (here: only the user-provided locator
    allowed, pointing below a file) still gets the kernel, cached in a per-user temporary folder."""
    import subprocess
    import sys

    from tests.helpers.paths import REPO

    env = dict(os.environ, PYTHONPATH=REPO, TMPDIR=str(tmp_path), NUMBA_CACHE_DIR="/dev/null/not-a-dir",
               NUMBA_CACHE_LOCATOR_CLASSES="UserProvidedCacheLocator", **{ENV_SWITCH: "numba"})
    code = "from prepack.engine.resize import default_resizer; r = default_resizer(); print(r.fast, r.reason)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "self-tested"]
    cached = list((tmp_path / f"prepack-numba-{os.getuid()}").rglob("*.nbi"))
    assert cached, "no numba cache index written in the fallback folder"
