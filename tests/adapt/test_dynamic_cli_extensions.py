"""The command line of the issue 18 extensions: --lr-schedule, --lowrank-rank / --lowrank-params (with their
gradient statistics) and dynamic eval --cache-on-dynamic, on conftest's tiny char-level ``char_checkpoint``."""

import json

import pytest

from fastweights.cli import main
SGD = ["--rule", "sgd", "--lr", "0.5", "--segment-len", "10", "--json", "--quiet"]


def run_json(capsys, *argv):
    assert main(list(argv)) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def error_line(capsys, *argv):
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def two_docs(char_checkpoint):
    d = char_checkpoint / "two_docs"
    d.mkdir()
    (d / "a.txt").write_text("the cat sat on the log. the dog sat on the mat. " * 3)
    (d / "b.txt").write_text("the dog sat on the cat. " * 4)
    return d


def test_lr_schedule(char_checkpoint, capsys):
    base = ["dynamic", "eval", "--checkpoint", str(char_checkpoint), "--data", str(char_checkpoint / "doc.txt"), *SGD]
    default = run_json(capsys, *base)
    constant = run_json(capsys, *base, "--lr-schedule", "constant")
    warmup = run_json(capsys, *base, "--lr-schedule", "warmup:4")
    assert constant["dynamic"]["nll"] == default["dynamic"]["nll"]  # constant is the unscheduled update, exactly
    assert warmup["dynamic"]["nll"] != constant["dynamic"]["nll"]
    assert warmup["static"] == constant["static"]
    assert "lr_schedule" not in constant["settings"] and warmup["settings"]["lr_schedule"] == "warmup:4"


@pytest.mark.parametrize("command", ["eval", "tune", "timescale", "generate"])
def test_bad_lr_schedule_is_one_line_exit_2(char_checkpoint, command, capsys):
    err = error_line(capsys, "dynamic", command, "--checkpoint", str(char_checkpoint), "--rule", "sgd", "--lr-schedule", "cosine:3")
    assert "--lr-schedule" in err and "warmup:W" in err


def test_tuned_file_records_the_schedule(char_checkpoint, tmp_path, capsys):
    ck, doc, tuned = str(char_checkpoint), str(char_checkpoint / "doc.txt"), str(tmp_path / "tuned.json")
    assert main(["dynamic", "tune", "--checkpoint", ck, "--data", doc, "--rule", "sgd", "--segment-len", "10", "--lrs",
                 "0.1,0.5", "--lr-schedule", "rsqrt:2", "--save", tuned, "--quiet"]) == 0
    capsys.readouterr()
    base = ["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--rule", "sgd", "--segment-len", "10", "--tuned", tuned]
    assert "lr_schedule rsqrt:2 (this run: constant)" in error_line(capsys, *base)  # tuned for another schedule
    m = run_json(capsys, *base, "--lr-schedule", "rsqrt:2", "--json", "--quiet")
    assert m["settings"]["lr_schedule"] == "rsqrt:2" and m["settings"]["lr_source"] == f"tuned file {tuned}"


def test_reset_never_carries_the_schedule(char_checkpoint, two_docs, capsys):
    from fastweights.adapt.setup import encode_texts, load_texts
    from fastweights.adapt.dynamic import DynamicEvaluator
    from fastweights.models.loading import load_checkpoint

    m = run_json(capsys, "dynamic", "eval", "--checkpoint", str(char_checkpoint), "--data", str(two_docs), *SGD,
                 "--lr-schedule", "warmup:6", "--reset", "never", "--cache-on-dynamic", "--cache-mix", "0")
    model, tok, cfg = load_checkpoint(char_checkpoint)
    docs, _ = encode_texts(tok, load_texts(str(two_docs), cfg, "test"))
    ev = DynamicEvaluator(model, rule="sgd", lr=0.5, segment_len=10, context=32, lr_schedule="warmup:6")
    assert m["dynamic"]["nll"] == pytest.approx(ev.evaluate_documents(docs, reset="never").nll, rel=1e-9)
    # mix 0, carried the same way; to rounding: the mixture scores -log(exp(log p)), whose last bits depend on the
    # CPU kernels (exact on AVX-512, 7e-9 apart with ATEN_CPU_CAPABILITY=avx2 on an Intel Xeon)
    assert m["dynamic_cache"]["nll"] == pytest.approx(m["dynamic"]["nll"], rel=1e-7)


def test_lowrank(char_checkpoint, capsys):
    base = ["dynamic", "eval", "--checkpoint", str(char_checkpoint), "--data", str(char_checkpoint / "doc.txt"), *SGD,
            "--lowrank-rank", "2"]
    m = run_json(capsys, *base)
    s = m["settings"]
    assert (s["lowrank_rank"], s["lowrank_modules"], s["lowrank_seed"]) == (2, "*mlp.*", 0)
    assert s["lowrank_projections"] == 4 and m["dynamic"]["nll"] != m["static"]["nll"]
    zero = run_json(capsys, *base, "--lr", "0")
    assert zero["dynamic"]["nll"] == zero["static"]["nll"]  # A starts at zero: the static model exactly
    one = run_json(capsys, *base, "--lowrank-params", "*mlp.down*")
    assert one["settings"]["lowrank_projections"] == 2 and one["settings"]["lowrank_modules"] == "*mlp.down*"
    full = run_json(capsys, *base[:-2])
    assert not any(k.startswith("lowrank") for k in full["settings"])  # settings a run does not use are left out


@pytest.mark.parametrize("extra, message", [
    (["--lowrank-rank", "2", "--sparse-units", "4"], "exclude each other"),
    (["--lowrank-params", "*mlp.*"], "needs --lowrank-rank"),
    (["--lowrank-rank", "2", "--params", "blocks.1.*"], "--lowrank-params"),
])
def test_lowrank_conflicts(char_checkpoint, extra, message, capsys):
    for command in ("eval", "stats"):
        argv = ["dynamic", command, "--checkpoint", str(char_checkpoint), *extra]
        assert message in error_line(capsys, *(argv + ["--rule", "sgd"] if command == "eval" else argv))


def test_lowrank_gradient_statistics(char_checkpoint, tmp_path, capsys):
    from fastweights.adapt.grad_stats import GradStats

    ck, doc = str(char_checkpoint), str(char_checkpoint / "doc.txt")
    small = ["--max-batches", "2", "--batch-size", "2", "--segment-len", "10", "--quiet"]
    assert main(["dynamic", "stats", "--checkpoint", ck, "--lowrank-rank", "2", *small]) == 0
    assert "grad_stats_lowrank_r2.safetensors" in capsys.readouterr().out
    stats = GradStats.load(char_checkpoint / "grad_stats_lowrank_r2.safetensors")
    assert stats.extra["lowrank_rank"] == 2 and all(n.startswith("lowrank.") for n in stats.ms)
    base = ["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--rule", "rms", "--lr", "1e-3", "--segment-len", "10",
            "--json", "--quiet"]
    m = run_json(capsys, *base, "--lowrank-rank", "2")  # the checkpoint's low-rank statistics, by default
    assert m["settings"]["grad_stats"]["lowrank_rank"] == 2 and m["settings"]["grad_stats"]["batches"] == 2
    full = tmp_path / "full.safetensors"
    assert main(["dynamic", "stats", "--checkpoint", ck, "--save", str(full), *small]) == 0
    lowrank = str(char_checkpoint / "grad_stats_lowrank_r2.safetensors")
    err = error_line(capsys, *base, "--lowrank-rank", "2", "--stats", str(full))
    assert "full-weight statistics" in err and "needs low-rank statistics (rank 2" in err and "--lowrank-rank 2" in err
    assert "rank 2" in error_line(capsys, *base, "--lowrank-rank", "3", "--stats", lowrank)
    assert "needs full-weight statistics" in error_line(capsys, *base, "--stats", lowrank)
    assert "projections '*mlp.*'" in error_line(capsys, *base, "--lowrank-rank", "2", "--lowrank-params", "*down*",
                                                "--stats", lowrank)
    # missing statistics of our own checkpoint: collected on its training split and kept for the next run
    m = run_json(capsys, *base, "--lowrank-rank", "3", "--lowrank-params", "*down*")
    assert m["settings"]["grad_stats"]["lowrank_modules"] == "*down*"
    assert len(list(char_checkpoint.glob("grad_stats_lowrank_r3_*.safetensors"))) == 1


def test_cache_on_dynamic_and_per_token(char_checkpoint, two_docs, tmp_path, capsys):
    ck = str(char_checkpoint)
    base = ["dynamic", "eval", "--checkpoint", ck, "--data", str(two_docs), *SGD, "--cache-window", "50"]
    plain = run_json(capsys, *base)
    assert "dynamic_cache" not in plain and "cache" not in plain
    m = run_json(capsys, *base, "--cache-on-dynamic", "--cache", "--cache-mix", "0.3")
    assert m["dynamic"] == plain["dynamic"] and {"static", "dynamic", "cache", "dynamic_cache"} <= set(m)
    row = m["dynamic_cache"]
    assert row["settings"]["mix"] == 0.3 and row["settings"]["window"] == 50 and row["nll"] != m["dynamic"]["nll"]
    assert row["tokens"] == m["dynamic"]["tokens"]
    zero = run_json(capsys, *base, "--cache-on-dynamic", "--cache-mix", "0")
    assert zero["dynamic_cache"]["nll"] == zero["dynamic"]["nll"]  # mix 0: plain dynamic evaluation
    # --per-token: each row's losses sum to that row's total NLL, also with several documents at once
    path = tmp_path / "losses.json"
    m = run_json(capsys, *base, "--cache-on-dynamic", "--batch-docs", "2", "--per-token", str(path))
    rec = json.loads(path.read_text())
    assert len(rec["documents"]) == m["documents"] == 2
    for row, total in (("static", "static_nll"), ("dynamic", "dynamic_nll"), ("dynamic_cache", "dynamic_cache_nll")):
        assert sum(sum(d[row]) for d in rec["documents"]) == pytest.approx(m[row]["nll"], rel=1e-6)
        assert rec[total] == pytest.approx(m[row]["nll"], rel=1e-6)
        assert all(len(d[row]) == d["tokens"] for d in rec["documents"])
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", str(two_docs), "--rule", "sgd", "--lr", "0.5",
                 "--cache-on-dynamic", "--lr-schedule", "warmup:2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "schedule warmup:2" in out and "  dynamic+cache: bits_per_char" in out


def test_lowrank_timescale_and_generate(char_checkpoint, tmp_path, capsys):
    ck, doc = str(char_checkpoint), str(char_checkpoint / "doc.txt")
    flags = ["--rule", "sgd", "--lr", "0.5", "--lowrank-rank", "2", "--lr-schedule", "rsqrt:3", "--quiet"]
    out = tmp_path / "ts"
    assert main(["dynamic", "timescale", "--checkpoint", ck, "--data", doc, "--doc-len", "60", "--window", "20",
                 "--out", str(out), *flags]) == 0
    s = json.loads((out / "timescale.json").read_text())["settings"]
    assert s["lowrank_rank"] == 2 and s["lr_schedule"] == "rsqrt:3"
    assert main(["dynamic", "generate", "--checkpoint", ck, "--prompt", "the cat ", "--max-tokens", "12", *flags]) == 0
    assert "== dynamic" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [[], ["--lowrank-rank", "2"], ["--sparse-units", "4"]],
                         ids=["full", "lowrank", "sparse"])
def test_eps_reaches_the_update_rule_through_the_settings(char_checkpoint, extra):
    """A non-default eps travels DynamicSettings -> resolve_setup -> evaluator_from -> the update rule, for every
    kind of adaptation, and the result records it. Mutation caught (issue 39): eps not passed on by the settings
    (the default used instead)."""
    from fastweights.adapt.setup import DynamicSettings, build_evaluator
    from fastweights.adapt.update_rules import DEFAULT_EPS
    from fastweights.auto.sources import load_model_and_tokenizer
    from fastweights.cli import build_parser
    from fastweights.cli.dynamic import dynamic_settings

    args = build_parser().parse_args(["dynamic", "eval", "--checkpoint", str(char_checkpoint), "--rule", "rms",
                                      "--eps", "0.125", *extra])
    settings = dynamic_settings(args)
    assert settings.eps == 0.125 != DEFAULT_EPS
    settings = DynamicSettings(**{**settings.__dict__, "stats_batches": 1})
    model, tok, cfg, ckpt = load_model_and_tokenizer(char_checkpoint, device="cpu")
    ev, _ = build_evaluator(settings, model, tok, cfg, ckpt)
    assert ev.update_rule.eps == 0.125 and ev.metadata()["eps"] == 0.125
    ev, info = build_evaluator(settings, model, tok, cfg, ckpt, lr=0.03, decay=0.0625)  # given here: they win
    assert (ev.update_rule.lr, ev.update_rule.decay) == (0.03, 0.0625)


def test_a_lowrank_rank_beyond_the_models_dimensions_is_refused_before_allocating(char_checkpoint, capsys):
    """--lowrank-rank above min(in, out) of every adapted projection adds nothing: one line, exit 2, before the fixed
    factors [rank, in] are allocated (issue 39: 10^8 tried 25.6 GB and ended in a RuntimeError traceback)."""
    err = error_line(capsys, "dynamic", "eval", "--checkpoint", str(char_checkpoint), "--data",
                     str(char_checkpoint / "doc.txt"), "--lowrank-rank", "100000000", *SGD)
    assert "--lowrank-rank 100000000 exceeds the model's dimensions" in err and "choose 1..16" in err
    run_json(capsys, "dynamic", "eval", "--checkpoint", str(char_checkpoint), "--data", str(char_checkpoint / "doc.txt"),
             "--lowrank-rank", "16", *SGD)


def test_the_sparse_block_is_the_one_asked_for(char_checkpoint, capsys):
    """``--sparse-layer`` reaches the evaluator (without it: the middle block). Mutation caught: the layer not
    handed on, which left every run on the default block."""
    base = ["dynamic", "eval", "--checkpoint", str(char_checkpoint), "--data", str(char_checkpoint / "doc.txt"), *SGD,
            "--sparse-units", "4"]
    assert run_json(capsys, *base)["settings"]["sparse_layer"] == 1  # two blocks: the middle one is block 1
    assert run_json(capsys, *base, "--sparse-layer", "0")["settings"]["sparse_layer"] == 0


@pytest.mark.parametrize("flag, pattern", [("--params", "blocks.0.*"), ("--exclude-params", "blocks.0.*")])
def test_the_parameters_chosen_on_the_command_line_are_the_ones_adapted(char_checkpoint, flag, pattern):
    """``--params`` / ``--exclude-params`` travel DynamicSettings -> resolve_setup -> evaluator_from: the evaluator
    adapts exactly the weights the pattern selects (or leaves out). Mutation caught (issue 49, seed 7): the
    resolved setup dropping ``params`` (every weight adapted)."""
    import fnmatch

    from fastweights.adapt.setup import build_evaluator
    from fastweights.auto.sources import load_model_and_tokenizer
    from fastweights.cli import build_parser
    from fastweights.cli.dynamic import dynamic_settings

    args = build_parser().parse_args(["dynamic", "eval", "--checkpoint", str(char_checkpoint), *SGD, flag, pattern])
    model, tok, cfg, ckpt = load_model_and_tokenizer(char_checkpoint, device="cpu")
    ev, _ = build_evaluator(dynamic_settings(args), model, tok, cfg, ckpt)
    everything = {n for n, p in model.named_parameters() if p.requires_grad}
    chosen = {n for n in everything if fnmatch.fnmatch(n, pattern)}
    assert chosen and chosen != everything
    assert set(ev.params) == (chosen if flag == "--params" else everything - chosen)


def test_settings_without_a_schedule_resolve_to_the_constant_one(char_checkpoint):
    """A caller's DynamicSettings with no schedule (None, as a harness may pass) is the constant schedule, by its
    canonical name. Mutation caught (issue 49, seed 9): the fallback's name in capitals."""
    from dataclasses import replace

    from fastweights.adapt.setup import DynamicSettings, resolve_setup
    from fastweights.auto.sources import load_model_and_tokenizer

    model, tok, cfg, ckpt = load_model_and_tokenizer(char_checkpoint, device="cpu")
    settings = replace(DynamicSettings(), rule="sgd", lr=0.5, lr_schedule=None)
    setup = resolve_setup(settings, model, tok, cfg, ckpt)
    assert setup.lr_schedule == "constant" and setup.schedule_name is None


def test_building_an_evaluator_shows_the_statistics_progress_only_when_asked(tiny_run, capsys):
    """``build_evaluator(progress=...)`` passes the flag on to the collection of gradient statistics it runs (the
    longest part of a first RMS evaluation): a line with its total and rate when asked, silence otherwise."""
    from fastweights.adapt.setup import DynamicSettings, build_evaluator
    from fastweights.models.loading import load_checkpoint

    model, tok, cfg = load_checkpoint(tiny_run)
    settings = DynamicSettings(rule="rms", lr=1e-4, stats_batches=2, stats_batch_size=2)
    build_evaluator(settings, model, tok, cfg, None, progress=False)
    assert "gradient statistics (MS_g)" not in capsys.readouterr().err  # (the one line saying where they come from)
    build_evaluator(settings, model, tok, cfg, None, progress=True)
    assert "gradient statistics (MS_g)" in capsys.readouterr().err
