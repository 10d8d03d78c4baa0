#!/usr/bin/env bash
# The test command (README, CI): install the project with its test extras and the reference
# oracle (NeMo AutoModel 0.7.0, --no-deps) into .venv at the repository root, then run pytest.
# Idempotent: a second run only runs the tests.  Extra arguments go to pytest: with none it runs
# the whole suite; `-m "not slow"` is the fast lane (every area, one short parity case; a few
# minutes), leaving out the tests marked slow (Ray, the reference over many batches, benchmarks).
# Two pytest workers, each taking whole test files (module fixtures such as reference packs are
# built once); PREPACK_TEST_WORKERS=0 runs the suite in this one process.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[pack,test]"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "nemo-automodel==0.7.0"
workers="${PREPACK_TEST_WORKERS:-2}"
if [ "$workers" = "0" ]; then
  exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
