"""Where a benchmark ran: the CPU, its vector ISA level and the resize kernel this process uses.

Every benchmark prints this first, so a figure is never read without the machine it holds on
(a Ray autoscaler hands out AVX-512, AVX2-only and ARM nodes alike).
"""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "cpu model", "hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa_level() -> str:
    """The widest vector unit the resize kernel can use here: AVX-512, AVX2, NEON or none."""
    try:
        flags = set()
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        flags = set()
    if "avx512f" in flags and "avx512bw" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    if platform.machine() in ("aarch64", "arm64") or "asimd" in flags:
        return "NEON"
    return "none"


def machine_line() -> str:
    from prepack.engine.resize import default_resizer

    r = default_resizer()
    kernel = r.name or "pillow"
    if kernel == "native":  # which vector path the C build takes (PREPACK_KERNEL_CFLAGS can narrow it)
        from prepack.engine.resize import native

        kernel += f", {native.isa(native.library())} path"
    return (f"machine: {cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, vector ISA {isa_level()}; "
            f"resize kernel: {kernel} ({r.reason})")
