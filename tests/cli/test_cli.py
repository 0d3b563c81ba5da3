"""The command line end to end on the `tiny` preset, its error handling, and exact resume."""

import json
import math

import pytest

from fastweights.cli import main
from helpers import PACKAGE, assert_json_shape

TINY = ["--preset", "tiny", "--quiet"]


@pytest.fixture
def trained(tiny_run):
    return tiny_run  # conftest: the tiny preset trained once per session


def test_train_writes_checkpoint_and_plot(trained):
    for name in ["model.safetensors", "config.json", "tokenizer.json", "trainer_state.safetensors", "checkpoint.json",
                 "metrics.jsonl", "loss_curve.png", "summary.json"]:
        assert (trained / name).is_file(), name
    summary = json.loads((trained / "summary.json").read_text())
    assert_json_shape(summary, "train_summary")
    assert summary["steps"] == 20 and math.isfinite(summary["val_loss"])
    assert summary["val_loss"] < math.log(66)  # learned something beyond uniform over the vocabulary


def test_eval_json(trained, capsys):
    assert main(["eval", "--checkpoint", str(trained), "--json", "--quiet"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["tokens"] > 1000 and 0 < m["bits_per_char"] < math.log2(66) + 0.5


def test_eval_on_a_file(trained, tmp_path, capsys):
    f = tmp_path / "doc.txt"
    f.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    assert main(["eval", "--checkpoint", str(trained), "--data", str(f), "--json", "--quiet"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["tokens"] == len(f.read_text()) - 1
    assert m["checkpoint"] == str(trained) and m["data"] == str(f)  # what was scored, named (seed-14 draw)
    f.write_text("ab")  # one prediction: scored
    assert main(["eval", "--checkpoint", str(trained), "--data", str(f), "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 1
    f.write_text("a")  # none: one line, exit 2
    assert main(["eval", "--checkpoint", str(trained), "--data", str(f), "--json", "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == "error: nothing to score: the evaluation text has fewer than two tokens"


def test_generate_streams_text(trained, capsys):
    assert main(["generate", "--checkpoint", str(trained), "--prompt", "ROMEO:", "--max-tokens", "25"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ROMEO:") and len(out.rstrip("\n")) == len("ROMEO:") + 25


def test_generate_is_deterministic_by_seed(trained, capsys):
    args = ["generate", "--checkpoint", str(trained), "--prompt", "A", "--max-tokens", "20", "--seed", "3"]
    main(args)
    a = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == a


@pytest.mark.parametrize("route", ["auto", "onednn"])
def test_resume_continues_to_the_same_loss(tmp_path, route, monkeypatch):
    """Also with every linear forced onto oneDNN's products (ops.linear), the custom backward in every step."""
    monkeypatch.setenv("FASTWEIGHTS_LINEAR", route)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [*TINY, "--set", "train.max_steps=12", "--set", "train.eval_every=0", "--set", "train.save_every=6"]
    assert main(["train", *common, "--out", str(straight)]) == 0
    # stop after 6 steps (same schedule: max_steps stays 12 in the config), then resume
    assert main(["train", *common, "--out", str(resumed), "--set", "train.max_minutes=1e-9"]) == 0
    first = json.loads((resumed / "summary.json").read_text())
    assert first["stopped_by_time_budget"] and first["steps"] == 0
    assert main(["train", *common, "--out", str(resumed), "--overwrite", "--set", "train.max_minutes=0", "--set",
                 "train.max_steps=6"]) == 0
    assert main(["train", "--resume", "--quiet", "--out", str(resumed), "--set", "train.max_steps=12"]) == 0
    a = json.loads((straight / "summary.json").read_text())
    b = json.loads((resumed / "summary.json").read_text())
    assert b["steps"] == 12
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
    assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-6)


def test_corpus_errors(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("tiny corpus " * 5)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hello \xff\xfe world" * 50)
    for path, msg in [(empty, ""), (short, "fewer than one training sequence"), (bad, "UTF-8")]:
        out = tmp_path / f"out-{path.stem}"
        assert main(["train", *TINY, "--data", str(path), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and msg in err and "\n" not in err, err
        assert not out.exists()


def test_checkpoint_errors(trained, tmp_path, capsys):
    import shutil

    corrupt = tmp_path / "corrupt"
    shutil.copytree(trained, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    assert main(["eval", "--checkpoint", str(corrupt), "--quiet"]) == 2
    assert "corrupt" in capsys.readouterr().err

    mismatch = tmp_path / "mismatch"
    shutil.copytree(trained, mismatch)
    from fastweights.data import build_tokenizer

    build_tokenizer("byte").save(mismatch)  # 256 symbols, the model has 66
    assert main(["eval", "--checkpoint", str(mismatch), "--quiet"]) == 2
    assert "tokenizer" in capsys.readouterr().err


def test_tensorboard_log_has_the_jsonl_scalars(tmp_path):
    pytest.importorskip("tensorboard")  # in the [dev] extra, so CI runs this
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    assert main(["train", *TINY, "--out", str(out), "--log", "tensorboard", "--set", "train.max_steps=4",
                 "--set", "train.eval_every=2", "--set", "train.log_every=1"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "val_loss"} <= tags, tags
    for tag in ("loss", "val_loss"):
        logged = [(r["step"], r[tag]) for r in records if tag in r]
        written = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in written] == [s for s, _ in logged]
        assert [v for _, v in written] == pytest.approx([v for _, v in logged], rel=1e-6)


def test_tensorboard_missing_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard") or name.startswith("tensorboard"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    out = tmp_path / "tb"
    assert main(["train", *TINY, "--out", str(out), "--log", "tensorboard"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install tensorboard" in err and "\n" not in err
    assert not out.exists()


def test_cpu_clock_budget_counts_this_process_only(tmp_path):
    out = tmp_path / "cpu"
    # 3 CPU-seconds of budget: it stops early, and the elapsed time it reports is CPU time, the final validation
    # and save inside the budget (tests/cli/test_time_budget.py holds the margin on a fake clock)
    assert main(["train", *TINY, "--out", str(out), "--set", "train.budget_clock=cpu",
                 "--set", "train.max_minutes=0.05", "--set", "train.max_steps=100000",
                 "--set", "train.eval_every=0"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["stopped_by_time_budget"] and s["budget_clock"] == "cpu" and s["budget_s"] == 3.0
    assert 0 < s["steps"] < 100000 and 0 < s["elapsed_s"] <= 3.0 + 0.5


def test_the_progress_of_a_cpu_budget_counts_cpu_time(tmp_path, capsys):
    """train.budget_clock=cpu: the progress line's clock is the budget's (labelled cpu), so its ETA is in the
    budget's seconds. Mutation caught (issue 49, seed 9): the bar left on wall time."""
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path / "cpu"), "--set", "train.budget_clock=cpu",
                 "--set", "train.max_minutes=0.02", "--set", "train.max_steps=100000",
                 "--set", "train.eval_every=0"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train |") and "steps" in line]
    assert lines and all(" cpu " in line and "elapsed" not in line for line in lines), lines


# ----------------------------------------------------------------------------- the command tree and its floor


def test_help_lists_at_most_twelve_commands_by_job(capsys):
    from fastweights.cli import JOBS, build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    names = [n for _, group in JOBS for n in group]
    assert len(names) <= 12 and len(set(names)) == len(names)
    for heading, group in JOBS:
        assert f"\n{heading}:\n" in out
        for name in group:  # one line each
            assert len([line for line in out.splitlines() if line.startswith(f"  {name} ")]) == 1, name


@pytest.mark.parametrize("group, commands", [("dynamic", ["eval", "tune", "stats", "timescale", "generate"]),
                                             ("task", ["assoc", "ba-retrieval", "niah"]),
                                             ("inspect", ["compare", "addressing", "gates"]), ("data", ["list"])])
def test_groups_hold_their_commands(group, commands):
    from fastweights.cli import build_parser

    for name in commands:
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([group, name, "--help"])
        assert e.value.code == 0


def test_stream_options_need_stream(trained, capsys):
    assert main(["eval", "--checkpoint", str(trained), "--modes", "carry"]) == 2
    assert "--modes applies to --stream" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(trained), "--checkpoint", str(trained)]) == 2
    assert "need --stream" in capsys.readouterr().err


def test_nothing_outside_cli_imports_it_or_argparse():
    """The command line is the top floor: library code takes settings, never a parsed namespace."""
    import ast

    src = PACKAGE
    found = []
    for path in src.rglob("*.py"):
        rel = path.relative_to(src)
        if rel.parts[0] == "cli" or rel.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            names += [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else []
            found += [f"{rel}: {n}" for n in names
                      if n == "argparse" or n.startswith("fastweights.cli") or n.endswith("SimpleNamespace")]
    assert not found, found


def test_eval_metrics_are_named_by_the_tokenizers_unit():
    """A byte-level model's score is in bits per byte (no characters counted, as from a prepared split), a char
    model's in bits per char; both name the checkpoint and data (the tokenizer's name decides the key)."""
    import types

    from fastweights.cli.eval import _checked_metrics
    from fastweights.loops.evaluate import EvalResult

    for name, key in (("byte", "bits_per_byte"), ("char", "bits_per_char")):
        m = _checked_metrics(EvalResult(8 * math.log(2), 4), types.SimpleNamespace(name=name, vocab_size=256),
                             "ck", "d")
        assert m[key] == pytest.approx(2.0) and (m["checkpoint"], m["data"]) == ("ck", "d")
