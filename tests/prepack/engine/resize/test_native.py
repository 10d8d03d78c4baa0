"""Building and caching the C kernel: built once per machine and source, rebuilt when either
changes, one build when workers start together, clear failures when there is no compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prepack.engine.resize import native
from tests.helpers.paths import REPO

needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")),
                              reason="no C compiler on this machine")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), native.CACHE_ENV: str(tmp_path), **extra}


@needs_cc
def test_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    env = _env(tmp_path)
    fn = native.load(env)
    path = native.library_path(env)
    assert path.is_file() and path.parent == tmp_path / "resize" and callable(fn)
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]

    def no_build(*args, **kwargs):
        raise AssertionError("a cached build must be loaded, not rebuilt")

    monkeypatch.setattr(native, "build", no_build)
    assert callable(native.load(env))


@needs_cc
def test_the_cache_key_follows_source_flags_compiler_and_cpu(tmp_path, monkeypatch):
    env = _env(tmp_path)
    base = native.library_path(env)
    assert native.library_path(env, native.FLAGS + ("-mno-avx2",)) != base
    assert native.library_path(dict(env, CC="clang-99")) != base
    monkeypatch.setattr(native, "machine_features", lambda: "x86_64 sse2")
    assert native.library_path(env) != base
    monkeypatch.undo()
    edited = tmp_path / "native.c"
    edited.write_bytes(native.SOURCE.read_bytes() + b"\n/* edited */\n")
    monkeypatch.setattr(native, "SOURCE", edited)
    assert native.library_path(env) != base


def test_no_compiler_is_a_build_error_naming_it(tmp_path):
    with pytest.raises(native.BuildError, match="no C compiler"):
        native.load({"PATH": str(tmp_path), native.CACHE_ENV: str(tmp_path)})
    missing = str(tmp_path / "no-such-cc")
    with pytest.raises(native.BuildError, match="no-such-cc"):
        native.load(_env(tmp_path, CC=missing))


def test_a_failing_compiler_is_a_build_error_and_leaves_nothing(tmp_path):
    fake = tmp_path / "fake-cc"
    fake.write_text("#!/bin/sh\necho 'fake-cc: error: this compiler builds nothing' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = _env(tmp_path, CC=str(fake))
    with pytest.raises(native.BuildError, match="builds nothing"):
        native.load(env)
    assert not native.library_path(env).exists()
    assert not [p for p in (tmp_path / "resize").iterdir() if p.name.endswith(".tmp")]


def test_no_writable_home_uses_a_per_user_temporary_folder(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    got = native.cache_dir({"XDG_CACHE_HOME": str(blocker / "cache")})
    assert got == tmp_path / "tmp" / f"bagel-prepack-{os.getuid()}" / "resize" and got.is_dir()
    assert native.cache_dir({native.CACHE_ENV: str(tmp_path / "mine")}) == tmp_path / "mine" / "resize"


@needs_cc
@pytest.mark.slow  # compiles the kernel in racing processes
def test_workers_starting_together_build_once(tmp_path):
    """Four processes ask for the kernel at the same moment on an empty cache: one compiles under
    the lock, one times the candidates under the other lock, every one of them takes the same
    choice (self-tested in each), and one library is left."""
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from prepack.engine.resize import default_resizer\n"
            "r = default_resizer(); print('RESULT', r.fast, r.name)\n")
    env = dict(os.environ, PYTHONPATH=REPO, **{native.CACHE_ENV: str(tmp_path)})
    env.pop("PREPACK_FAST_RESIZE", None)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    names = {line.split()[-1] for out in outs for line in out.splitlines() if line.startswith("RESULT")}
    assert len(names) == 1 and all("RESULT True" in out for out in outs) or names == {"pillow"}, outs
    assert sum(out.count("built the resize kernel") for out in outs) == 1, outs
    assert sum(out.count("timed the resize candidates") for out in outs) == 1, outs
    built = sorted(p.name for p in (tmp_path / "resize").iterdir())
    assert len([n for n in built if n.endswith(".so")]) == 1 and not [n for n in built if n.endswith(".tmp")]
    assert len([n for n in built if n.startswith("choice-") and n.endswith(".json")]) == 1


@needs_cc
def test_extra_flags_from_the_environment_make_another_build(tmp_path):
    import platform

    env = _env(tmp_path)
    narrowed = dict(env, **{native.EXTRA_FLAGS_ENV: "-mno-avx512f -mno-avx2"})
    assert native.library_path(narrowed) != native.library_path(env)
    if platform.machine() == "x86_64":  # the portable loops, whatever this CPU has
        assert native.isa(native.library(narrowed)) == "portable"
