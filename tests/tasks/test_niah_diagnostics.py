"""``tasks.niah_diagnostics`` on untrained tiny models: the memory probe reads layer 0's FwPKM at every question
and compares it with its needle's value target and with the other needles' (None for a model that has no such
memory); the answer-digit accuracy counts the questions' and the needles' digits of the held-out span."""

import math
from pathlib import Path

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


class _Oracle:
    """A stand-in model over a known text: at position p it predicts character p + 1 correctly when p + 1 is in
    ``right`` (wrong otherwise), reading p from the state it returned for the previous window (None: position 0),
    so a state not carried between windows starts over at 0 and predicts the wrong characters."""

    def __init__(self, ids, right, vocab):
        self.ids, self.right, self.vocab, self.calls = ids, right, vocab, []

    def eval(self):
        return self

    def __call__(self, x, state):
        import types

        import torch

        p0 = 0 if state is None else state["pos"]
        self.calls.append((p0, x.shape[1]))
        logits = torch.zeros(1, x.shape[1], self.vocab)
        for i in range(x.shape[1]):
            p = p0 + i
            nxt = int(self.ids[p + 1]) if p + 1 < len(self.ids) else 0
            logits[0, i, nxt if p + 1 in self.right else (nxt + 1) % self.vocab] = 1.0
        return types.SimpleNamespace(logits=logits, state={"pos": p0 + x.shape[1]})

    def trim_state(self, state, keep):
        assert keep == 64
        return state


def test_answer_digit_accuracy_counts_question_and_needle_digits_separately(tok, monkeypatch):
    """An oracle that predicts the first digit of every needle's value and all but the first digit of every
    question's answer: needle accuracy 1/6, question accuracy 5/6, the positions found here by plain string search
    (the key's first occurrence is its needle, each later one a question)."""
    import torch

    from fastweights.data import load_corpus, split_corpus
    from fastweights.models import loading
    from fastweights.tasks.niah import VALUE_DIGITS

    # a test fraction of its own: the held-out span is the one the checkpoint's settings name
    cfg = RunConfig(data=DataConfig(corpus="niah-tinyshakespeare", test_fraction=0.07), train=TrainConfig(seq_len=64))
    docs = load_corpus(cfg.data.corpus)
    full = "".join(d.text for d in split_corpus(docs, cfg.data.split, cfg.data.val_fraction,
                                                   cfg.data.test_fraction)["test"])[:6000]
    text = full[full.index("\n\n") + 2:]
    right, needles, questions, seen = set(), 0, 0, set()
    at = text.find("The secret number for ID-")
    while at >= 0:
        key_at = at + len("The secret number for ")
        key = text[key_at:key_at + len("ID-") + 4]
        digits = key_at + len(key) + len(" is ")
        assert text[digits:digits + VALUE_DIGITS].isdigit() and text[digits + VALUE_DIGITS] == "."
        right.update((digits - 1, digits + VALUE_DIGITS))  # the space before and the full stop after: not digits
        if key in seen:
            questions += 1
            right.update(range(digits + 1, digits + VALUE_DIGITS))
        else:
            needles += 1
            right.add(digits)
            seen.add(key)
        at = text.find("The secret number for ID-", at + 1)
    assert needles >= 2 and questions >= 2, (needles, questions)
    ids = torch.tensor(tok.encode(text))
    oracle = _Oracle(ids, right, tok.vocab_size)
    monkeypatch.setattr(loading, "load_checkpoint", lambda ckpt: (oracle, tok, cfg))
    got = answer_digit_accuracy(Path("unused"), chars=6000)
    assert got == {"question_answer_digits": pytest.approx(5 / 6), "needle_digits_chance": pytest.approx(1 / 6),
                   "questions": questions, "chars": len(text)}
    assert type(got["questions"]) is int
    assert [c[0] for c in oracle.calls] == list(range(0, len(text), 64))  # windows of seq_len, state carried


def test_answer_digit_accuracy_refuses_a_tokenizer_that_is_not_one_token_per_character(tok, monkeypatch):
    from fastweights.models import loading

    class Words:
        def encode(self, text):
            return tok.encode(text)[::2]

    cfg = RunConfig(data=DataConfig(corpus="niah-tinyshakespeare"), train=TrainConfig(seq_len=64))
    monkeypatch.setattr(loading, "load_checkpoint", lambda ckpt: (_Oracle([], set(), 2), Words(), cfg))
    with pytest.raises(SystemExit) as e:
        answer_digit_accuracy(Path("ck"), chars=3000)
    assert str(e.value) == "error: ck does not use a character tokenizer (the answer digits need one token each)"
