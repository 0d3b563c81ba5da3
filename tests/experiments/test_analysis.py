"""`fastweights inspect compare`: per-token features, bucket tables, and the command end to end on tiny checkpoints."""

import json
import math

import numpy as np
import pytest
import torch

from fastweights.experiments.analysis import (
    analyze,
    features,
    nll_improvement,
    pow10_bucket,
    pow2_bucket,
    prior_counts,
)
from fastweights.checkpoints.format import save_model
from fastweights.core.config import ModelConfig, RunConfig
from fastweights.data import build_tokenizer
from fastweights.core.errors import UserError
from fastweights.models.lm import LanguageModel
from helpers import assert_json_shape


def test_prior_counts_and_buckets():
    assert prior_counts(np.array([5, 3, 5, 5, 3, 9])).tolist() == [0, 0, 1, 2, 1, 0]
    assert pow2_bucket(np.array([0, 1, 2, 3, 4, 7, 8, 1000])).tolist() == [0, 1, 2, 2, 3, 3, 4, 10]
    assert pow10_bucket(np.array([0, 1, 9, 10, 99, 100, 12345])).tolist() == [0, 1, 1, 2, 2, 3, 5]


def test_features_align_with_predicted_tokens():
    docs = [torch.tensor([4, 2, 4, 4]), torch.tensor([1]), torch.tensor([2, 2])]
    counts = np.array([0, 7, 30, 0, 500])
    pos, freq, prior = features(docs, counts)
    assert pos.tolist() == [1, 2, 3, 1]  # the first token of each document is context only
    assert freq.tolist() == [30, 500, 500, 30]
    assert prior.tolist() == [0, 1, 2, 1]


def test_bucket_tables_add_up():
    rng = np.random.default_rng(0)
    n = 500
    base, model = rng.random(n) * 3, rng.random(n) * 3
    pos, freq, prior = rng.integers(1, 300, n), rng.integers(0, 5000, n), rng.integers(0, 40, n)
    r = nll_improvement(base, model, pos, freq, prior)
    assert r["overall"]["tokens"] == n
    assert r["overall"]["improvement_bits"] == pytest.approx((base - model).mean() / math.log(2))
    assert r["overall"]["repeat_share"] == pytest.approx((prior > 0).mean())
    for key in ("by_position", "by_frequency", "by_prior_count"):
        rows = r[key]
        assert sum(row["tokens"] for row in rows) == n
        # the token-weighted mean of the bucket improvements is the overall improvement
        weighted = sum(row["share"] * row["improvement_bits"] for row in rows)
        assert weighted == pytest.approx(r["overall"]["improvement_bits"])
    first = r["by_prior_count"][0]
    m = prior == 0
    assert first["bucket"] == "0" and first["tokens"] == m.sum()
    assert first["improvement_bits"] == pytest.approx((base[m] - model[m]).mean() / math.log(2))


def make_checkpoint(directory, corpus, text, head="linear", seed=0):
    tok = build_tokenizer("char", train_text=text)
    cfg = RunConfig()
    cfg.data.corpus = str(corpus)
    cfg.train.seq_len = 16
    cfg.model = ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, head=head,
                            options={"fwl": {"hidden": 8, "segment_len": 8}} if head == "fwl" else {})
    torch.manual_seed(seed)
    model = LanguageModel(cfg.model)
    save_model(model, directory, cfg, tok)
    return model, tok


def run_cli(argv):
    from fastweights.cli import build_parser

    args = build_parser().parse_args(argv)
    args.argv = argv  # as fastweights.cli.main sets it: the command the result records
    return args.func(args)


def test_compare_command_end_to_end(tmp_path):
    text = "the cat sat on the mat. the dog sat on the log. " * 30
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    base, tok = make_checkpoint(tmp_path / "base", corpus, text)
    model, _ = make_checkpoint(tmp_path / "fwl", corpus, text, head="fwl", seed=1)
    out = tmp_path / "out"
    assert run_cli(["inspect", "compare", "--base", str(tmp_path / "base"), "--model", str(tmp_path / "fwl"), "--split", "test",
                    "--out", str(out), "--quiet"]) == 0
    result = json.loads((out / "analysis.json").read_text())
    assert_json_shape(result, "inspect_compare")
    assert (out / "analysis.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the overall numbers are those of scoring the test split with each model (fastweights eval's streaming)
    from fastweights.data import load_corpus, split_corpus
    from fastweights.loops.evaluate import evaluate_documents

    cfg_texts = [d.text for d in split_corpus(load_corpus(str(corpus)), "span", 0.05, 0.05)["test"]]
    for m, key in ((base, "base_bits"), (model, "model_bits")):
        r = evaluate_documents(m, tok, cfg_texts, 16, progress=False)
        assert result["overall"][key] == pytest.approx(r.loss / math.log(2), rel=1e-6)
    n = result["overall"]["tokens"]
    assert all(sum(row["tokens"] for row in result[k]) == n for k in ("by_position", "by_frequency", "by_prior_count"))
    assert result["frequency_from"] == "train" and result["data"].endswith(":test")
    assert result["command"].startswith("fastweights inspect compare --base") and result["git"]["commit"]  # provenance


def test_analyze_rejects_different_tokenizers(tmp_path):
    corpus = tmp_path / "a.txt"
    corpus.write_text("abcabc" * 50)
    make_checkpoint(tmp_path / "a", corpus, "abcabc" * 50)
    make_checkpoint(tmp_path / "b", corpus, "xyzabc" * 50)
    with pytest.raises(UserError, match="different tokenizers"):
        analyze(tmp_path / "a", tmp_path / "b", progress=False)


def test_cli_exit_status_for_missing_checkpoint(tmp_path, capsys):
    from fastweights.cli import main

    assert main(["inspect", "compare", "--base", str(tmp_path / "nope"), "--model", str(tmp_path / "nope2")]) == 2
    assert "error:" in capsys.readouterr().err
