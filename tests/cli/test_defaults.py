"""Defaults that help (issue 33, scopes 2-4): a loaded checkpoint is in eval mode, a change is printed with its
direction, --threads is on every command that runs a model and takes effect, and inspect addressing reads a
bounded default text and says which direction of each statistic is good."""

from __future__ import annotations

import argparse
import json

import torch

from fastweights.cli import build_parser, main
from fastweights.cli.common import change
from fastweights.core.threads import SCORING_THREADS


def test_load_checkpoint_returns_an_eval_mode_model(char_checkpoint):
    from fastweights.models.loading import load_checkpoint, load_model

    model, _, _ = load_checkpoint(char_checkpoint)
    assert not model.training and not any(m.training for m in model.modules())
    assert not load_model(char_checkpoint).training


def test_a_change_says_its_direction():
    assert change(0.9, 1.0) == "10.00% lower"
    assert change(1.0548, 1.0) == "5.48% higher (worse)"  # the "-5.48% lower"
    assert change(1.0, 1.0) == "no change"
    assert change(1.1, 1.0, "static") == "10.00% higher than static (worse)" and change(0.5, 1.0, "static") == "50.00% lower than static"


def test_dynamic_eval_prints_the_change_against_static(char_checkpoint, capsys):
    doc = str(char_checkpoint / "doc.txt")
    assert main(["dynamic", "eval", "--checkpoint", str(char_checkpoint), "--data", doc, "--rule", "sgd", "--lr", "0",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "dynamic: bits_per_char" in out and "(loss " in out and "no change from static" in out
    assert "% lower" not in out and ".py" not in out
    assert main(["eval", "--checkpoint", str(char_checkpoint), "--data", doc, "--dynamic", "sgd", "--lr", "0",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "dynamic (sgd, lr 0: command line)" in out and "(no change from static)" in out


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_command_that_runs_a_model_takes_threads():
    runs_a_model = [p for p in _parsers(build_parser())
                    if {"--checkpoint", "--hf", "--base"} & {o for a in p._actions for o in a.option_strings}
                    or p.prog.split()[-1] in ("demo", "assoc", "ba-retrieval", "train")]
    assert len(runs_a_model) >= 15
    for p in runs_a_model:
        threads = [a for a in p._actions if "--threads" in a.option_strings]
        assert threads, f"{p.prog} has no --threads"


def test_threads_default_and_effect(char_checkpoint, capsys, monkeypatch):
    args = build_parser().parse_args(["generate", "--checkpoint", str(char_checkpoint)])
    assert (args.threads, args.thread_work) == (0, "scoring")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # conftest sets it for subprocesses
    torch.set_num_threads(3)
    assert main(["generate", "--checkpoint", str(char_checkpoint), "--prompt", "the ", "--max-tokens", "2"]) == 0
    assert torch.get_num_threads() == SCORING_THREADS
    assert main(["generate", "--checkpoint", str(char_checkpoint), "--prompt", "the ", "--max-tokens", "2",
                 "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2
    capsys.readouterr()


def test_inspect_addressing_reads_the_validation_split_and_says_which_way_is_good(tmp_path, capsys):
    from fastweights.checkpoints.format import save_model
    from fastweights.core.config import RunConfig, TrainConfig, DataConfig
    from fastweights.data import CharTokenizer
    from helpers import tiny_lm

    corpus = "".join(f"line {i}: the cat sat on the mat.\n" for i in range(400))  # 12 kB; its val split is 5%
    (tmp_path / "corpus.txt").write_text(corpus)
    tok = CharTokenizer.from_text(corpus)
    model = tiny_lm(tok.vocab_size, memory="fwpkm", memory_layers=[1],
                    options={"fwpkm": dict(n_subkeys=6, d_key=8, d_value=8, topk=2, chunk_size=16)})
    cfg = RunConfig(model=model.config, data=DataConfig(corpus=str(tmp_path / "corpus.txt")), train=TrainConfig(seq_len=32))
    save_model(model, tmp_path / "ck", cfg, tok)
    assert main(["inspect", "addressing", "--checkpoint", str(tmp_path / "ck"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    from fastweights.adapt.setup import load_texts

    val = load_texts(None, cfg, "val")
    assert doc["data"].endswith(":val") and doc["tokens"] == sum(len(t) for t in val) < len(corpus) / 5
    assert set(doc["better"]) == {"collision", "coverage", "kld"} and doc["better"]["coverage"].startswith("higher")
    assert main(["inspect", "addressing", "--checkpoint", str(tmp_path / "ck"), "--max-tokens", "100"]) == 0
    out = capsys.readouterr().out
    assert "100 tokens" in out and "bits/token" in out and "collision lower is better" in out
    assert "coverage higher is better" in out and "KLD from uniform lower is better" in out
    parser = {p.prog: p for p in _parsers(build_parser())}["fastweights inspect addressing"]
    assert parser.parse_args(["--checkpoint", "x"]).max_tokens == 65536  # a stated bound, not the whole corpus
