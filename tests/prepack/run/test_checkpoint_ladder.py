"""The checkpoint ladder: what a trim keeps of a bounded pack's checkpoints (``prepack.run.bounded.checkpoint_ladder``)."""

from __future__ import annotations

import random

from prepack.run.bounded.checkpoint_ladder import ladder_keeps, nearest_kept, to_drop


def test_the_ladder_only_thins_as_the_head_moves_on():
    for head in range(1, 400):
        for k in range(head):
            if not ladder_keeps(k, head):
                assert not ladder_keeps(k, head + 1), (k, head)  # a dropped checkpoint is never wanted back


def test_the_ladder_keeps_about_two_per_doubling_and_a_restore_packs_fewer_shards_again_than_its_distance():
    for head in (2, 3, 17, 64, 160, 1000, 4097):
        kept = [k for k in range(head + 1) if ladder_keeps(k, head)]
        assert len(kept) <= 2 * head.bit_length() + 3, (head, len(kept))
        assert {0, head - 1, head} <= set(kept)
        dropped = set(range(head + 1)) - set(kept)
        for k in range(1, head):
            assert k - nearest_kept(k, dropped) < head - k, (head, k)


def test_to_drop_follows_the_ladder_where_everything_behind_is_trimmed_as_the_head_moves():
    dropped: set[int] = set()
    for head in range(1, 300):
        trimmed = range(max(0, head - 5))  # a window of 5 shards in front stays
        new = to_drop(head, trimmed, dropped)
        assert not set(new) & dropped
        dropped |= set(new)
        assert dropped == {k for k in trimmed if k and not ladder_keeps(k, head)}


def test_no_restore_passes_through_a_shard_that_is_not_trimmed():
    rng = random.Random(3)
    for _ in range(300):
        head = rng.randrange(2, 80)
        trimmed = {k for k in range(head) if rng.random() < 0.8}
        before = {k for k in trimmed if rng.random() < 0.3 and k}
        gone = before | set(to_drop(head, trimmed, before))
        for k in set(to_drop(head, trimmed, before)):
            assert k in trimmed and not ladder_keeps(k, head)
            j = nearest_kept(k, gone)
            assert all(m in trimmed for m in range(j, k + 1)), (head, sorted(trimmed), k, j)
        assert 0 not in gone and head not in gone
