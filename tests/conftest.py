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
