"""Multi-token NIAH (fastweights.tasks.niah_multitoken): two-token keys and three-token values, held-out keys and
values never in a training needle, distinct needles absent from the haystack, generation scored exact and per
token, the forced-answer memory probe, and the `niah` command on it."""

import json
import types

import pytest
import torch

from fastweights.core.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from fastweights.core.errors import UserError
from fastweights.data import build_tokenizer
from fastweights.models.lm import LanguageModel
from fastweights.tasks import niah_multitoken as mt
from fastweights.tasks import niah_token as nt
from fastweights.tasks.niah import NiahOptions, evaluate_sample, score_answer, summarize
from helpers import tiny_lm


@pytest.fixture(scope="module")
def text():
    return mt.training_text(nt.train_haystack(), 40_000, seed=3)


@pytest.fixture(scope="module")
def tok(text):
    return build_tokenizer("word", text)


@pytest.fixture(scope="module")
def ev():
    return nt.eval_haystack()


def training_needles(text):
    """(key, value) of every needle of a training text, and the (key, value, distance) of every question."""
    words = text.split(" ")
    needles, questions, at = [], [], {}
    for i, w in enumerate(words[: -(1 + mt.KEY_LEN + mt.VALUE_LEN)]):
        if w in (mt.NEEDLE, mt.QUESTION) and i >= len(mt.RESERVED):
            key = tuple(words[i + 1 : i + 1 + mt.KEY_LEN])
            value = tuple(words[i + 1 + mt.KEY_LEN : i + 1 + mt.KEY_LEN + mt.VALUE_LEN])
            if w == mt.NEEDLE:
                needles.append((key, value))
                at[key] = (i, value)
            else:
                questions.append((key, value, i - at[key][0], at[key][1]))
    return needles, questions


def test_reserved_tokens_are_single_tokens_and_the_format_is_recognised(tok):
    assert mt.is_multitoken_format(tok) and not nt.is_token_format(tok)
    for t in mt.RESERVED:
        ids = tok.encode(t)
        assert len(ids) == 1 and ids[0] != tok.unk_id
    assert not mt.is_multitoken_format(build_tokenizer("word", "just some words\n"))
    # only a word tokenizer: another kind holding the same words (or none) is not this format (mutations caught:
    # the two conditions joined by ``and``, a tokenizer without ``words`` raising, every other kind accepted)
    assert not mt.is_multitoken_format(build_tokenizer("char", "abc\n"))
    assert not mt.is_multitoken_format(types.SimpleNamespace(name="bpe", words=list(tok.words)))
    assert not mt.is_multitoken_format(types.SimpleNamespace(name="word")) and not mt.is_multitoken_format(object())


def test_heldout_keys_and_values_never_occur_in_training_needles(text):
    needles, questions = training_needles(text)
    assert len(needles) > 300
    assert not any(k in mt.HELDOUT_KEYS for k, _ in needles)
    assert not any(mt.heldout_value(v) for _, v in needles)
    assert len(mt.EVAL_KEYS) == len(mt.ALL_KEYS) // 4 and not set(mt.EVAL_KEYS) & set(mt.TRAIN_KEYS)
    # every piece of a held-out key is trained, at both positions: what is new is only the pair
    pieces = [set(k[i] for k in mt.TRAIN_KEYS) for i in range(mt.KEY_LEN)]
    assert all(p == set(mt.KEY_TOKENS) for p in pieces)
    share = sum(mt.heldout_value(mt.draw_value(__import__("random").Random(i), False)) for i in range(200))
    assert share == 0


def test_training_questions_repeat_their_needle_beyond_window_and_chunk(text):
    _, questions = training_needles(text)
    assert len(questions) > 300
    for key, value, distance, want in questions:
        assert value == want  # the question's answer is its own needle's value
        assert distance >= 80  # beyond a 32-token window and a 64-token memory chunk


def test_eval_samples_hold_distinct_heldout_needles_absent_from_the_haystack(ev):
    s = mt.make_sample(ev, 600, 0.5, seed=1, index=2)
    words = s.context.split(" ")
    assert s.tokens == len(words) == 600 and s.format == "multitoken"
    keys = [tuple(n.key.split(" ")) for n in s.needles]
    values = [tuple(n.value.split(" ")) for n in s.needles]
    assert len(set(keys)) == 5 and len(set(values)) == 5
    assert all(k in mt.HELDOUT_KEYS for k in keys) and all(mt.heldout_value(v) for v in values)
    assert words.count(mt.NEEDLE) == 5 and mt.QUESTION not in words
    reserved = set(mt.RESERVED)
    needle_words = 0
    for n in s.needles:  # each needle at its recorded character offset, and nowhere else
        assert s.context[n.offset:].startswith(f"{mt.NEEDLE} {n.key} {n.value}")
        assert s.context.count(f"{n.key} {n.value}") == 1
        needle_words += 1 + mt.KEY_LEN + mt.VALUE_LEN
    assert sum(w in reserved for w in words) == needle_words  # the haystack holds no reserved token
    assert s.question == f" {mt.QUESTION} {s.needles[s.target].key}" and s.answer == s.needles[s.target].value
    assert abs((len(s.context[: s.needles[s.target].offset].split(" ")) - 1) / 600 - 0.5) < 0.02
    assert mt.make_sample(ev, 600, 0.5, seed=1, index=2) == s
    assert mt.make_sample(ev, 600, 0.5, seed=1, index=3) != s
    train = mt.make_sample(ev, 600, None, seed=1, index=2, keys="train")
    assert not any(tuple(n.key.split(" ")) in mt.HELDOUT_KEYS for n in train.needles)
    assert not any(mt.heldout_value(tuple(n.value.split(" "))) for n in train.needles)
    with pytest.raises(UserError):
        mt.make_sample(ev, 20, 0.5)
    with pytest.raises(UserError):
        mt.make_sample(ev, 600, 0.5, keys="other")


def test_make_samples_bounds_are_said_in_one_line_each(ev):
    """The accepted ranges, at their edges: 1 to 64 needles, a depth in [0, 1], a context with room for at least
    one haystack token beside the needles (each needle is 1 + KEY_LEN + VALUE_LEN tokens); outside them, one
    UserError saying what was given (mutations caught: each bound moved by one, each message dropped)."""
    per = 1 + mt.KEY_LEN + mt.VALUE_LEN
    for n in (1, 64):
        assert len(mt.make_sample(ev, per * n + 1, 0.5, n_needles=n).needles) == n
    for depth in (0.0, 1.0):
        assert mt.make_sample(ev, 600, depth).needles[0].depth is not None
    cases = [(dict(n_needles=0), "n_needles must be in [1, 64], got 0"),
             (dict(n_needles=65), "n_needles must be in [1, 64], got 65"),
             (dict(depth=1.5), "needle depth must be in [0, 1], got 1.5"),
             (dict(depth=-0.1), "needle depth must be in [0, 1], got -0.1"),
             (dict(length=per * 5), f"context length {per * 5} is too short for 5 needles"),
             (dict(keys="other"), "keys must be 'heldout' or 'train', got 'other'")]
    for kwargs, message in cases:
        with pytest.raises(UserError) as e:
            mt.make_sample(ev, **{"length": 600, "depth": 0.5, **kwargs})
        assert str(e.value) == message


def test_a_sample_is_drawn_from_every_part_of_its_description(ev):
    """Seed, length, depth, index and the key set each give another sample; the same ones the same sample (the
    random stream is seeded by all five: mutations caught, a part left out of the seed)."""
    base = dict(length=600, depth=0.5, seed=1, index=2, keys="heldout")
    s = mt.make_sample(ev, **base)
    for change in (dict(seed=2), dict(length=601), dict(depth=0.25), dict(index=3), dict(keys="train")):
        other = mt.make_sample(ev, **{**base, **change})
        assert [n.key for n in other.needles] != [n.key for n in s.needles], change


def test_needle_values_are_distinct_even_from_a_small_value_set(ev, monkeypatch):
    few = [(f"<d0{i}>", "<d00>", "<d00>") for i in range(6)]
    monkeypatch.setattr(mt, "draw_value", lambda rng, heldout: rng.choice(few))
    for i in range(10):
        s = mt.make_sample(ev, 300, None, seed=0, index=i)
        assert len({n.value for n in s.needles}) == 5


def test_generation_is_scored_exact_and_per_token(ev):
    s = mt.make_sample(ev, 300, None, seed=0)
    a, b, c = s.answer.split(" ")
    right = score_answer(f" {a} {b} {c}", s)
    assert right["exact"] == 1.0 and right["per_token"] == 1.0 and right["token_hits"] == [1, 1, 1]
    assert score_answer(f" {a} {b} {c} <d00> and", s)["exact"] == 1.0  # what follows the answer is not scored
    # a wrong first token: not exact, two thirds per token; a haystack word counts as a wrong token
    wrong = score_answer(f" <d00> {b} {c} and more", s) if a != "<d00>" else score_answer(f" <d01> {b} {c}", s)
    assert wrong["exact"] == 0.0 and wrong["per_token"] == pytest.approx(2 / 3) and wrong["token_hits"] == [0, 1, 1]
    short = score_answer(f" {a} the", s)
    assert short["exact"] == 0.0 and short["token_hits"] == [1, 0, 0] and short["per_token"] == pytest.approx(1 / 3)
    assert score_answer(f" {a}", s)["token_hits"] == [1, 0, 0]  # fewer tokens than the answer: the rest are wrong
    other = s.needles[(s.target + 1) % 5].value
    assert score_answer(" " + other, s)["candidate"] == 1.0 and score_answer(" " + other, s)["exact"] == 0.0
    table = summarize([{**right, "iters": 1, "length": 300, "depth": 0.5}, {**wrong, "iters": 1, "length": 300,
                                                                          "depth": 0.5}])
    assert table["metrics"] == ["exact", "per_token", "candidate"]
    assert table["by_iters"][1]["overall"]["per_token"] == pytest.approx(5 / 6)


def tiny_word_model(tok, memory_layer=1, seed=0):
    return tiny_lm(tok.vocab_size, seed=seed, memory="fwpkm", memory_layers=[memory_layer],
                   options={"fwpkm": dict(n_subkeys=8, d_key=8, d_value=8, topk=2, chunk_size=32,
                                          persistence="per_sequence"),
                            "attention": {"window": 8}})


def test_answers_are_generated_three_tokens_after_each_read(tok, ev):
    model = tiny_word_model(tok)
    s = mt.make_sample(ev, 200, 0.3, seed=0)
    records, state = evaluate_sample(model, tok, s, NiahOptions(iters=(1, 2), piece=64))
    assert [r["iters"] for r in records] == [1, 2] and state["layers"][1]["memory"].writes == 2
    for r in records:
        assert len(r["token_hits"]) == 3 and set(r) >= {"exact", "per_token", "candidate"}


def test_forced_probe_reads_the_stored_value_of_each_answer_token(tok, ev):
    """A random-init FwPKM at layer 0 over embeddings alone: after one read (n = 2) its read at the position that
    predicts answer token j matches what the target needle's write stored for that position (the next token's
    value), for every j; the fresh memory (n = 1) does not. A probe looking at the wrong position fails this."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, memory="fwpkm", memory_layers=[0],
                      options={"fwpkm": dict(n_subkeys=64, d_key=16, d_value=32, topk=4, chunk_size=32,
                                             persistence="per_sequence"), "attention": {"window": 8}})
    model = LanguageModel(cfg).eval()
    rows = [r for i in range(3) for r in mt.forced_answer_probe(model, tok, mt.make_sample(ev, 300, None, 0, i), (1, 2))]
    assert sorted({r["token"] for r in rows}) == [0, 1, 2]
    two = [r for r in rows if r["iters"] == 2]
    assert all(r["target_wins"] for r in two)
    assert sum(r["cos_target"] for r in two) / len(two) > 0.85  # 1 up to the memory's error and slot collisions
    one = [r["cos_target"] for r in rows if r["iters"] == 1]
    assert sum(one) / len(one) < 0.3


@pytest.mark.parametrize("form", ["auto", "char", "token", "multitoken"])
def test_niah_takes_every_needle_format(form):
    from fastweights.cli import parse_command_line

    assert parse_command_line(["task", "niah", "--checkpoint", "x", "--format", form]).format == form


def test_niah_command_picks_the_multitoken_format(tok, tmp_path, capsys):
    from fastweights import cli
    from fastweights.checkpoints.format import save_model

    ckpt = tmp_path / "ckpt"
    model = tiny_word_model(tok)
    save_model(model, ckpt, RunConfig(model=model.config, data=DataConfig(tokenizer="word"),
                                      train=TrainConfig(seq_len=64)), tok)
    out = tmp_path / "niah"
    argv = ["task", "niah", "--checkpoint", str(ckpt), "--lengths", "128", "--samples", "2", "--iters", "1,2",
            "--out", str(out), "--quiet", "--piece", "64"]
    assert cli.main(argv) == 0
    doc = json.loads((out / "niah.json").read_text())
    assert doc["format"] == "multitoken" and doc["keys"] == "heldout" and "heldout_key_embeddings" not in doc
    assert len(doc["records"]) == 2 * 2 and all(len(r["answer"].split(" ")) == 3 for r in doc["records"])
    capsys.readouterr()
    assert cli.main([*argv, "--format", "token", "--overwrite"]) == 2  # a format the flag takes, not this model's
    assert "--format token needs a word-level model trained on that needle format" in capsys.readouterr().err


def test_make_samples_draws_heldout_keys_unless_told_and_one_sample_per_length_or_cell(ev):
    """``make_samples``: by default the evaluation's held-out keys (the same samples as ``keys="heldout"``),
    ``samples`` per length, or per (length, depth) cell when depths are given."""
    default = mt.make_samples(ev, [300, 400], samples=2, seed=3)
    assert default == mt.make_samples(ev, [300, 400], samples=2, seed=3, keys="heldout")
    assert default != mt.make_samples(ev, [300, 400], samples=2, seed=3, keys="train")
    assert [s.length for s in default] == [300, 300, 400, 400]
    cells = mt.make_samples(ev, [300], depths=[0.0, 1.0], samples=2, seed=3)
    assert len(cells) == 4 and cells[0] == mt.make_sample(ev, 300, 0.0, 3, 0)
    assert cells[1] == mt.make_sample(ev, 300, 0.0, 3, 1) != cells[0]  # the samples of a cell differ (their index)
    assert cells[0].seed == "niah-multitoken:3:300:0:0:heldout"  # the sample names what it was drawn from
