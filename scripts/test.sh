#!/usr/bin/env bash
# The test command (README, CI): install the project with its test extras and the reference
# oracle (NeMo AutoModel 0.7.0, --no-deps) into .venv at the repository root, then run pytest.
# Idempotent: a second run only runs the tests.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[pack,test]"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "nemo-automodel==0.7.0"
exec .venv/bin/python -m pytest "$@"
