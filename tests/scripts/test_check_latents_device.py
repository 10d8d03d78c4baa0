"""scripts/check_latents_device.py, dry run on the CPU: the stage's moments are the recipe's, the
loader's draw is the recipe's encode for the same noise, and its last line; with NeMo's
autoencoder imported as a package and as its file alone (a GPU machine without transformers)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.fakepack import make_pack
from tests.helpers.paths import REPO

_LAST = re.compile(r"latents on (.+): moments equal (\d+) of (\d+); draw equal (\d+) of (\d+); max diff vs cpu "
                   r"(\S+) std; encode (\d+\.\d+) ms, draw (\d+\.\d+) ms per record")


@pytest.mark.slow  # the encoder at BAGEL's sizes, twice, in subprocesses (~20 s)
def test_a_cpu_dry_run_finds_everything_equal(tmp_path):
    import nemo_automodel.components.models.bagel.autoencoder as nemo_ae

    out = str(tmp_path / "pack")
    make_pack(out, world_size=1, num_workers=1, lengths=[3], shard_bytes=30 * 1024)
    for extra in ([], ["--module-file", nemo_ae.__file__]):
        proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "check_latents_device.py"), "--pack",
                               out, "--device", "cpu", "--records", "1", "--reps", "1", *extra], cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        m = _LAST.fullmatch(proc.stdout.strip().splitlines()[-1])
        assert m, proc.stdout
        assert m[1] == "cpu" and m[2] == m[3] == m[4] == m[5] == "1" and float(m[6]) == 0.0
