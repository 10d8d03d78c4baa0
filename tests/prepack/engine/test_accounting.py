"""``prepack.engine.accounting``: drop/warning counters, their JSON form, their log rate limit,
and ``Rejected``."""

from __future__ import annotations

import json
import logging
import random

import pytest

from prepack.engine.accounting import Counters, Drop, Reference, Rejected, Warn, parse_key

LOGGER = "prepack.engine.accounting"


def _events(n: int, seed: int) -> list[tuple[str, str, int]]:
    """A random sequence of (kind, name, n) updates: drops (with counts) and warnings."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            out.append(("drop", f"g{rng.randint(0, 3)}:reason_{rng.randint(0, 5)}", rng.randint(1, 4)))
        else:
            out.append(("warn", f"kind_{rng.randint(0, 6)}", 1))
    return out


def _apply(c: Counters, events) -> None:
    for kind, name, n in events:
        if kind == "drop":
            c.drop(name, "detail", n=n)
        else:
            c.warn(name, "detail")


def test_counts_are_sums_of_updates():
    events = _events(500, 1)
    c = Counters()
    _apply(c, events)
    drops, warnings = {}, {}
    for kind, name, n in events:
        target = drops if kind == "drop" else warnings
        target[name] = target.get(name, 0) + n
    assert c.drops == drops
    assert c.warnings == warnings
    assert c.samples_read == {} and c.samples_packed == {}


def test_drop_default_counts_one_and_warn_ignores_detail():
    c = Counters()
    c.drop("a")
    c.drop("a", "some detail")
    c.drop("b", n=7)
    c.warn("w", "x")
    c.warn("w")
    assert c.drops == {"a": 2, "b": 7}
    assert c.warnings == {"w": 2}


def test_json_round_trip_is_exact_and_independent():
    c = Counters()
    _apply(c, _events(300, 2))
    c.samples_read.update({"t2i_pretrain": 12, "vlm_sft": 3})
    c.samples_packed.update({"vlm_sft": 2, "t2i_pretrain": 10})
    doc = c.to_json()
    back = Counters.from_json(json.loads(json.dumps(doc)))
    assert back == c
    assert back.to_json() == doc
    # the copy shares no dict with the original, in either direction
    back.drops["new"] = 1
    back.samples_read["t2i_pretrain"] += 1
    c.warn("kind_0")
    assert "new" not in c.drops and c.samples_read["t2i_pretrain"] == 12
    assert back.warnings != c.warnings
    doc["drops"]["other"] = 5
    assert "other" not in c.drops


def test_json_is_sorted_and_deterministic():
    """The same counts reached in any order serialise to the same bytes, keys sorted."""
    events = _events(400, 3)
    shuffled = list(events)
    random.Random(4).shuffle(shuffled)
    a, b = Counters(), Counters()
    _apply(a, events)
    _apply(b, shuffled)
    b.samples_read.update({"z": 1, "a": 2})
    a.samples_read.update({"a": 2, "z": 1})
    assert list(a.drops) != sorted(a.drops) or list(b.drops) != sorted(b.drops)  # insertion order differs
    ja, jb = json.dumps(a.to_json()), json.dumps(b.to_json())
    assert ja == jb
    doc = a.to_json()
    assert list(doc) == ["drops", "warnings", "samples_read", "samples_packed", "examples"]
    for section in doc.values():
        assert list(section) == sorted(section)


def test_from_json_of_an_empty_document_and_of_unknown_sections():
    assert Counters.from_json({}) == Counters()
    with pytest.raises(TypeError):
        Counters.from_json({"drops": {}, "surprise": {}})


def _logged_counts(caplog, prefix: str, name: str) -> list[int]:
    out = []
    for r in caplog.records:
        if r.name == LOGGER and r.getMessage().startswith(f"{prefix}[{name}]="):
            out.append(int(r.getMessage().split("=", 1)[1].split()[0]))
    return out


@pytest.mark.parametrize("prefix", ["drop", "warning"])
def test_logs_first_three_then_every_thousandth(caplog, prefix):
    c = Counters()
    caplog.set_level(logging.INFO, logger=LOGGER)
    for _ in range(3500):
        if prefix == "drop":
            c.drop("r", "why")
        else:
            c.warn("r", "why")
    assert _logged_counts(caplog, prefix, "r") == [1, 2, 3, 1000, 2000, 3000]
    # per stream, for -v: the driver announces each reason once per run (prepack/run/progress_bar.py)
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == LOGGER)
    assert any("why" in r.getMessage() for r in caplog.records)


def test_log_rate_limit_is_per_reason(caplog):
    c = Counters()
    caplog.set_level(logging.INFO, logger=LOGGER)
    for _ in range(5):
        c.drop("a")
        c.drop("b")
        c.warn("a")
    assert _logged_counts(caplog, "drop", "a") == [1, 2, 3]
    assert _logged_counts(caplog, "drop", "b") == [1, 2, 3]
    assert _logged_counts(caplog, "warning", "a") == [1, 2, 3]


def test_bulk_drops_log_when_they_reach_a_logged_occurrence(caplog):
    """``drop(reason, n=k)`` counts k occurrences at once: an update that includes one of the first
    three occurrences, or a 1000th, is logged (once); one that includes none is not."""
    c = Counters()
    caplog.set_level(logging.INFO, logger=LOGGER)
    c.drop("bulk", n=5)  # occurrences 1..5: includes the first
    c.drop("bulk", n=990)  # 6..995
    c.drop("bulk", n=10)  # 996..1005: includes the 1000th
    c.drop("bulk", n=994)  # 1006..1999
    c.drop("bulk", n=1)  # 2000
    c.drop("bulk", n=2500)  # 2001..4500: includes 3000 and 4000, logged once
    assert _logged_counts(caplog, "drop", "bulk") == [5, 1005, 2000, 4500]
    assert c.drops["bulk"] == 4500


def test_first_example_of_each_kind_is_kept():
    c = Counters()
    c.drop("overlength_sample", "4601")
    c.drop("overlength_sample", "5000")
    c.warn("truncated_image", "a.jpg")
    assert c.examples == {"overlength_sample": "4601", "truncated_image": "a.jpg"}
    assert Counters.from_json(c.to_json()).examples == c.examples


def test_rejected_reason_and_detail():
    e = Rejected("t2i_image_parse", "cannot identify image file")
    assert isinstance(e, Exception)
    assert e.reason == "t2i_image_parse"
    assert e.detail == "cannot identify image file"
    assert str(e) == "t2i_image_parse: cannot identify image file"
    bare = Rejected("strict_truncated_image")
    assert bare.reason == "strict_truncated_image" and bare.detail == ""
    assert str(bare) == "strict_truncated_image"
    with pytest.raises(Rejected) as info:
        raise Rejected("image_over_pixel_limit", "30000x20000 > 400000000 pixels")
    assert info.value.reason == "image_over_pixel_limit"


# -- declared reasons and kinds: counted keys, announcements ----------------------------------------

def _knobs() -> dict:
    from dataclasses import asdict

    from schemas.config import PackingKnobs

    return asdict(PackingKnobs())  # what the driver hands its RunProgress


def _announce(section: str, key: str, example: str) -> list[str]:
    """The run log's announcement of one counted key, through the driver's own path."""
    from prepack.run.progress_bar import RunProgress, StreamProgress

    run = RunProgress([0], 1, _knobs())
    run.update(StreamProgress(0, batches=1, tokens=1, examples={key: example}, **{section: {key: 1}}))
    return run.new_kinds()


GENERIC = "see docs/architecture/packing.md"


def _specific(declared, key: str, example: str) -> str:
    return f"{key}: {declared.meaning.format(detail=example, **_knobs())}"


@pytest.mark.parametrize("reason", list(Drop), ids=lambda d: d.key)
def test_every_drop_reason_is_announced_with_its_own_meaning(reason):
    groups = ["t2i_pretrain", "vlm_sft", "unified_edit"] if reason.per_group else [None]
    for group in groups:
        key = reason.counted_as(group)
        assert key == (f"{group}:{reason.key}" if group else reason.key)
        [line] = _announce("drops", key, "4601")
        assert line.startswith(_specific(reason, key, "4601")), line
        assert reason.reference.value in line and GENERIC not in line, line


@pytest.mark.parametrize("kind", list(Warn), ids=lambda w: w.key)
def test_every_warning_kind_is_announced_with_its_own_meaning(kind):
    [line] = _announce("warnings", kind.key, "")
    assert line.startswith(_specific(kind, kind.key, "?")), line
    assert kind.reference.value in line and GENERIC not in line, line
    if kind.strict is not None:
        assert f"strict: true drops it: {kind.strict.key}" in line, line


def test_the_pixel_limit_and_unsafe_paths_are_announced_under_their_group():
    """Both are always counted as ``group:reason``: their meaning is found through the prefix."""
    [pixels] = _announce("drops", "t2i_pretrain:image_over_pixel_limit", "a.parquet rg 0 row 3")
    assert pixels.startswith("t2i_pretrain:image_over_pixel_limit: an image above max_image_pixels, refused from its "
                             "header, never decoded (e.g. a.parquet rg 0 row 3); the reference packs it"), pixels
    [unsafe] = _announce("drops", "vlm_sft:unsafe_path_outside_data_dir", "rows.jsonl:7")
    assert unsafe.startswith("vlm_sft:unsafe_path_outside_data_dir: an image or video path outside the data folder")
    assert GENERIC not in pixels + unsafe


@pytest.mark.parametrize("section,key", [("drops", "g:never_declared"), ("drops", "never_declared"),
                                         ("drops", "t2i_pretrain:overlength_sample"),  # a packer reason, never per group
                                         ("drops", "overlength_sample:x"), ("warnings", "never_declared"),
                                         ("warnings", "overlength_sample")])
def test_an_undeclared_key_gets_the_generic_line(section, key):
    [line] = _announce(section, key, "x")
    assert GENERIC in line and line.startswith(f"{key}: "), line


def test_keys_are_counted_per_group_only_for_a_sources_reasons():
    c = Counters()
    c.drop(Drop.T2I_IMAGE_PARSE, "a.parquet rg 0 row 1", group="t2i_pretrain")
    c.drop(Drop.OVERLENGTH_SAMPLE, "5000")
    c.warn(Warn.TRUNCATED_IMAGE)
    c.drop_total(Drop.LEFT_IN_BUFFER_AT_END_OF_BUDGET, 4)
    assert c.drops == {"t2i_pretrain:t2i_image_parse": 1, "overlength_sample": 1, "left_in_buffer_at_end_of_budget": 4}
    assert c.warnings == {"truncated_image": 1}
    # a total counted at the end is no occurrence: no example of its own
    assert c.examples == {"t2i_pretrain:t2i_image_parse": "a.parquet rg 0 row 1", "overlength_sample": "5000",
                          "truncated_image": ""}
    assert all(type(k) is str for k in [*c.drops, *c.warnings, *c.examples])  # plain strings in every file
    assert json.dumps(c.to_json()) == json.dumps(Counters.from_json(json.loads(json.dumps(c.to_json()))).to_json())
    with pytest.raises(ValueError):
        c.drop(Drop.T2I_IMAGE_PARSE)  # a source's reason needs its group
    with pytest.raises(ValueError):
        c.drop(Drop.OVERLENGTH_SAMPLE, group="t2i_pretrain")


def test_parse_key_reads_back_what_was_counted():
    for reason in Drop:
        key = reason.counted_as("vlm_sft" if reason.per_group else None)
        assert parse_key(key) == (("vlm_sft" if reason.per_group else None), reason)
    for kind in Warn:
        assert parse_key(kind.key, dropped=False) == (None, kind)
    assert parse_key("g:unknown") == ("g", None) and parse_key("unknown") == (None, None)


def test_declarations_are_consistent():
    assert len({d.key for d in Drop} | {w.key for w in Warn}) == len(Drop) + len(Warn)  # one namespace of keys
    for kind in Warn:
        assert kind.strict is None or (kind.strict.per_group and kind.strict.key.startswith("strict_")), kind
    stricts = [d for d in Drop if d.key.startswith("strict_")]
    assert sorted(stricts) == sorted(w.strict for w in Warn if w.strict is not None)  # each strict drop has its kind
    for declared in [*Drop, *Warn]:
        assert declared.level == logging.INFO  # per-stream lines are for -v; the driver announces once per run
        assert isinstance(declared.reference, Reference) and declared.meaning


def test_rejected_takes_only_declared_reasons_and_crosses_processes():
    import pickle

    with pytest.raises(ValueError):
        Rejected("not_a_declared_reason")
    e = pickle.loads(pickle.dumps(Rejected(Drop.JSONL_PARSE, "bad JSON")))
    assert e.reason is Drop.JSONL_PARSE and e.detail == "bad JSON" and str(e) == "jsonl_parse: bad JSON"


def test_every_counting_site_names_a_declared_value():
    """No drop reason or warning kind is a bare string at the place it is counted or raised."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[3] / "prepack" / "engine"
    calls = {"Rejected", "drop", "drop_total", "warn", "_failed"}
    bare = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            strings = [n for n in ast.walk(node.args[0])
                       if isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant) and isinstance(n.value, str))]
            if name in calls and strings:
                bare.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not bare, bare
