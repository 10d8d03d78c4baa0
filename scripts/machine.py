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


def _busy_idle() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, idle


def wait_quiet(busy_below: float = 0.15, window_s: float = 1.0, max_s: float = 30.0) -> float:
    """Wait until the machine's CPUs were busy less than ``busy_below`` of a ``window_s`` window
    (what the previous run left, such as a Ray node shutting down, is done), at most ``max_s``;
    returns the last window's busy share.  Work running beside a timed run inflates its CPU time,
    not only its wall time (shared caches and memory bandwidth; on a VM, the host's sharing)."""
    import time

    deadline = time.monotonic() + max_s
    while True:
        b0, i0 = _busy_idle()
        time.sleep(window_s)
        b1, i1 = _busy_idle()
        share = (b1 - b0) / max(1, (b1 - b0) + (i1 - i0))
        if share < busy_below or time.monotonic() >= deadline:
            return share
