"""The C kernel's aarch64 paths (NEON, and the portable loops as aarch64 compiles them), which this
x86 machine cannot load: cross-compiled with a small driver (``resize_driver.c``) and run under
qemu-user on cases whose expected bytes this process's Pillow writes.  Skipped where the cross
compiler or the emulator is absent (Debian: ``gcc-aarch64-linux-gnu qemu-user``); on an aarch64
machine the NEON path is what ``test_kernel`` already checks natively.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from prepack.engine.decode import raw_pixels
from prepack.engine.resize import PINNED_PILLOW, native, selftest
from prepack.engine.resize.router import vertical_first
from tests.helpers import datagen as dg
from tests.helpers.pictures import KINDS, picture

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = ("qemu-aarch64", "qemu-aarch64-static")
DRIVER = Path(__file__).with_name("resize_driver.c")
# build -> (extra flags, the path the build must report)
BUILDS = {"neon": ((), "neon"), "portable": (("-march=armv8-a+nosimd",), "portable")}

pytestmark = [
    pytest.mark.skipif(Image.__version__ != PINNED_PILLOW, reason="the kernel mirrors the pinned Pillow"),
    pytest.mark.skipif(not shutil.which(CROSS_CC), reason=f"no {CROSS_CC} (Debian: gcc-aarch64-linux-gnu)"),
    pytest.mark.skipif(not any(shutil.which(q) for q in QEMU), reason="no qemu-aarch64 (Debian: qemu-user)"),
]


def _cases() -> list[tuple[Image.Image, int, int]]:
    """The self-test's cases, edges, strips, random sizes and contents, and photographs at the
    packer's sizes: what test_kernel checks natively, at a size an emulator runs in seconds."""
    out = [(pic, ow, oh) for w, h, ow, oh in selftest.CASES
           for pic in selftest._pictures(w, h, np.random.default_rng(w * h))]
    for w, h, ow, oh in [(1, 1, 9, 7), (9, 7, 1, 1), (1, 50, 1, 3), (50, 1, 3, 1), (2, 2, 1, 1), (5, 400, 3, 2),
                         (1500, 3, 600, 5), (3, 1500, 5, 600), (64, 64, 64, 17), (64, 64, 17, 64)]:
        out += [(picture(kind, w, h, 7), ow, oh) for kind in ("noise", "checker")]
    rng = np.random.default_rng(20260324)
    for i in range(120):
        w, h, ow, oh = (int(v) for v in rng.integers(1, 161, 4))
        out.append((picture(KINDS[i % len(KINDS)], w, h, i), ow, oh))
    for w, h, ow, oh in [(1024, 768, 512, 384), (700, 1200, 504, 868), (300, 900, 224, 672), (640, 480, 512, 384)]:
        out.append((dg.photo(3, np.random.RandomState(5), min(w, h), max(w, h)).resize((w, h)), ow, oh))
    return out


@pytest.fixture(scope="module")
def case_file(tmp_path_factory) -> tuple[Path, list[str]]:
    path = tmp_path_factory.mktemp("cross") / "cases.bin"
    names = []
    with open(path, "wb") as f:
        cases = _cases()
        f.write(struct.pack("<i", len(cases)))
        for img, ow, oh in cases:
            want = np.asarray(img.resize((ow, oh), Image.Resampling.BICUBIC))
            f.write(struct.pack("<5i", img.width, img.height, ow, oh, vertical_first(img.width, img.height, ow, oh)))
            f.write(raw_pixels(img, "RGBX", 4).tobytes())
            f.write(want.tobytes())
            names.append(f"{img.width}x{img.height}->{ow}x{oh}")
    return path, names


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_aarch64_builds_equal_pillow_under_qemu(case_file, tmp_path, build):
    extra, isa = BUILDS[build]
    exe = tmp_path / f"driver-{build}"
    # static: qemu-user then needs no aarch64 libraries; native.py's flags less -march=native and -shared
    flags = [f for f in native.PORTABLE_FLAGS if f not in ("-fPIC", "-shared")]
    subprocess.run([CROSS_CC, *flags, *extra, "-static", "-o", str(exe), str(DRIVER), str(native.SOURCE), "-lm"],
                   check=True, capture_output=True, text=True, timeout=120)
    qemu = next(shutil.which(q) for q in QEMU if shutil.which(q))
    path, names = case_file
    done = subprocess.run([qemu, str(exe), str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"isa {isa}" and lines[-1] == f"checked {len(names)}", lines[:3] + lines[-3:]
    assert not lines[1:-1], "\n".join(lines[1:20])
