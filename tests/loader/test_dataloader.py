"""``build_dataloader``: reference-shaped items, and exact resume from a state saved with
``torch.save`` and loaded with ``torch.load(weights_only=True)`` in a new process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from tests.helpers.fakepack import SMALL_LENGTHS, batch_id, small_pack_fixture
from tests.helpers.paths import REPO

from loader import SimpleCustomBatch, build_dataloader

LENGTHS = SMALL_LENGTHS  # W=2 ranks x K=2 workers
pack = small_pack_fixture()


def test_items_behave_like_the_reference_collated_batch(pack):
    loader = build_dataloader(pack, rank=1, world_size=2, num_workers=0, pin_memory=False)
    batch = next(iter(loader))
    assert isinstance(batch, SimpleCustomBatch)
    data = batch.cuda("cpu").to_dict()  # the training loops' call; "cpu" here
    entries = data["batch_data_indexes"]
    assert entries and all(set(e) == {"dataset_name", "worker_id", "data_indexes"} for e in entries)
    assert data["packed_text_ids"].dtype == torch.int64 and data["sequence_length"] == batch.sequence_length


_CONTINUE = """
import json, sys, torch
sys.path[:0] = [{root!r}]
from loader import build_dataloader
from tests.helpers.fakepack import batch_id
loader = build_dataloader({pack!r}, rank={rank}, world_size=2, num_workers={workers}, pin_memory=False)
loader.load_state_dict(torch.load({state!r}, weights_only=True))
print(json.dumps([batch_id(b) for b in loader]))
"""


@pytest.mark.parametrize("workers, rank", [(0, 0), pytest.param(2, 1, marks=pytest.mark.slow)])
def test_resume_in_a_new_process_with_weights_only_load(pack, tmp_path, workers, rank):
    make = lambda: build_dataloader(pack, rank=rank, world_size=2, num_workers=workers, pin_memory=False)  # noqa: E731
    full = [batch_id(b) for b in make()]
    assert len(full) == LENGTHS[2 * rank] + LENGTHS[2 * rank + 1] and len(set(full)) == len(full)
    stop = 3 + workers  # mid-stream, and with 2 workers not on a worker boundary
    loader = make()
    it = iter(loader)
    head = [batch_id(next(it)) for _ in range(stop)]
    torch.save(loader.state_dict(), tmp_path / "state.pt")
    del it
    code = _CONTINUE.format(root=REPO, pack=pack, rank=rank, workers=workers, state=str(tmp_path / "state.pt"))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert head + json.loads(proc.stdout.strip().splitlines()[-1]) == full
