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


# Seconds each heavy file took (its tests of 5 s or more, 2026-12-06, ``-n 2`` on a 2-core machine):
# ordering only, no test reads it.  A file not listed counts 5 s per slow test.
FILE_SECONDS = {
    "tests/parity/test_parity.py": 136, "tests/prepack/run/test_node_loss.py": 97,
    "tests/prepack/run/test_ray_faults.py": 96, "tests/prepack/run/test_s3_faults.py": 85,
    "tests/prepack/run/test_ray_pack.py": 65, "tests/prepack/run/test_run_logs.py": 60,
    "tests/prepack/run/test_latents.py": 59, "tests/prepack/run/test_ahead.py": 59,
    "tests/prepack/run/test_many_jobs.py": 58, "tests/prepack/run/test_restorable.py": 56,
    "tests/prepack/run/test_latents_restore.py": 40, "tests/prepack/run/test_sample_balance.py": 38,
    "tests/loader/test_training.py": 37, "tests/scripts/test_bench_bounded.py": 35,
    "tests/prepack/run/test_balanced_budget.py": 31, "tests/scripts/test_bench_rank.py": 29,
    "tests/prepack/run/test_ray_cluster.py": 23, "tests/scripts/test_bench_continue.py": 21,
    "tests/prepack/run/test_continue.py": 19, "tests/scripts/test_check_latents_device.py": 15,
    "tests/scripts/test_bench_balance.py": 15, "tests/prepack/run/test_extend_follow.py": 14,
    "tests/scripts/test_bench_latents.py": 13, "tests/prepack/test_cli.py": 13,
    "tests/loader/test_damage_fuzz.py": 12, "tests/loader/test_balance_fsdp.py": 10,
}


def pytest_collection_modifyitems(session, config, items):
    """The longest files first (``FILE_SECONDS``), each file's tests together and in order: the two
    workers (``--dist loadfile``) take files as they free up, so the long ones start early and the
    run ends on short files, not with one worker idle behind the last long one (an unmarked long
    file collected late did that: the suite's last minute on one worker)."""
    slow: dict[str, int] = {}
    for item in items:
        slow[item.location[0]] = slow.get(item.location[0], 0) + (item.get_closest_marker("slow") is not None)
    weight = {f: FILE_SECONDS.get(f, 5 * n) for f, n in slow.items()}
    first = {f: i for i, f in enumerate(dict.fromkeys(item.location[0] for item in items))}
    items.sort(key=lambda item: (-weight[item.location[0]], first[item.location[0]]))
