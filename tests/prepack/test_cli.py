"""The prepack command line: --help teaches, errors are one line with a non-zero exit code."""

from __future__ import annotations

import subprocess
import sys

import pytest


def prepack(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "prepack.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_help_lists_every_subcommand_with_examples():
    r = prepack("--help")
    assert r.returncode == 0
    for word in ("run", "plan", "verify", "audit", "inspect", "stats", "demo-data", "examples:", "ray job submit"):
        assert word in r.stdout
    r = prepack("run", "--help")
    assert r.returncode == 0 and "--streams" in r.stdout and "--address" in r.stdout


def test_no_subcommand_prints_help_and_fails():
    r = prepack()
    assert r.returncode == 2 and "usage:" in r.stdout


@pytest.mark.parametrize("args, code, text", [
    (["run", "missing.yaml", "--out", "x"], 2, "config file not found"),
    pytest.param(["run", "configs/demo.yaml", "--out", "x", "--streams", "a,b"], 2, None, marks=pytest.mark.slow),
    (["verify", "/nonexistent/pack"], 1, "is not a pack (no pack.json)"),
    pytest.param(["stats", "/nonexistent/pack"], 1, "is not a pack (no pack.json)", marks=pytest.mark.slow),
])
def test_errors_are_one_line_on_stderr(args, code, text, tmp_path):
    from tests.helpers.paths import REPO as repo

    r = prepack(*[a if a != "x" else str(tmp_path / "out") for a in args], cwd=repo)
    assert r.returncode == code, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("prepack: error: "), r.stderr
    if text:
        assert text in lines[0]


def test_loader_only_install_names_the_missing_extra(tmp_path):
    """With only the slim (loader) install, a packer command says which install it needs."""
    code = "import sys; sys.modules['yaml'] = None; from prepack.cli import main; sys.exit(main(['run', 'c.yaml', "
    code += f"'--out', {str(tmp_path / 'out')!r}]))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "yaml" in lines[0] and "pip install 'bagel-prepack[pack]'" in lines[0]


def test_bad_yaml_is_one_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("dataset: [unclosed\n")
    r = prepack("run", str(p), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "not valid YAML" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_progress_postfix_shows_each_stream_or_the_spread():
    from prepack.run.progress_bar import RunProgress, StreamProgress

    few = RunProgress([0, 1], 6, {})
    few.update(StreamProgress(0, batches=3, tokens=3000, done=False))
    few.update(StreamProgress(1, batches=6, tokens=6000, done=True))
    line = few.postfix(2.0)
    assert "9,000 tok" in line and "4,500 tok/s" in line and "s0:3/6 s1:6/6" in line and "done 1/2" in line
    many = RunProgress(list(range(10)), None, {})
    for s in range(10):
        many.update(StreamProgress(s, batches=s, tokens=10, done=False))
    assert "per stream 0..9" in many.postfix(0.0) and "done 0/10" in many.postfix(0.0)


def test_each_drop_reason_is_announced_once_per_run_with_its_meaning():
    from prepack.run.progress_bar import RunProgress, StreamProgress

    run = RunProgress(list(range(8)), 10, {"max_num_tokens_per_sample": 4096})
    for s in range(8):
        run.update(StreamProgress(s, batches=1, tokens=1, drops={"overlength_sample": s + 1},
                                  examples={"overlength_sample": str(4601 + s)}))
    lines = run.new_kinds()
    assert len(lines) == 1, lines
    assert lines[0].startswith("overlength_sample: a sample of 4601 tokens exceeds max_num_tokens_per_sample=4096")
    assert "first in stream 0" in lines[0]
    run.update(StreamProgress(3, batches=2, tokens=2, drops={"overlength_sample": 9}, warnings={"truncated_image": 1}))
    later = run.new_kinds()
    assert len(later) == 1 and "truncated_image" in later[0], later


def test_retried_streams_are_announced_once_per_attempt_with_the_cause():
    from prepack.run.progress_bar import RunProgress

    run = RunProgress([0, 1, 2], 5, {})
    lines = run.retried({0: ["n1"], 1: ["n1", "n2"], 2: ["n2", "n2"], 3: ["?", "n1"]}, {"n1": "127.0.0.1:1234"})
    assert len(lines) == 3 and "stream 1 retried (attempt 2 of its stream_task): its node 127.0.0.1:1234 was lost" in lines[0]
    assert "stream 2 retried (attempt 2 of its stream_task): its worker died" in lines[1]
    assert "stream 3 retried (attempt 2 of its stream_task): its previous attempt ended before it could report" in lines[2]
    assert run.retried({1: ["n1", "n2"], 2: ["n2", "n2"]}, {}) == []
    assert "streams 1-3" in run.retry_summary()


def test_a_bug_prints_its_traceback_and_says_so(monkeypatch, capsys):
    from prepack import cli
    from prepack.tools import verify_command

    def broken(args):
        raise KeyError("internal")

    monkeypatch.setattr(verify_command, "cmd_verify", broken)
    assert cli.main(["verify", "somewhere"]) == 70
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "KeyError: 'internal'" in err
    assert "internal error (a bug in prepack" in err.strip().splitlines()[-1]


def test_config_mistakes_are_caught_before_anything_is_written(tmp_path, capsys):
    from prepack.cli import main
    from tests.helpers.paths import REPO

    cfg = tmp_path / "bad.yaml"
    text = open(f"{REPO}/configs/demo.yaml").read()
    assert 'compression: "zstd:1"' in text
    cfg.write_text(text.replace('compression: "zstd:1"', 'compression: "zstd:99"'))
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prepack.compression" in err[0] and "zstd level" in err[0]
    assert not out.exists()


def test_streams_take_ids_and_ranges():
    from prepack.run.command import parse_streams as _streams
    from schemas.errors import UsageError

    assert _streams("0,5,8-10") == [0, 5, 8, 9, 10] and _streams(None) is None
    with pytest.raises(UsageError, match="8-15"):
        _streams("1,x")


def test_the_bar_has_its_own_flags_and_progress_names_trainings_folders():
    """--bar / --no-bar (--no-progress, its older name) set the progress bar; --progress P is a training's
    folder, and a bare --progress (the bar's older name) is still read as --bar."""
    from prepack.cli import build_parser
    from prepack.run.command import _BAR

    def run_args(*extra):
        return build_parser().parse_args(["run", "c.yaml", "--out", "o", *extra])

    assert run_args("--bar").bar and not run_args().bar
    assert run_args("--no-bar").no_bar and run_args("--no-progress").no_bar and not run_args().no_bar
    assert run_args("--progress", "folder").progress == ["folder"]
    assert run_args("--progress").progress == [_BAR]


@pytest.mark.slow  # plans through the CLI in subprocesses
def test_plan_prints_one_json_object_and_its_help_teaches(tmp_path):
    import json

    from tests.helpers.packs import small_dataset

    r = prepack("plan", "--help")
    assert r.returncode == 0
    for word in ("--cores", "--json", "shards per stream", "core-hours", "warnings", "examples:"):
        assert word in r.stdout
    config = small_dataset(str(tmp_path), batches=5)
    r = prepack("plan", config, "--json", "--cores", "4", "--sample-batches", "1", "--sample-streams", "1")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)  # the whole of stdout is one object
    assert plan["records"] == 10 and plan["streams"] == 2 and plan["cores"] == 4
    assert plan["output_bytes"] > 0 and plan["cpu_core_hours"] > 0
    assert set(plan["groups"]) == {"t2i_pretrain", "vlm_sft"}
    assert set(plan["composition"]) == {"per_batch", "per_group"}
    assert plan["composition"]["per_batch"]["tokens"]["count"] == 1 and plan["composition"]["per_batch"]["text"]["max"] > 0
    # both step models' spreads, keyed by sync kind (a plan draws its steps from the sampled batches)
    assert set(plan["step_spread"]) == {"lockstep", "step"} and plan["step_spread"]["lockstep"]["drawn"]
    r = prepack("plan", config, "--cores", "4", "--sample-batches", "1", "--sample-streams", "1",
                "--micro-batches", "2", "--sync", "lockstep")
    assert r.returncode == 0 and "records" in r.stdout and "core-hours" in r.stdout
    assert "lockstep step spread (W=1, M=2, 200 steps drawn" in r.stdout and "\nstep spread" not in r.stdout
    r = prepack("plan", config, "--cores", "0")
    assert r.returncode == 2 and r.stderr.strip().startswith("prepack: error: --cores")


@pytest.mark.slow  # plans through the CLI in subprocesses
def test_plan_ends_without_the_interpreter_teardown_and_says_everything_first(tmp_path):
    """The program ends a plan at once (unloading torch and numba would add ~1 s) after flushing
    its output; other commands, and ``main()`` called in process, end normally."""
    import json

    from tests.helpers.packs import small_dataset

    config = small_dataset(str(tmp_path), batches=2)
    hook = "import atexit, sys; atexit.register(lambda: print('teardown ran', file=sys.stderr)); "

    def program(*args):
        code = hook + f"sys.argv = ['prepack', *{list(args)!r}]; from prepack.cli import entry; entry()"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)

    r = program("plan", config, "--json", "--sample-batches", "1", "--sample-streams", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["records"] == 4 and "teardown ran" not in r.stderr
    r = program("plan", config, "--cores", "0")  # a refused plan still says why, with its exit code
    assert r.returncode == 2 and r.stderr.startswith("prepack: error: --cores") and "teardown ran" not in r.stderr
    r = program("verify", str(tmp_path / "nothing"))
    assert r.returncode == 1 and "teardown ran" in r.stderr
    code = hook + f"from prepack.cli import main; print(main(['plan', {config!r}, '--cores', '0']))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "2" and "teardown ran" in r.stderr
