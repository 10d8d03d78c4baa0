"""A mix change mid-run (``prepack run B.yaml --out NEW --continue OLD --after N``) is what the real
reference yields after ``load_state_dict`` of its own state under B.

OLD is a small real pack (t2i + SFT, W=1, K=2, several shards a stream); each allowed change is
packed as a continuation in process and ``open_stream(NEW, s)`` (OLD's first N batches, then
NEW's) is compared tensor for tensor with ``oracle.reference_chain``: a reference ``PackedDataset``
of A iterated N batches in DataLoader worker w, its ``state_dict()`` loaded by one built from B.
Each test also checks that the change changed something, so none can pass by comparing OLD with
itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import polars as pl
import pytest
import yaml

from loader import PackedShardDataset, open_stream
from loader.reader import Pack
from prepack.run.chain import Continue
from prepack.run.driver import RunOptions, run_pack
from prepack.tools.audit import audit_pack
from prepack.tools.verify import verify_pack
from schemas.config_file import load_config
from schemas.errors import PackRefused, UsageError
from tests.helpers import oracle
from tests.helpers.compare import diff_batches
from tests.helpers.packs import make_dataset, KNOBS
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow  # the reference packs every compared batch

AFTER = 4  # NEW's own batches per stream in each comparison


def write_config(root: str, name: str, raw: dict) -> str:
    path = os.path.join(root, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    return path


def changed(raw: dict, **changes) -> dict:
    """A deep copy of a config with ``changes``: ``group__key=value`` for a group's key, ``knob=value``
    for a dataset knob, ``prepack__key`` for the prepack section, ``drop_group=name``."""
    out = json.loads(json.dumps(raw))
    for key, value in changes.items():
        if key == "drop_group":
            out["dataset"]["grouped_datasets"].pop(value)
            out["dataset"]["dataset_info"].pop(value)
        elif key.startswith("prepack__"):
            out["prepack"][key[9:]] = value
        elif "__" in key:
            group, k = key.split("__")
            out["dataset"]["grouped_datasets"][group][k] = value
        elif key in ("seed", "tokenizer"):
            out[key] = value
        elif key == "num_workers":
            out["dataloader"]["num_workers"] = value
        else:
            out["dataset"][key] = value
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_and_special):
    """OLD: t2i + SFT (the data also holds an edit group, left out of OLD), 8 batches a stream."""
    root = str(tmp_path_factory.mktemp("continue"))
    ds = make_dataset(root, edit=True)
    full = yaml.safe_load(open(ds.config(knobs={**KNOBS, "text_cond_dropout_prob": 0.2}, num_workers=2,
                                         prepack={"batches_per_stream": 8, "shard_bytes": 250_000})))
    raw_a = changed(full, drop_group="unified_edit")
    cfg_a = write_config(root, "a", raw_a)
    old = os.path.join(root, "old")
    run_pack(load_config(cfg_a), old, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    return {"root": root, "full": full, "raw_a": raw_a, "cfg_a": cfg_a, "old": old}


def continue_pack(base, name: str, raw_b: dict, tok, *, old: str | None = None, after: int | None = None,
                  after_state=None) -> tuple[str, str]:
    cfg_b = write_config(base["root"], name, raw_b)
    new = os.path.join(base["root"], name)
    run_pack(load_config(cfg_b), new, RunOptions(inline=True, bar=False, continue_from=Continue(old or base["old"], after, after_state)), tokenizer=tok)
    return cfg_b, new


def assert_chain_is_the_reference(new: str, cfgs: list[str], switches: list[int], tok, streams=(0, 1)) -> None:
    configs = [load_config(c) for c in cfgs]
    for s in streams:
        ours = [b.to_dict() for b in open_stream(new, s)]
        want = switches[-1] + AFTER
        assert len(ours) == want, f"stream {s}: {len(ours)} batches, expected {want}"
        ref = oracle.reference_chain(configs, switches, s, tok[0], want)
        for i, (a, b) in enumerate(zip(ours, ref)):
            diffs = diff_batches(a, b)
            assert not diffs, f"stream {s} batch {i}: " + "; ".join(diffs[:5])


def differs_from_old(base, new: str, after: int) -> bool:
    """Whether NEW's batches after the switch are not OLD's (the change changed something)."""
    for s in (0, 1):
        old = [(b.sequence_length, repr(b.batch_data_indexes)) for b in open_stream(base["old"], s)][after:after + AFTER]
        mine = [(b.sequence_length, repr(b.batch_data_indexes)) for b in open_stream(new, s)][after:after + AFTER]
        if old != mine:
            return True
    return False


def shard_starts(out: str, stream: int) -> list[int]:
    return [sh.first_record for sh in Pack.open(out).index(stream).shards]


@pytest.mark.parametrize("where", ["inside_a_shard", "shard_boundary", "end_of_old"])
def test_new_weights_continue_as_the_reference(base, where, tokenizer_and_special):
    starts = shard_starts(base["old"], 0)
    assert len(starts) >= 2, "OLD needs several shards a stream"
    after = {"inside_a_shard": starts[1] + 1, "shard_boundary": starts[1], "end_of_old": 8}[where]
    raw_b = changed(base["raw_a"], t2i_pretrain__weight=4.0, prepack__batches_per_stream=AFTER)
    cfg_b, new = continue_pack(base, f"weights_{where}", raw_b, tokenizer_and_special, after=after)
    assert_chain_is_the_reference(new, [base["cfg_a"], cfg_b], [after], tokenizer_and_special)
    assert differs_from_old(base, new, after) or where == "end_of_old"
    info = Pack.open(new).info
    assert info.parent.after == [after, after] and len(Pack.open(new).index(0).shards) >= 1


def test_a_mandatory_group_continues_as_the_reference(base, tokenizer_and_special):
    raw_b = changed(base["raw_a"], vlm_sft__is_mandatory=True, prepack__batches_per_stream=AFTER)
    cfg_b, new = continue_pack(base, "mandatory", raw_b, tokenizer_and_special, after=3)
    assert_chain_is_the_reference(new, [base["cfg_a"], cfg_b], [3], tokenizer_and_special)
    assert differs_from_old(base, new, 3)


def test_token_budgets_and_dropouts_continue_as_the_reference(base, tokenizer_and_special):
    raw_b = changed(base["raw_a"], expected_num_tokens=500, max_num_tokens=650, prefer_buffer_before=300,
                    max_buffer_size=1, text_cond_dropout_prob=0.6, prepack__batches_per_stream=AFTER)
    cfg_b, new = continue_pack(base, "budgets", raw_b, tokenizer_and_special, after=5)
    assert_chain_is_the_reference(new, [base["cfg_a"], cfg_b], [5], tokenizer_and_special)
    assert differs_from_old(base, new, 5)


def test_a_group_appended_at_the_end_starts_fresh_as_in_the_reference(base, tokenizer_and_special):
    raw_b = changed(base["full"], prepack__batches_per_stream=AFTER, unified_edit__weight=3.0)
    assert list(raw_b["dataset"]["grouped_datasets"])[-1] == "unified_edit"
    cfg_b, new = continue_pack(base, "appended", raw_b, tokenizer_and_special, after=3)
    assert_chain_is_the_reference(new, [base["cfg_a"], cfg_b], [3], tokenizer_and_special)
    groups = {o for s in (0, 1) for b in open_stream(new, s) for o in map(repr, b.batch_data_indexes)}
    assert any("unified_edit" in g for g in groups)
    # continue x an explicit --reuse OTHER (a pack holding the edit pictures OLD lacks): both lists
    # are read, and the continuation is the same files
    from tests.helpers.s3checks import pack_bytes

    other = os.path.join(base["root"], "appended_other")
    run_pack(load_config(cfg_b), other, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    again = os.path.join(base["root"], "appended_reuse")
    summary = run_pack(load_config(cfg_b), again, RunOptions(inline=True, bar=False, reuse=[other],
                                                             continue_from=Continue(base["old"], 3)),
                       tokenizer=tokenizer_and_special)
    assert summary.reuse_from == (other, base["old"])
    assert pack_bytes(again) == pack_bytes(new)
    assert sum(st.reuse.get("reused", 0) for st in summary.streams) > 0


def test_a_chain_of_two_continues_as_the_reference(base, tokenizer_and_special):
    raw_b = changed(base["raw_a"], t2i_pretrain__weight=3.0, prepack__batches_per_stream=3)
    cfg_b, mid = continue_pack(base, "chain_b", raw_b, tokenizer_and_special, after=2)
    raw_c = changed(raw_b, vlm_sft__weight=5.0, max_buffer_size=1, prepack__batches_per_stream=AFTER)
    cfg_c, new = continue_pack(base, "chain_c", raw_c, tokenizer_and_special, old=mid, after=4)  # inside mid
    assert_chain_is_the_reference(new, [base["cfg_a"], cfg_b, cfg_c], [2, 4], tokenizer_and_special)
    # stats: each segment's mix side by side, counted over the records a reader takes from it
    from prepack.tools.stats import compute_stats, format_stats

    st = compute_stats(new)
    segs = st.segments.group_by("segment", "records").agg(pl.col("samples").sum(), pl.col("weight").max()).sort("segment")
    assert segs["records"].to_list() == [2 * 2, (4 - 2) * 2, 2 * AFTER]
    per_record = [sum(len(b.batch_data_indexes) for b in open_stream(new, s)) for s in (0, 1)]
    assert segs["samples"].sum() == sum(per_record)
    t2i = st.segments.filter(pl.col("group") == "t2i_pretrain")["weight"].to_list()
    assert t2i == [1.0, 3.0, 3.0] and "each segment's mix" in format_stats(st)
    # lineage over the chain: a reader's record numbers, each row naming the segment it was packed in
    from prepack.tools.lineage_queries import batches_with_row, rows_of_batch

    for s in (0, 1):
        for r, b in enumerate(open_stream(new, s)):
            rows = rows_of_batch(new, s, r)
            want = [(d["dataset_name"], d["data_indexes"] if isinstance(d["data_indexes"], list)
                     else [d["data_indexes"]], int(n)) for d, n in zip(b.batch_data_indexes, b.sample_lens)]
            assert list(zip(rows["group"], rows["data_indexes"].to_list(), rows["num_tokens"])) == want, (s, r)
            assert set(rows["segment"]) == {0 if r < 2 else 1 if r < 4 else 2}, (s, r)
        row = rows_of_batch(new, s, 5).row(0, named=True)
        hits = batches_with_row(new, row["source_file"], row["source_row"], row["source_row_group"])
        assert (s, 5, 2) in set(zip(hits["stream"], hits["record"], hits["segment"]))
    # and switching before mid's own switch takes OLD's state there (N counts the whole chain)
    cfg_d, early = continue_pack(base, "chain_early", raw_c, tokenizer_and_special, old=mid, after=1)
    assert_chain_is_the_reference(early, [base["cfg_a"], cfg_d], [1], tokenizer_and_special)


def test_each_stream_switches_where_a_training_state_leaves_it(base, tokenizer_and_special, tmp_path):
    """A loader state saved after an odd number of steps (K=2: the streams stand at different batches)."""
    ds = PackedShardDataset(base["old"], rank=0, world_size=1)
    it = iter(ds)
    for _ in range(5):  # round robin: stream 0 has given 3 batches, stream 1 two
        next(it)
    state = json.loads(json.dumps(ds.state_dict()))
    (tmp_path / "loader.json").write_text(json.dumps(ds.state_dict()))  # --after-state reads a saved state
    assert Continue.from_args(base["old"], None, str(tmp_path / "loader.json")).after_state == state
    raw_b = changed(base["raw_a"], t2i_pretrain__weight=4.0, prepack__batches_per_stream=AFTER)
    cfg_b, new = continue_pack(base, "at_state", raw_b, tokenizer_and_special, after_state=state)
    assert Pack.open(new).info.parent.after == [3, 2]
    configs = [base["cfg_a"], cfg_b]
    for s, after in ((0, 3), (1, 2)):
        assert_chain_is_the_reference(new, configs, [after], tokenizer_and_special, streams=(s,))
    # the training goes on from its own state on NEW, in a new process: exactly the batches after it
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {REPO!r})
        from loader import PackedShardDataset
        ds = PackedShardDataset({new!r}, rank=0, world_size=1)
        ds.load_state_dict(json.load(open({str(path)!r})))
        print(json.dumps([[b.sequence_length, repr(b.batch_data_indexes)] for b in ds]))
    """)
    got = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                                    cwd=REPO).stdout)
    whole = [[b.sequence_length, repr(b.batch_data_indexes)] for b in PackedShardDataset(new, rank=0, world_size=1)]
    assert got == whole[5:] and len(whole) == 3 + 2 + 2 * AFTER


def test_a_state_saved_on_new_resumes_there_after_a_json_round_trip(base, tokenizer_and_special, tmp_path):
    raw_b = changed(base["raw_a"], vlm_sft__weight=3.0, prepack__batches_per_stream=AFTER)
    _, new = continue_pack(base, "resume", raw_b, tokenizer_and_special, after=3)
    whole = [[b.sequence_length, repr(b.batch_data_indexes)] for b in PackedShardDataset(new, rank=0, world_size=1)]
    for taken in (4, 9):  # before the switch (OLD's batches) and after it (NEW's)
        ds = PackedShardDataset(new, rank=0, world_size=1)
        it = iter(ds)
        for _ in range(taken):
            next(it)
        path = tmp_path / f"state{taken}.json"
        path.write_text(json.dumps(ds.state_dict()))
        script = textwrap.dedent(f"""
            import json, sys
            sys.path.insert(0, {REPO!r})
            from loader import PackedShardDataset
            ds = PackedShardDataset({new!r}, rank=0, world_size=1)
            ds.load_state_dict(json.load(open({str(path)!r})))
            print(json.dumps([[b.sequence_length, repr(b.batch_data_indexes)] for b in ds]))
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
        assert json.loads(out.stdout) == whole[taken:]
    # a state saved on OLD before the switch resumes on NEW too (training switches packs mid-run)
    ds = PackedShardDataset(base["old"], rank=0, world_size=1)
    it = iter(ds)
    for _ in range(4):
        next(it)
    on_new = PackedShardDataset(new, rank=0, world_size=1)
    on_new.load_state_dict(json.loads(json.dumps(ds.state_dict())))
    assert [[b.sequence_length, repr(b.batch_data_indexes)] for b in on_new] == whole[4:]
    # world-size change on a chain: one rank's merged state reads the same
    merged = PackedShardDataset.merge_states([ds.state_dict()])
    two = [PackedShardDataset(new, rank=r, world_size=2) for r in (0, 1)]
    for d in two:
        d.load_state_dict(merged)
    assert sum(1 for d in two for _ in d) == len(whole) - 4


def test_new_is_verified_audited_and_resumed_like_any_pack(base, tokenizer_and_special):
    raw_b = changed(base["raw_a"], t2i_pretrain__weight=2.0, prepack__batches_per_stream=2)
    cfg_b, new = continue_pack(base, "extended", raw_b, tokenizer_and_special, after=5)
    # extended past its budget: each stream resumes from NEW's own last checkpoint, not from OLD
    raw_b4 = changed(raw_b, prepack__batches_per_stream=AFTER)
    run_pack(load_config(write_config(base["root"], "extended", raw_b4)), new, RunOptions(inline=True, bar=False, continue_from=Continue(base["old"], 5)), tokenizer=tokenizer_and_special)
    assert_chain_is_the_reference(new, [base["cfg_a"], cfg_b], [5], tokenizer_and_special)
    assert verify_pack(new).ok
    report = audit_pack(new, all_streams=True, tokenizer=tokenizer_and_special)
    assert report.ok, "\n".join(report.lines())


def test_what_may_not_change_is_refused_in_one_line(base, tokenizer_and_special):
    cases = [
        (dict(num_workers=1), "num_workers"),
        (dict(prepack__world_size=2, num_workers=1), "prepack.world_size"),
        (dict(data_seed=7), "dataset.data_seed"),
        (dict(seed=7), "seed changed"),
        (dict(vit_patch_size=16), "dataset.vit_patch_size"),
        (dict(t2i_pretrain__num_used_data=[3]), "grouped_datasets.t2i_pretrain.num_used_data"),
        (dict(vlm_sft__shuffle_lines=True), "grouped_datasets.vlm_sft.shuffle_lines"),
    ]
    for change, key in cases:
        raw_b = changed(base["raw_a"], **change)
        with pytest.raises(PackRefused, match=key) as e:
            continue_pack(base, "refused", raw_b, tokenizer_and_special, after=2)
        assert "\n" not in str(e.value)
        assert not os.path.exists(os.path.join(base["root"], "refused", "pack.json"))
    with pytest.raises(PackRefused, match="stream 0 ended after 8 records, before record 9"):
        continue_pack(base, "refused", base["raw_a"], tokenizer_and_special, after=9)
    with pytest.raises(UsageError, match="exactly one of --after"):
        Continue.from_args(base["old"], None, None)
    # a rerun over NEW must continue the same pack at the same place
    raw_b = changed(base["raw_a"], t2i_pretrain__weight=2.0, prepack__batches_per_stream=1)
    _, new = continue_pack(base, "rerun", raw_b, tokenizer_and_special, after=2)
    with pytest.raises(PackRefused, match="continues .* after record 2"):
        run_pack(load_config(write_config(base["root"], "rerun", raw_b)), new, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)


def test_a_parent_that_moved_or_changed_is_refused_not_read(base, tokenizer_and_special, tmp_path):
    import shutil

    from prepack.cli import main
    from schemas.errors import DamagedFile

    parent = str(tmp_path / "parent")
    shutil.copytree(base["old"], parent)
    raw_b = changed(base["raw_a"], t2i_pretrain__weight=2.0, prepack__batches_per_stream=1)
    _, new = continue_pack(base, "moved", raw_b, tokenizer_and_special, old=parent, after=3)
    assert verify_pack(new).ok
    shutil.rmtree(parent)
    with pytest.raises(DamagedFile, match="no longer a pack there"):
        list(open_stream(new, 0))
    assert not verify_pack(new).ok
    # the CLI: --after without --continue, or both switches, is a usage error (exit 2, one line)
    assert main(["run", base["cfg_a"], "--out", str(tmp_path / "x"), "--after", "3", "--no-ray"]) == 2
    assert main(["run", base["cfg_a"], "--out", str(tmp_path / "x"), "--continue", base["old"], "--after", "3",
                 "--after-state", "s.json", "--no-ray"]) == 2


def test_continue_from_a_pack_on_s3(base, s3, tokenizer_and_special):
    from tests.helpers.packs import pack_in_process

    uri = pack_in_process(base["cfg_a"], s3.new_prefix("old"), tokenizer_and_special)
    raw_b = changed(base["raw_a"], vlm_sft__weight=4.0, prepack__batches_per_stream=2)
    _, from_store = continue_pack(base, "from_s3", raw_b, tokenizer_and_special, old=uri, after=3)
    _, from_disk = continue_pack(base, "from_disk", raw_b, tokenizer_and_special, after=3)
    for s in (0, 1):
        a = [b.to_dict() for b in open_stream(from_store, s)]
        b = [b.to_dict() for b in open_stream(from_disk, s)]
        assert len(a) == len(b) == 5 and all(not diff_batches(x, y) for x, y in zip(a, b))
    assert Pack.open(from_store).info.parent.uri == uri


def test_the_readme_command_continues_on_a_local_ray(base, tokenizer_and_special, tmp_path):
    """The README's "Change the mix mid-run" command, run as written (its paths and N replaced)."""
    import shlex

    from tests.helpers.readme import readme_tested_blocks

    block = [line for line in readme_tested_blocks()[3].splitlines() if line.strip()]
    assert len(block) == 1 and "--continue" in block[0], "README block changed shape"
    raw_b = changed(base["raw_a"], t2i_pretrain__weight=3.0, prepack__batches_per_stream=2)
    cfg_b = write_config(base["root"], "readme", raw_b)
    out = str(tmp_path / "anneal")
    words = [{"anneal.yaml": cfg_b, "/data/anneal": out, "/data/packed": base["old"], "15000": "3"}.get(w, w)
             for w in shlex.split(block[0])]
    assert words[0] == "prepack"
    run = subprocess.run([sys.executable, "-m", "prepack.cli", *words[1:], "--num-cpus", "2"], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    _, inline = continue_pack(base, "readme_inline", raw_b, tokenizer_and_special, after=3)
    for s in (0, 1):
        a, b = list(open_stream(out, s)), list(open_stream(inline, s))
        assert len(a) == len(b) == 5 and all(not diff_batches(x.to_dict(), y.to_dict()) for x, y in zip(a, b))


def test_a_removed_group_is_dropped_and_its_buffered_samples_still_pack(base, tokenizer_and_special):
    """Diverges from the reference (which pairs group states by position): groups match by name."""
    raw_b = changed(base["raw_a"], drop_group="vlm_sft", prepack__batches_per_stream=AFTER)
    _, new = continue_pack(base, "removed", raw_b, tokenizer_and_special, after=3)
    for s in (0, 1):
        batches = list(open_stream(new, s))
        assert len(batches) == 3 + AFTER
        later = [repr(b.batch_data_indexes) for b in batches[3 + 1:]]  # past what the buffer may hold
        assert later and not any("vlm_sft" in x for x in later[-2:])
        old = [repr(b.batch_data_indexes) for b in open_stream(base["old"], s)][3 + 1:]
        assert any("vlm_sft" in x for x in old[-2:])  # OLD's mix would have drawn it there


def test_plan_projects_a_continuation_from_the_switch(base, tokenizer_and_special):
    from prepack.tools.plan import PlanOptions, plan_pack

    raw_b = changed(base["raw_a"], vlm_sft__weight=4.0, prepack__batches_per_stream=AFTER)
    cfg_b = load_config(write_config(base["root"], "plan_b", raw_b))
    plan = plan_pack(cfg_b, PlanOptions(continue_from=Continue(base["old"], 5), sample_batches=2), tokenizer=tokenizer_and_special)
    assert plan.continues["from"] == base["old"] and plan.continues["after"] == 5
    at = plan.continues["groups"]
    assert set(at) == {"t2i_pretrain", "vlm_sft"} and all(v is not None and v > 0 for v in at.values())
    assert plan.records == 2 * AFTER and any("continues" in line for line in plan.lines())
    fresh = plan_pack(cfg_b, PlanOptions(sample_batches=2), tokenizer=tokenizer_and_special)
    assert not fresh.continues
    with pytest.raises(PackRefused, match="8 records, fewer than the 9"):
        plan_pack(cfg_b, PlanOptions(continue_from=Continue(base["old"], 9)), tokenizer=tokenizer_and_special)


def test_a_parent_still_packing_is_waited_for(base, tokenizer_and_special, tmp_path):
    """OLD has 3 records a stream and is not done: the continuation after 5 waits until OLD holds them."""
    import threading

    from schemas.layout import MANIFEST_NAME, done_file

    raw_a3 = changed(base["raw_a"], prepack__batches_per_stream=3)
    old = str(tmp_path / "old")
    run_pack(load_config(write_config(str(tmp_path), "a3", raw_a3)), old, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    for rel in [MANIFEST_NAME] + [done_file(s) for s in (0, 1)]:  # as while it is still packing
        os.remove(os.path.join(old, rel))
    raw_b = changed(base["raw_a"], t2i_pretrain__weight=4.0, prepack__batches_per_stream=AFTER)
    cfg_b = write_config(base["root"], "waits", raw_b)
    new = str(tmp_path / "new")
    errors = []

    def continuation():
        try:
            run_pack(load_config(cfg_b), new, RunOptions(inline=True, bar=False, continue_from=Continue(old, 5)), tokenizer=tokenizer_and_special)
        except BaseException as e:  # noqa: BLE001  (reported by the assertion below)
            errors.append(e)

    waiting = threading.Thread(target=continuation)
    waiting.start()
    waiting.join(3.0)
    assert waiting.is_alive() and not os.path.exists(os.path.join(new, "pack.json"))  # waiting for OLD
    run_pack(load_config(base["cfg_a"]), old, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    waiting.join(300)
    assert not errors, errors
    assert_chain_is_the_reference(new, [base["cfg_a"], cfg_b], [5], tokenizer_and_special)


def test_every_reader_reads_the_chain(base, tokenizer_and_special, monkeypatch):
    """build_dataloader (2 DataLoader workers) and a following reader give what PackedShardDataset gives."""
    from loader import build_dataloader

    raw_b = changed(base["raw_a"], t2i_pretrain__weight=4.0, prepack__batches_per_stream=2)
    _, new = continue_pack(base, "readers", raw_b, tokenizer_and_special, after=3)
    ids = lambda batches: [(b.sequence_length, repr(b.batch_data_indexes)) for b in batches]  # noqa: E731
    plain = ids(PackedShardDataset(new, rank=0, world_size=1))
    assert len(plain) == 2 * (3 + 2)
    assert ids(build_dataloader(new, rank=0, world_size=1, num_workers=2, pin_memory=False)) == plain
    assert ids(PackedShardDataset(new, rank=0, world_size=1, follow=True, timeout_s=30)) == plain
    # continue x follow: the same continuation followed while it is packed, from its first record (OLD's)
    import threading

    from prepack.run.commit.writer import StreamWriter

    append = StreamWriter.append
    monkeypatch.setattr(StreamWriter, "append", lambda self, batch: (time.sleep(0.3), append(self, batch))[1])
    cfg_b, live = write_config(base["root"], "readers_live", raw_b), os.path.join(base["root"], "readers_live")
    job = threading.Thread(target=run_pack, args=(load_config(cfg_b), live, RunOptions(
        inline=True, bar=False, continue_from=Continue(base["old"], 3))), kwargs={"tokenizer": tokenizer_and_special})
    job.start()
    while not os.path.exists(os.path.join(live, "pack.json")) and job.is_alive():
        time.sleep(0.02)
    followed, packing = [], []
    for b in PackedShardDataset(live, rank=0, world_size=1, follow=True, poll_s=0.05, timeout_s=120):
        followed += ids([b])
        packing.append(job.is_alive())
    job.join(timeout=120)
    assert followed == plain and packing[0], "the follower read the continuation only once it was packed"


def _index_rows(out: str) -> dict:
    p = Pack.open(out)
    return {s: [(sh.nbytes, sh.xxh3, [r.digest for r in sh.records]) for sh in p.index(s).shards]
            for s in range(p.num_streams)}


def test_a_trimmed_old_is_continued_from_and_a_trimmed_new_restored(base, tokenizer_and_special, tmp_path):
    """continue x bounded: OLD trimmed whole (its checkpoints off the ladder dropped) still gives the
    state after record N, packed again from the nearest checkpoint kept; NEW, trimmed whole, is
    restored byte for byte (its own records; OLD's are OLD's to restore)."""
    from prepack.run.bounded.restore import restore
    from prepack.run.bounded.trim_policy import TrimPolicy
    from schemas.manifest import TrimmedShards

    tok = tokenizer_and_special
    raw_a = changed(base["raw_a"], prepack__shard_bytes=60_000)  # a shard every batch or two: a ladder to drop
    cfg_a = write_config(str(tmp_path), "a", raw_a)
    old, trimmed_old = str(tmp_path / "old"), str(tmp_path / "trimmed-old")
    run_pack(load_config(cfg_a), old, RunOptions(inline=True, bar=False), tokenizer=tok)
    run_pack(load_config(cfg_a), trimmed_old, RunOptions(inline=True, bar=False), tokenizer=tok)
    TrimPolicy(Pack.open(trimmed_old), lambda s: 1 << 62).apply()
    p = Pack.open(trimmed_old)
    dropped = TrimmedShards.read(p.location, 0).checkpoints
    assert dropped, "OLD must have dropped checkpoints"
    after = p.index(0).shards[dropped[0]].first_record + 1  # stream 0's state there: from an earlier checkpoint
    raw_b = changed(raw_a, t2i_pretrain__weight=2.0, prepack__batches_per_stream=AFTER)
    cfg_b = write_config(str(tmp_path), "b", raw_b)
    news = {}
    for name, parent in (("new", old), ("new-of-trimmed", trimmed_old)):
        news[name] = str(tmp_path / name)
        run_pack(load_config(cfg_b), news[name],
                 RunOptions(inline=True, bar=False, continue_from=Continue(parent, after)), tokenizer=tok)
    assert _index_rows(news["new"]) == _index_rows(news["new-of-trimmed"])
    new = news["new-of-trimmed"]
    TrimPolicy(Pack.open(new), lambda s: 1 << 62).apply()
    n = Pack.open(new)
    assert all(TrimmedShards.read(n.location, s).shards for s in (0, 1))
    restore(new, {s: (0, None) for s in (0, 1)}, tokenizer=tok)
    assert verify_pack(new).ok and _index_rows(new) == _index_rows(news["new"])
    for s in (0, 1):
        for sh in n.index(s).shards:
            assert open(os.path.join(new, sh.file), "rb").read() == open(os.path.join(news["new"], sh.file), "rb").read()
