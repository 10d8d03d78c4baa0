#!/usr/bin/env bash
# Print the README's "Two commands" (one per line, comments dropped): line 1 installs and packs the
# demo, line 2 runs the tests.  .ci/run executes exactly these lines, so README and CI cannot drift.
set -euo pipefail
cd "$(dirname "$0")/.."
awk '/^## Two commands/ {section=1; next}
     section && /^## / {exit}
     section && /^```/ {inblock = !inblock; if (!inblock) exit; next}
     section && inblock && $0 !~ /^[[:space:]]*(#|$)/ {print}' README.md
