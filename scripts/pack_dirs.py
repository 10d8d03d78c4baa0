"""The pack folders a benchmark's ``--pack`` names: a pack, a folder of packs, or an archive of packs
(``scripts/make_cost_pack.py`` makes one).  Standard library only: the GPU machine runs it bare."""

from __future__ import annotations

import os
import sys
import tarfile
import tempfile


def pack_dirs(spec: str, tmp: str) -> list[str]:
    """Every pack folder under ``spec`` (an archive is unpacked into ``tmp`` first), outermost only."""
    if os.path.isfile(spec):
        if not tarfile.is_tarfile(spec):
            raise SystemExit(f"--pack {spec}: a file, but not a tar archive")
        dest = tempfile.mkdtemp(prefix="packs-", dir=tmp)
        with tarfile.open(spec) as tar:
            if sys.version_info >= (3, 12):
                tar.extractall(dest, filter="data")
            else:
                tar.extractall(dest)  # noqa: S202 (make_cost_pack's archive)
        spec = dest
    if os.path.exists(os.path.join(spec, "pack.json")):
        return [spec]
    found = sorted(os.path.join(d, n) for d, subdirs, _ in os.walk(spec) for n in subdirs
                   if os.path.exists(os.path.join(d, n, "pack.json")))
    found = [p for p in found if not any(p != q and p.startswith(q + os.sep) for q in found)]
    if not found:
        raise SystemExit(f"--pack {spec}: no pack.json in it or below it")
    return found
