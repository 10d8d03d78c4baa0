"""Shared fixtures: one tokenizer per session; Ray kept off the host's own network."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def tokenizer_and_special():
    """The built-in qwen2-offline tokenizer with BAGEL's special tokens resolved."""
    from prepack.engine.tokenizer import load_tokenizer, special_token_ids

    return special_token_ids(load_tokenizer("qwen2-offline"))


# the real S3 server (SeaweedFS) and its per-test environment; defined in tests/helpers
from tests.helpers.s3server import s3, s3_server  # noqa: E402,F401


def pytest_collection_modifyitems(session, config, items):
    """Files with the most slow tests first, each file's tests together and in order: the two
    workers (``--dist loadfile``) take files as they free up, so the long ones start early and the
    run ends on short files, not with one worker idle behind the last long one."""
    slow: dict[str, int] = {}
    for item in items:
        slow[item.location[0]] = slow.get(item.location[0], 0) + (item.get_closest_marker("slow") is not None)
    first = {f: i for i, f in enumerate(dict.fromkeys(item.location[0] for item in items))}
    items.sort(key=lambda item: (-slow[item.location[0]], first[item.location[0]]))
