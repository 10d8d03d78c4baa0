"""The typed loader state saves to the same plain values every saved state already has, and back."""

from __future__ import annotations

import io
import json

import pytest
import torch

from loader.state import MergedState, WorkerState, merge_states, state_from_dict

PACK = "ab" * 16

# A worker's state exactly as PackedShardDataset.state_dict() has written it since version 2.
WORKER = {
    "version": 2,
    "pack": PACK,
    "rank": 1,
    "world_size": 3,
    "worker": 0,
    "num_workers": 2,
    "streams": [2, 4],
    "cursor": 5,
    "firsts": [0, 1],
    "positions": [3, 3],
    "last": ["d2", "d4"],
}
# A merged state exactly as PackedShardDataset.merge_states() writes it.
MERGED = {
    "version": 2,
    "kind": "merged",
    "pack": PACK,
    "positions": {"2": 3, "4": 3, "0": 0},
    "last": {"2": "d2", "4": "d4", "0": ""},
}


def _weights_only(d: dict) -> dict:
    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_worker_state_round_trip():
    st = state_from_dict(WORKER)
    assert st == WorkerState(PACK, 1, 3, 0, 2, [2, 4], 5, [0, 1], [3, 3], ["d2", "d4"])
    assert st.to_dict() == WORKER and list(st.to_dict()) == list(WORKER)  # same keys, same order
    assert WorkerState.from_dict(st.to_dict()) == st
    assert _weights_only(st.to_dict()) == WORKER and json.loads(json.dumps(st.to_dict())) == WORKER


def test_merged_state_round_trip():
    st = state_from_dict(MERGED)
    assert st == MergedState(PACK, {2: 3, 4: 3, 0: 0}, {2: "d2", 4: "d4", 0: ""})
    assert st.to_dict() == MERGED and list(st.to_dict()["positions"]) == ["2", "4", "0"]
    assert MergedState.from_dict(st.to_dict()) == st
    assert _weights_only(st.to_dict()) == MERGED and json.loads(json.dumps(st.to_dict())) == MERGED


def test_older_worker_states_still_load():
    no_firsts = {k: v for k, v in WORKER.items() if k != "firsts"}  # saved before the world-size merge existed
    st = state_from_dict(no_firsts)
    assert st.firsts == [0, 0] and st.to_dict() == {**WORKER, "firsts": [0, 0]}
    no_last = {k: v for k, v in WORKER.items() if k != "last"}  # not checked against digests
    st = state_from_dict(no_last)
    assert st.last is None and st.to_dict() == no_last
    with pytest.raises(ValueError, match="without record digests"):
        merge_states([st])


def test_values_are_normalised_to_plain_types():
    loose = {**WORKER, "streams": (2, 4), "positions": [3.0, 3]}
    assert state_from_dict(loose).to_dict() == WORKER


@pytest.mark.parametrize("version", [None, 1, 3])
def test_other_versions_are_refused(version):
    for d in (WORKER, MERGED):
        bad = {k: v for k, v in d.items() if k != "version"} | ({} if version is None else {"version": version})
        with pytest.raises(ValueError, match="unsupported loader state version"):
            state_from_dict(bad)


def test_merge():
    other = {**WORKER, "rank": 0, "streams": [0, 1], "positions": [1, 0], "last": ["d0", ""], "firsts": [0, 0]}
    merged = merge_states([state_from_dict(WORKER), state_from_dict(other)])
    assert merged == MergedState(PACK, {2: 3, 4: 3, 0: 1, 1: 0}, {2: "d2", 4: "d4", 0: "d0", 1: ""})
    assert merge_states([merged]) == merged  # a merged state merges again
    with pytest.raises(ValueError, match="stream 2 appears in two"):
        merge_states([merged, state_from_dict(WORKER)])
    with pytest.raises(ValueError, match="different packs"):
        merge_states([merged, state_from_dict({**WORKER, "pack": "cd" * 16})])
    with pytest.raises(ValueError, match="at least one"):
        merge_states([])
