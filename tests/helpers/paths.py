"""Where the repository is, for tests that run its files (configs, scripts, subprocesses)."""

from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])
