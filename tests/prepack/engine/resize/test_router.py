"""The resizer's decision: kernel only when enabled, on the pinned Pillow, self-tested and the
fastest of the candidates and Pillow on this machine (timed once per machine, cached); else
Pillow, said once.  And the packer's resizes go through it.  Timing is injected (a fake timer or
clock): no test here depends on how fast anything really runs."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
from PIL import Image

from prepack.engine.resize import router, selftest
from prepack.engine.resize.router import (ENV_SWITCH, PINNED_PILLOW, Candidate, Resizer, choose, default_resizer,
                                          pillow_resize)
from schemas.pixel_table import encode_rows

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


def _choice_files(tmp_path) -> list:
    return sorted((tmp_path / "resize").glob("choice-*.json"))


@pytest.mark.skipif(not ON_PINNED, reason="the kernel mirrors the pinned Pillow")
@pytest.mark.slow  # compiles and times every kernel
def test_this_install_takes_the_fastest_exact_way_it_timed(caplog, tmp_path):
    """The real candidates, timed for real: whichever wins, it is the one the cache records as
    fastest, and it resizes as Pillow does."""
    caplog.set_level(logging.INFO, logger=router.__name__)
    resizer = Resizer.create(env={"PATH": os.environ.get("PATH", ""), "PREPACK_CACHE_DIR": str(tmp_path)})
    [path] = _choice_files(tmp_path)
    entry = json.loads(path.read_text())
    assert set(entry["times"]) == {"pillow", "native", "numba"} or not (shutil.which("cc") or shutil.which("gcc"))
    assert resizer.name == entry["choice"] == choose(entry["times"], [n for n in ("native", "numba") if n in entry["times"]])
    assert resizer.fast == (resizer.name != "pillow") and not _warnings(caplog)
    assert any("timed the resize candidates" in r.getMessage() for r in caplog.records)
    img = _noise(90, 70)
    np.testing.assert_array_equal(resizer.resize(img, 41, 33), pillow_resize(img, 41, 33))


@pytest.mark.skipif(not ON_PINNED, reason="the kernel mirrors the pinned Pillow")
@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler on this machine")
def test_a_warm_cache_that_chose_the_c_kernel_does_not_import_numba(tmp_path):
    """numba's import alone costs ~1 s of every worker's start-up: where the machine's choice is the
    C kernel, a later process reads the choice, self-tests the C kernel and never imports numba."""
    import subprocess
    import sys

    from tests.helpers.paths import REPO

    env = {"PATH": os.environ.get("PATH", ""), "PREPACK_CACHE_DIR": str(tmp_path)}
    assert Resizer.create(env=env, timer=lambda ks: {n: 1.0 + (n != "native") for n in ks}).name == "native"
    code = ("import sys; from prepack.engine.resize import default_resizer; r = default_resizer(); "
            "print(r.name, 'numba' in sys.modules)")
    run_env = dict(os.environ, PYTHONPATH=REPO, **env)
    run_env.pop(ENV_SWITCH, None)
    out = subprocess.run([sys.executable, "-c", code], env=run_env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["native", "False"]


class _Fakes:
    """Exact stand-in kernels (Pillow itself) with preset timings; counts loads and timings."""

    def __init__(self, times: dict[str, float], broken: tuple[str, ...] = ()):
        self.times, self.broken, self.made, self.timed = times, broken, [], 0

    def candidates(self) -> list[Candidate]:
        return [Candidate(name, lambda name=name: self._make(name), lambda name=name: f"{name}-build-1")
                for name in self.times if name != "pillow"]

    def _make(self, name: str):
        self.made.append(name)
        if name in self.broken:
            raise OSError(f"{name} does not load here")
        return pillow_resize

    def timer(self, kernels):
        self.timed += 1
        assert "pillow" in kernels
        return {name: self.times[name] for name in kernels}

    def create(self, tmp_path, **env: str) -> Resizer:
        return Resizer.create(env={"PREPACK_CACHE_DIR": str(tmp_path), **env}, pillow_version=PINNED_PILLOW,
                              candidates=self.candidates(), timer=self.timer)


def test_a_kernel_slower_than_pillow_is_not_chosen(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=router.__name__)
    fakes = _Fakes({"pillow": 1.0, "native": 1.3})
    resizer = fakes.create(tmp_path)
    assert not resizer.fast and resizer.name == "pillow" and resizer.reason == "timed: pillow fastest"
    assert fakes.timed == 1 and not _warnings(caplog)
    assert any("pillow 1000.0 ms, native 1300.0 ms; pillow resizes" in r.getMessage() for r in caplog.records)
    img = _noise(20, 10)
    np.testing.assert_array_equal(resizer.resize(img, 7, 3), pillow_resize(img, 7, 3))


def test_the_fastest_exact_kernel_is_chosen(tmp_path):
    fakes = _Fakes({"pillow": 10.0, "native": 4.0, "numba": 2.0, "third": 3.0})
    resizer = fakes.create(tmp_path)
    assert resizer.fast and resizer.name == "numba" and resizer.reason == "self-tested, timed fastest"
    assert sorted(fakes.made) == ["native", "numba", "third"] and fakes.timed == 1


class _CodesItself:
    """An exact kernel that also codes as it resizes (as the C one does), counting each way it is asked."""

    def __init__(self):
        self.plain = self.coded_calls = 0

    def __call__(self, img, width, height):
        self.plain += 1
        return pillow_resize(img, width, height)

    def coded(self, img, width, height, out):
        self.coded_calls += 1
        assert out.shape == (height, width, 3) and out.dtype == np.uint8
        out[...] = encode_rows(pillow_resize(img, width, height))


def test_each_candidate_is_timed_at_what_the_packer_asks_of_it_a_coded_resize(tmp_path):
    fused = _CodesItself()
    seen = {}

    def timer(kernels):
        img = _noise(30, 20)
        for name, run in kernels.items():
            before = (fused.plain, fused.coded_calls)
            run(img, 9, 5)
            seen[name] = (fused.plain - before[0], fused.coded_calls - before[1])
        return {"pillow": 2.0, "native": 1.0, "numba": 1.5}

    candidates = [Candidate("native", lambda: fused, lambda: "native-build-1"),
                  Candidate("numba", lambda: pillow_resize, lambda: "numba-build-1")]
    resizer = Resizer.create(env={"PREPACK_CACHE_DIR": str(tmp_path)}, pillow_version=PINNED_PILLOW,
                             candidates=candidates, timer=timer)
    assert resizer.name == "native"
    assert seen["native"][1] == 1 and seen["native"][0] == 0  # the fused coding, not a resize and a pass after
    assert seen["pillow"] == (0, 0) and seen["numba"] == (0, 0)


def test_a_kernel_that_fails_its_self_test_is_not_timed(tmp_path):
    fakes = _Fakes({"pillow": 10.0, "native": 1.0, "numba": 2.0}, broken=("native",))
    resizer = fakes.create(tmp_path)
    assert resizer.name == "numba"
    assert json.loads(_choice_files(tmp_path)[0].read_text())["times"] == {"pillow": 10.0, "numba": 2.0}


def test_choose_prefers_the_cheaper_start_up_within_a_tie_and_never_a_kernel_slower_than_pillow():
    assert choose({"pillow": 10.0, "native": 3.1, "numba": 3.0}, ["native", "numba"]) == "native"
    assert choose({"pillow": 10.0, "native": 3.5, "numba": 3.0}, ["native", "numba"]) == "numba"
    assert choose({"pillow": 3.0, "native": 3.1, "numba": 3.05}, ["native", "numba"]) == "pillow"
    assert choose({"pillow": 3.0, "native": 2.0, "numba": 4.0}, ["native", "numba"]) == "native"


def test_the_choice_is_cached_per_machine_and_only_the_chosen_kernel_loads_after(tmp_path, caplog):
    first = _Fakes({"pillow": 10.0, "native": 2.0, "numba": 1.0})
    assert first.create(tmp_path).name == "numba" and first.timed == 1
    [path] = _choice_files(tmp_path)
    assert json.loads(path.read_text())["choice"] == "numba"
    caplog.set_level(logging.INFO, logger=router.__name__)
    later = _Fakes({"pillow": 10.0, "native": 2.0, "numba": 1.0})
    resizer = later.create(tmp_path)
    assert resizer.name == "numba" and later.timed == 0 and later.made == ["numba"]  # self-tested, not timed
    assert _choice_files(tmp_path) == [path]
    assert any("numba kernel resizes (fastest when timed on this machine" in r.getMessage() for r in caplog.records)
    pillow_won = _Fakes({"pillow": 1.0, "native": 2.0})
    assert pillow_won.create(tmp_path / "other").name == "pillow"
    again = _Fakes({"pillow": 1.0, "native": 2.0})
    assert again.create(tmp_path / "other").name == "pillow" and again.timed == 0 and again.made == []


def test_the_cache_key_follows_the_builds_pillow_and_cpu(tmp_path, monkeypatch):
    _Fakes({"pillow": 10.0, "native": 1.0}).create(tmp_path)
    other_build = _Fakes({"pillow": 10.0, "native": 1.0})
    other_build.candidates = lambda: [Candidate("native", lambda: pillow_resize, lambda: "native-build-2")]
    other_build.create(tmp_path)
    assert other_build.timed == 1
    monkeypatch.setattr("prepack.engine.resize.native.machine_features", lambda: "x86_64 sse2")
    other_cpu = _Fakes({"pillow": 10.0, "native": 1.0})
    other_cpu.create(tmp_path)
    assert other_cpu.timed == 1 and len(_choice_files(tmp_path)) == 3


@pytest.mark.parametrize("damage", ["garbage", "old format", "unknown choice", "empty"])
def test_a_corrupt_or_old_cached_choice_is_ignored_and_rewritten(tmp_path, damage):
    _Fakes({"pillow": 10.0, "native": 1.0}).create(tmp_path)
    [path] = _choice_files(tmp_path)
    entry = json.loads(path.read_text())
    if damage == "garbage":
        path.write_bytes(b"\x00{not json")
    elif damage == "old format":
        entry["key"]["version"] = 0
        path.write_text(json.dumps(entry))
    elif damage == "unknown choice":
        entry["choice"] = "gone"
        path.write_text(json.dumps(entry))
    else:
        path.write_text("")
    fakes = _Fakes({"pillow": 10.0, "native": 1.0})
    assert fakes.create(tmp_path).name == "native" and fakes.timed == 1
    assert json.loads(path.read_text())["choice"] == "native" and _choice_files(tmp_path) == [path]
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_a_cached_kernel_that_fails_here_is_timed_again(tmp_path):
    _Fakes({"pillow": 10.0, "native": 1.0, "numba": 2.0}).create(tmp_path)
    fakes = _Fakes({"pillow": 10.0, "native": 1.0, "numba": 2.0}, broken=("native",))
    assert fakes.create(tmp_path).name == "numba" and fakes.timed == 1
    assert json.loads(_choice_files(tmp_path)[0].read_text())["choice"] == "numba"


@pytest.mark.parametrize("value", ["native", "numba", "0"])
def test_forced_settings_are_not_timed(tmp_path, value):
    fakes = _Fakes({"pillow": 1.0, "native": 5.0, "numba": 5.0})
    resizer = fakes.create(tmp_path, **{ENV_SWITCH: value})
    assert fakes.timed == 0 and not _choice_files(tmp_path)
    assert resizer.name == ("pillow" if value == "0" else value) and resizer.fast == (value != "0")
    assert fakes.made == ([] if value == "0" else [value])


def test_no_writable_cache_folder_still_chooses_by_timing(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    fakes = _Fakes({"pillow": 10.0, "native": 1.0})
    resizer = Resizer.create(env={"PREPACK_CACHE_DIR": str(blocker)}, pillow_version=PINNED_PILLOW,
                             candidates=fakes.candidates(), timer=fakes.timer)
    assert resizer.name == "native" and fakes.timed == 1


def test_timings_alternate_the_kernels_and_keep_each_ones_best_run():
    """A fake clock that each kernel advances by the cost of its run: best run per kernel, each run
    starting with the next kernel, every timing case run each time."""
    clock = [0.0]
    costs = {"pillow": [5.0, 3.0, 4.0], "a": [2.0, 2.0, 1.0], "b": [9.0, 8.0, 7.0]}
    n = len(selftest.TIMING_CASES)
    calls: list[str] = []

    def fake(name):
        def run(img, w, h):
            clock[0] += costs[name][calls.count(name) // n] / n
            calls.append(name)
        return run

    got = selftest.timings({name: fake(name) for name in costs}, clock=lambda: clock[0], reps=3)
    assert got == pytest.approx({"pillow": 3.0, "a": 1.0, "b": 7.0})
    assert [calls[i] for i in range(0, len(calls), n)] == ["pillow", "a", "b", "a", "b", "pillow", "b", "pillow", "a"]


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
    resizer = Resizer.create(env=env, pillow_version=PINNED_PILLOW, timer=lambda ks: {n: 1.0 + (n == "pillow") for n in ks})
    assert resizer.fast and resizer.name == "numba" and not _warnings(caplog)
    assert any("native kernel failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("value", ["native", "numba"])
def test_the_setting_can_ask_for_one_kernel(monkeypatch, tmp_path, value):
    calls = []
    monkeypatch.setattr(router, "native_kernel", lambda env=None: calls.append("native") or pillow_resize)
    monkeypatch.setattr(router, "numba_kernel", lambda: calls.append("numba") or pillow_resize)
    resizer = Resizer.create(env={ENV_SWITCH: value}, pillow_version=PINNED_PILLOW)
    assert resizer.fast and resizer.name == value and calls == [value]


def test_no_kernel_loading_means_pillow_and_one_warning(monkeypatch, caplog, tmp_path):
    def broken(*args):
        raise OSError("nothing loads here")

    monkeypatch.setattr(router, "native_kernel", broken)
    monkeypatch.setattr(router, "numba_kernel", broken)
    resizer = Resizer.create(env={"PREPACK_CACHE_DIR": str(tmp_path)}, pillow_version=PINNED_PILLOW)
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


class _CodingSpy:
    """An exact kernel that also codes (as the C kernel does), recording which way it was asked."""

    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, img, w, h):
        self.calls.append("plain")
        return pillow_resize(img, w, h)

    def coded(self, img, w, h, out):
        self.calls.append("coded")
        encode_rows(pillow_resize(img, w, h), out=out)


def test_resize_coded_codes_in_the_kernel_where_it_can_and_here_otherwise():
    img, grey = _noise(50, 40), Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8)).convert("L")
    want = encode_rows(pillow_resize(img, 21, 13))
    spy = _CodingSpy()
    for resizer in (Resizer(spy, "test"), Resizer(pillow_resize, "test"), Resizer(None, "test")):
        out = np.zeros((13, 21, 3), np.uint8)
        resizer.resize_coded(img, 21, 13, out)
        np.testing.assert_array_equal(out, want)
    assert spy.calls == ["coded"]
    out = np.zeros((4, 4), np.uint8)  # not RGB: Pillow's resize, coded here (as encode_rows codes any shape)
    Resizer(spy, "test").resize_coded(grey, 4, 4, out)
    want_grey = np.asarray(grey.resize((4, 4), Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(out, encode_rows(want_grey))
    assert spy.calls == ["coded"]


@pytest.mark.skipif(not ON_PINNED, reason="the kernel mirrors the pinned Pillow")
@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler on this machine")
def test_the_c_kernel_codes_into_a_slot_and_refuses_another_array():
    kernel = router.native_kernel()
    img = _noise(90, 70, 3)
    table = np.full(5 + 33 * 41 * 3 + 5, 0xA5, np.uint8)
    kernel.coded(img, 41, 33, table[5:-5].reshape(33, 41, 3))
    np.testing.assert_array_equal(table[5:-5], encode_rows(pillow_resize(img, 41, 33)).reshape(-1))
    assert (table[:5] == 0xA5).all() and (table[-5:] == 0xA5).all()
    read_only = np.zeros((33, 41, 3), np.uint8)
    read_only.flags.writeable = False
    for bad in (np.zeros((33, 40, 3), np.uint8), np.zeros((33, 41, 3), np.int16),
                np.asfortranarray(np.zeros((33, 41, 3), np.uint8)), np.zeros((33, 82, 3), np.uint8)[:, ::2], read_only):
        with pytest.raises(ValueError, match="C-contiguous"):
            kernel.coded(img, 41, 33, bad)


def test_the_module_level_resize_coded_goes_through_the_router(monkeypatch):
    spy = _CodingSpy()
    monkeypatch.setattr(router, "default_resizer", lambda: Resizer(spy, "spy"))
    out = np.empty((16, 32, 3), np.uint8)
    router.resize_coded(_noise(50, 40), 32, 16, out)
    assert spy.calls == ["coded"]
