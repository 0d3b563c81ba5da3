"""The FWL on a pretrained model through the command line (issue 31): `fwl-head train` on a tiny offline Llama
with the bundled GPT-2 tokenizer, then `eval`, `generate`, `dynamic eval` (with --checkpoint, and with --hf on the
directory `fwl-head export` wrote) accept the checkpoint and give the numbers the model gives in Python."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from fastweights import cli  # noqa: E402
from fastweights.adapt.dynamic import DynamicEvaluator  # noqa: E402
from fastweights.hf.fwl_cache import CACHE_META  # noqa: E402
from fastweights.hf.fwl_head import load_fwl_head  # noqa: E402
from fastweights.hf.fwl_training import RECIPE, TRAINING_MIX  # noqa: E402
from fastweights.layers.fwl import FWLOptions  # noqa: E402
from fastweights.loops.evaluate import SCORING_SEGMENT_LEN  # noqa: E402
from helpers import json_shape, stderr_text, tiny_llama_dir  # noqa: E402

TEXT = ("Happy families are all alike; every unhappy family is unhappy in its own way. Everything was in "
        "confusion in the house. The wife had discovered that the husband was carrying on an intrigue. ") * 3


@pytest.fixture(scope="module")
def backbone_dir(tmp_path_factory):
    """A tiny Llama (vocabulary of the bundled GPT-2 tokenizer) saved as a local model directory."""
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def trained(backbone_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fwl") / "run"
    assert cli.main(["fwl-head", "train", "--hf", str(backbone_dir), "--out", str(out), "--windows", "6",
                     "--minutes", "0.02", "--quiet"]) == 0
    return out


def test_train_writes_a_checkpoint_and_its_summary(trained):
    summary = json.loads((trained / "training.json").read_text())
    assert summary["steps"] >= 1 and summary["variant"] == "fwl" and summary["validation"]["windows"] == 4
    assert set(summary["training_sources"]) <= set(TRAINING_MIX) and summary["data"] == "mix:" + "+".join(TRAINING_MIX)
    assert (trained / "checkpoint.json").is_file()


def test_the_training_summary_and_the_cache_description_have_their_documented_shape(trained):
    """training.json and the hidden-state cache's cache.json, key by key and type by type (what a user's script
    reads, and what a resumed run checks against): a key renamed or dropped fails here."""
    summary = json.loads((trained / "training.json").read_text())
    options = json_shape(summary["options"])  # the head's options as built: every field of FWLOptions, a value each
    assert list(options) == [f.name for f in dataclasses.fields(FWLOptions)] and "NoneType" not in options.values()
    assert json_shape(summary) == {
        "steps": "int", "cpu_s": "float", "batch_size": "int", "lr": "float", "step_lr": "float", "block_lr": "float",
        "window": "int", "trainable_blocks": "int", "train_windows": "int", "train_documents": "int",
        "tokens_seen": "int",
        "history": [{"step": "int", "cpu_s": "float", "loss_nats": "float", "static_nats": "float",
                     "gain_nats": "float", "windows": ["int"]}],
        "validation": {"loss_nats": "float", "static_nats": "float", "gain_nats": "float", "windows": "int",
                       "update": "str"},
        "hf": "str", "variant": "str", "options": options, "cache_dir": "str", "data": "str", "cache_windows": "int",
        "doc_windows": "int", "cache_windows_computed": "int", "cache_cpu_s_this_call": "float",
        "training_sources": ["str"], "torch_threads": "int"}
    cache = json.loads((Path(summary["cache_dir"]) / CACHE_META).read_text())
    assert json_shape(cache) == {
        "tokens_sha": "str", "data": "str", "window": "int", "doc_windows": ["int"], "trainable_blocks": "int",
        "backbone": "str", "dtype": "str", "windows": "int", "d_model": "int", "done": "int",
        "static_nats": ["float"], "sources": ["str"]}
    assert json_shape(json.loads((trained / "fwl_head.json").read_text())) == {
        "format": "str", "version": "int", "backbone": "str", "backbone_fingerprint": "str",
        "trainable_blocks": "int", "fwl": options}


def test_the_flags_defaults_are_the_recipes():
    """Nothing given: every training setting the command hands the library is RECIPE's. Mutation caught: a flag
    with its own default (or a setting not passed on: the summary test above would then differ)."""
    args = cli.build_parser().parse_args(["fwl-head", "train", "--out", "x"])
    assert (args.windows, args.window, args.doc_windows, 60 * args.minutes, args.streams, args.lr, args.step_lr,
            args.block_lr, args.trainable_blocks, args.seed, args.variant, args.data) == \
        (RECIPE.windows, RECIPE.window, RECIPE.doc_windows, RECIPE.budget_cpu_s, RECIPE.batch_size, RECIPE.lr,
         RECIPE.step_lr, RECIPE.block_lr, RECIPE.trainable_blocks, RECIPE.seed, RECIPE.variant, None)
    assert args.max_steps == 0  # no step limit: the CPU budget alone ends the recipe's training


def test_eval_generate_and_dynamic_eval_take_the_checkpoint(trained, tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    model, tok = load_fwl_head(trained)
    ids = torch.as_tensor(tok.encode(TEXT))
    want = DynamicEvaluator(model, rule="sgd", lr=0.0, segment_len=SCORING_SEGMENT_LEN, context=model.default_context).static(ids)
    capsys.readouterr()
    assert cli.main(["eval", "--checkpoint", str(trained), "--data", str(data), "--json", "--quiet"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["perplexity"] == pytest.approx(math.exp(want.loss), rel=1e-9)
    assert got["checkpoint"] == str(trained) and got["data"] == str(data)  # what was scored, named
    assert cli.main(["generate", "--checkpoint", str(trained), "--prompt", "Happy families", "--max-tokens", "6",
                     "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("Happy families") and len(text) > len("Happy families\n")
    assert cli.main(["dynamic", "eval", "--checkpoint", str(trained), "--data", str(data), "--rule", "sgd",
                     "--lr", "1e-3", "--json", "--quiet"]) == 0
    res = json.loads(capsys.readouterr().out)
    # fp32 scores summed in another order (the command's own segments): ~1e-6 nats apart on some CPU kernels
    # (ATEN_CPU_CAPABILITY=default), so the losses, not the perplexities near 5e4, are compared
    assert math.log(res["static"]["perplexity"]) == pytest.approx(want.loss, abs=1e-5)
    # the exported directory: the same model for dynamic eval --hf
    export = tmp_path / "hf"
    assert cli.main(["fwl-head", "export", "--checkpoint", str(trained), "--out", str(export)]) == 0
    said = capsys.readouterr().out  # a sentence, as export-hf says (issue 49: it printed JSON)
    assert said.startswith(f"exported {trained} -> {export} (backbone llama; ") and "config.json" in said
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(export).padding_side == "left"  # as export-hf's (issue 49: it padded right)
    written = (export / "tokenizer_config.json").read_text()  # rewritten as transformers writes it: indented
    assert written == json.dumps(json.loads(written), indent=2)
    assert cli.main(["dynamic", "eval", "--hf", str(export), "--data", str(data), "--rule", "sgd", "--lr", "1e-3",
                     "--json", "--quiet"]) == 0
    again = json.loads(capsys.readouterr().out)
    for kind in ("static", "dynamic"):
        assert math.log(again[kind]["perplexity"]) == pytest.approx(math.log(res[kind]["perplexity"]), abs=1e-5)
    # a head on a model that has one: refused in one line that says which kind of directory it was given
    assert cli.main(["fwl-head", "train", "--hf", str(export), "--out", str(tmp_path / "again"), "--quiet"]) == 2
    assert f"fwl-head train --hf {export}: already has an FWL head (a `fwl-head export` directory)" in \
        capsys.readouterr().err


def test_bad_input_is_one_line(trained, tmp_path, capsys):
    assert cli.main(["eval", "--checkpoint", str(trained)]) == 2
    assert "--data is required" in stderr_text(capsys)
    assert cli.main(["fwl-head", "export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "not a checkpoint written by" in stderr_text(capsys)
    (tmp_path / "a-file").write_text("mine\n")  # issue 49: NotADirectoryError's traceback
    assert cli.main(["fwl-head", "export", "--checkpoint", str(trained), "--out", str(tmp_path / "a-file")]) == 2
    assert "is a file; name a folder" in stderr_text(capsys) and (tmp_path / "a-file").read_text() == "mine\n"
    assert cli.main(["fwl-head", "train", "--out", str(tmp_path / "r"), "--variant", "other"]) == 2


def test_every_training_flag_is_passed_on(monkeypatch, capsys):
    """Mutation caught: a flag parsed but not handed to the library (its default used instead)."""
    from fastweights.hf import fwl_training

    seen = {}

    def fake(hf, out, **kw):
        seen.update(kw)
        return {"steps": 0, "cpu_s": 0.0, "validation": {"loss_nats": 1.0, "static_nats": 1.0, "gain_nats": 0.0, "update": "on"}}

    monkeypatch.setattr(fwl_training, "train_recipe", fake)
    assert cli.main(["fwl-head", "train", "--out", "x", "--data", "novels", "--doc-windows", "5", "--streams", "3",
                     "--step-lr", "0.02", "--lr", "0.004", "--block-lr", "3e-6", "--trainable-blocks", "2", "--windows", "11", "--window",
                     "256", "--minutes", "2", "--seed", "7", "--max-steps", "9", "--quiet"]) == 0
    assert {k: seen[k] for k in ("data", "doc_windows", "batch_size", "step_lr", "lr", "block_lr", "trainable_blocks", "windows",
                                 "window", "budget_cpu_s", "seed", "max_steps")} == {
        "data": "novels", "doc_windows": 5, "batch_size": 3, "step_lr": 0.02, "lr": 0.004, "block_lr": 3e-6, "trainable_blocks": 2,
        "windows": 11, "window": 256, "budget_cpu_s": 120.0, "seed": 7, "max_steps": 9}
    assert "gain +0.0000" in capsys.readouterr().out


@pytest.mark.parametrize("update, said", [("off", True), ("on", False)])
def test_the_line_says_when_the_held_out_loss_is_a_test_time_only_heads_slow_logits(monkeypatch, capsys, update,
                                                                                    said):
    """Mutation caught: the note dropped or given for every head."""
    from fastweights.hf import fwl_training

    monkeypatch.setattr(fwl_training, "train_recipe", lambda hf, out, **kw: {
        "steps": 1, "cpu_s": 1.0, "validation": {"loss_nats": 1.0, "static_nats": 1.0, "gain_nats": 0.0,
                                                 "update": update}})
    assert cli.main(["fwl-head", "train", "--out", "x", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert ("nats/token with the head (its slow logits: a test-time-only head's step is tuned where it scores)"
            in out) is said
    assert "nats/token with the head" in out


def test_a_link_planted_at_the_default_cache_is_refused(backbone_dir, tmp_path, capsys):
    """Issue 52: the default cache (hidden-cache beside --out, a path the user never named) followed a planted
    link, deleted the target's hidden.npy and wrote the cache into the target folder."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "hidden.npy").write_bytes(b"someone else's")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "hidden-cache").symlink_to(target)
    assert cli.main(["fwl-head", "train", "--hf", str(backbone_dir), "--out", str(tmp_path / "runs" / "fwl"),
                     "--windows", "6", "--minutes", "0.02", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {tmp_path / 'runs' / 'hidden-cache'} is a symbolic link; refusing to write the shared "
                   "hidden-state cache through it (remove the link)")
    assert sorted(p.name for p in target.iterdir()) == ["hidden.npy"]
    assert (target / "hidden.npy").read_bytes() == b"someone else's"


def test_a_one_token_window_is_refused_before_any_cache_is_written(backbone_dir, tmp_path, capsys):
    """Issue 52: --window 1 wrote a shared cache that every later run refused until it was deleted by hand."""
    assert cli.main(["fwl-head", "train", "--hf", str(backbone_dir), "--out", str(tmp_path / "runs" / "fwl"),
                     "--window", "1", "--windows", "6", "--minutes", "0.02", "--quiet"]) == 2
    assert "at least 2 tokens" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "hidden-cache").exists()
    # two tokens are the least a window can be: one prediction (the boundary is 2, not 3)
    assert cli.main(["fwl-head", "train", "--hf", str(backbone_dir), "--out", str(tmp_path / "runs" / "fwl"),
                     "--window", "2", "--windows", "6", "--max-steps", "1", "--quiet"]) == 0


def test_a_second_run_on_the_same_out_is_refused_while_the_first_holds_it(backbone_dir, tmp_path, capsys):
    """Issue 52: two fwl-head train runs on one --out both exited 0 and one result was lost."""
    from fastweights.checkpoints.run_dir import LOCK, RunLock

    out = tmp_path / "runs" / "fwl"
    args = ["fwl-head", "train", "--hf", str(backbone_dir), "--out", str(out), "--windows", "6", "--minutes", "0.02",
            "--quiet"]
    with RunLock(out):  # the first run, still going
        assert cli.main(args) == 2
        assert "in use by another training run" in capsys.readouterr().err
    assert cli.main(args) == 0  # once it ended
    assert not (out / LOCK).exists() and not (tmp_path / "runs" / "hidden-cache" / LOCK).exists()


def test_a_head_loads_from_anywhere_and_never_onto_a_changed_backbone(backbone_dir, tmp_path, monkeypatch):
    """Issue 52: a head pinned its backbone by the path as typed (a relative --hf broke from another folder) and by
    its output layer only (a backbone changed in any other weight loaded silently)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from fastweights.core.errors import UserError
    from fastweights.hf.fwl_head import load_fwl_head

    shutil.copytree(backbone_dir, tmp_path / "llama")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["fwl-head", "train", "--hf", "llama", "--out", "runs/fwl", "--windows", "6", "--minutes", "0.02",
                     "--quiet"]) == 0
    monkeypatch.chdir(tmp_path / "runs")  # another folder: the relative name would not resolve
    load_fwl_head(tmp_path / "runs" / "fwl")
    path = next((tmp_path / "llama").glob("*.safetensors"))
    tensors = load_file(str(path))
    name = next(k for k in sorted(tensors) if "self_attn.q_proj" in k)
    tensors[name] = tensors[name] * 1.001
    save_file(tensors, str(path))
    with pytest.raises(UserError, match="another backbone"):
        load_fwl_head(tmp_path / "runs" / "fwl")


def test_train_says_what_it_trains_on_and_uses_one_long_file_beyond_its_first_windows(backbone_dir, tmp_path, capsys,
                                                                                      monkeypatch):
    """Issue 49: ``--data`` one file trained on 4 windows and said nothing. Now the file gives stream after stream and
    the command names the windows, tokens and streams before it caches; on a busy machine it says at the start that
    its CPU-minute budget takes longer (here the recipe's budget, with two stand-in busy cores of two)."""
    import fastweights.core.threads as threads_module

    monkeypatch.setattr(threads_module, "busy_cores", lambda sample_s=0.0: 2.0)
    monkeypatch.setattr(threads_module, "usable_cores", lambda: 2)
    data = tmp_path / "book.txt"
    data.write_text(TEXT * 40)
    out = tmp_path / "run"
    assert cli.main(["fwl-head", "train", "--hf", str(backbone_dir), "--out", str(out), "--data", str(data),
                     "--window", "256", "--windows", "6", "--doc-windows", "2", "--max-steps", "1"]) == 0
    err = capsys.readouterr().err
    assert "training text: 6 windows of 256 tokens (1,536 tokens, the last 4 held out) in 3 streams of at most 2 " \
           f"windows from 1 document(s) of {data}" in err
    assert f"other work keeps 2.0 of this machine's 2 cores busy: the budget of {RECIPE.budget_cpu_s / 60:,.1f} " \
           "CPU-minutes" in err
    summary = json.loads((out / "training.json").read_text())
    assert summary["cache_windows"] == 6 and (Path(summary["cache_dir"]) / CACHE_META).is_file()
    assert summary["doc_windows"] == 2  # the --doc-windows given, recorded


@pytest.mark.parametrize("cached", [6, 0])
def test_an_interrupt_while_caching_says_how_much_of_the_cache_is_kept(backbone_dir, tmp_path, monkeypatch, capsys,
                                                                       cached):
    """Ctrl-C while the hidden states are cached: one line saying how many windows the cache holds (the same command
    continues it) and that nothing was trained; 0 when it came before the cache's metadata was written (mutation
    caught, issue 49 seed 13: that count made 1)."""
    from fastweights.hf import fwl_training

    real = fwl_training.cache_hidden_states

    def cache_then_interrupt(*args, **kwargs):
        if cached:
            real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(fwl_training, "cache_hidden_states", cache_then_interrupt)
    out = tmp_path / "runs" / "fwl"
    assert cli.main(["fwl-head", "train", "--hf", str(backbone_dir), "--out", str(out), "--windows", "6", "--window",
                     "256", "--quiet"]) == 130
    err = stderr_text(capsys)
    assert (f"interrupted by SIGINT while caching hidden states: {tmp_path / 'runs' / 'hidden-cache'} holds {cached} "
            "of 6 windows and nothing was trained") in err


def test_the_progress_counts_each_cpu_second_of_training_once(backbone_dir, tmp_path, monkeypatch):
    """The bar of ``fwl-head train`` advances by the CPU seconds since its last update: its count ends at the run's
    training CPU time (a count that grew by the time so far at every step showed ETAs far too short)."""
    from fastweights.hf import fwl_training

    counted, made = [], []

    class Recorder:
        def __init__(self, *args, **kwargs):
            made.append((args, kwargs))

        def update(self, n, **kwargs):
            counted.append(n)

        def close(self):
            pass

    monkeypatch.setattr(fwl_training, "Progress", Recorder)
    out = tmp_path / "run"
    assert cli.main(["fwl-head", "train", "--hf", str(backbone_dir), "--out", str(out), "--windows", "6", "--window",
                     "256", "--max-steps", "2", "--quiet"]) == 0  # two steps: the first alone cannot tell
    history = json.loads((out / "training.json").read_text())["history"]
    assert len(counted) == len(history) >= 2 and all(n > 0 for n in counted)
    assert sum(counted) == pytest.approx(history[-1]["cpu_s"], abs=0.011)
    ((args, kwargs),) = made
    assert args[1:] == ("CPU-sec",) and kwargs["desc"] == "train fwl head"  # named as the docs show it
