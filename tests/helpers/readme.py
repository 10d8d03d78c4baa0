"""The README blocks that tests run: each fenced block right after a ``<!-- tested: ... -->`` line."""

from __future__ import annotations

import os
import re

from tests.helpers.paths import REPO


def readme_tested_blocks() -> list[str]:
    """In README order: the NeMo YAML, the upstream-BAGEL loader lines, the upstream save lines."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    return re.findall(r"<!-- tested: [^\n]*-->\n```\w+\n(.*?)```", text, flags=re.S)
