"""``prepack.engine.accounting``: drop/warning counters, their JSON form, their log rate limit,
and ``Rejected``."""

from __future__ import annotations

import json
import logging
import random

import pytest

from prepack.engine.accounting import Counters, Rejected

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
    # per stream, for -v: the driver announces each reason once per run (prepack/run/progress.py)
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
