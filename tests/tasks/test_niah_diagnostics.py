"""``tasks.niah_diagnostics`` on untrained tiny models: the memory probe reads layer 0's FwPKM at every question
and compares it with its needle's value target and with the other needles' (None for a model that has no such
memory); the answer-digit accuracy counts the questions' and the needles' digits of the held-out span."""

import math

import pytest

from fastweights.core.config import DataConfig, RunConfig, TrainConfig
from fastweights.data import CharTokenizer
from fastweights.tasks.niah import Haystack
from fastweights.tasks.niah_diagnostics import answer_digit_accuracy, memory_value_probe
from helpers import tiny_lm


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer.from_text(Haystack.load().text[:200000] + "0123456789abcdef" + "ID-")


def test_the_memory_probe_compares_each_questions_read_with_its_needle(tok):
    fw = dict(n_subkeys=6, d_key=8, d_value=8, topk=2, chunk_size=16)
    model = tiny_lm(tok.vocab_size, memory="fwpkm", memory_layers=[0], short_conv=4, options={"fwpkm": fw}).eval()
    got = memory_value_probe(model, tok, chars=1500, seed=3)
    assert (got["chars"], got["seed"], got["haystack"]) == (1500, 3, "tinyshakespeare") and got["questions"]
    for row in got["questions"]:
        assert row["gap"] > 0 and -1 <= row["cos_target"] <= 1
        assert row["max_cos_other_needles"] is None or -1 <= row["max_cos_other_needles"] <= 1
    near = [r for r in got["questions"] if r["gap"] < 500 and r["max_cos_other_needles"] is not None]
    summary = got["gap_under_500"]
    if near:
        assert summary["n"] == len(near)
        assert summary["target_beats_others"] == sum(r["cos_target"] > r["max_cos_other_needles"] for r in near)
        assert summary["cos_target_range"] == [min(r["cos_target"] for r in near), max(r["cos_target"] for r in near)]
    assert memory_value_probe(tiny_lm(tok.vocab_size), tok) is None  # no memory at layer 0


def test_the_answer_digit_accuracy_of_a_checkpoint(tok, tmp_path):
    from fastweights.checkpoints.format import save_model

    model = tiny_lm(tok.vocab_size, seed=1)
    cfg = RunConfig(model=model.config, data=DataConfig(corpus="niah-tinyshakespeare"), train=TrainConfig(seq_len=64))
    save_model(model, tmp_path / "ck", cfg, tok)
    got = answer_digit_accuracy(tmp_path / "ck", chars=6000)
    assert got["questions"] > 0 and got["chars"] <= 6000
    for k in ("question_answer_digits", "needle_digits_chance"):
        assert 0.0 <= got[k] <= 1.0 and math.isfinite(got[k])
