"""Token-level NIAH (fastweights.tasks.niah_token): single-token keys and values, haystacks free of them,
questions beyond the attention window and the memory chunk, held-out keys, and the `niah` command on it."""

import json

import pytest
import torch

from fastweights.core.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from fastweights.data import build_tokenizer
from fastweights.core.errors import UserError
from fastweights.models.lm import LanguageModel
from fastweights.tasks import niah_token as nt
from fastweights.tasks.niah import NiahOptions, evaluate_sample
from helpers import tiny_lm


@pytest.fixture(scope="module")
def hay():
    return nt.train_haystack()


@pytest.fixture(scope="module")
def text(hay):
    return nt.training_text(hay, 30_000, seed=3)


@pytest.fixture(scope="module")
def tok(text):
    return build_tokenizer("word", text)


def test_reserved_tokens_are_single_tokens_of_the_trained_vocabulary(tok):
    assert nt.is_token_format(tok)
    for t in nt.RESERVED:
        ids = tok.encode(t)
        assert len(ids) == 1 and ids[0] != tok.unk_id
    assert not nt.is_token_format(build_tokenizer("word", "just some words\n"))


def test_normalize_words_lowercases_and_splits_punctuation():
    assert nt.normalize_words("Hello, World!\n\n\nO'er <k001>") == \
        ["hello", ",", "world", "!", "\n", "o'er", "<", "k", "001", ">"]


def test_haystacks_hold_no_reserved_token_and_cap_the_vocabulary(hay):
    assert not set(hay.words) & set(nt.RESERVED)
    assert len(set(hay.words) - {"\n", nt.UNK}) <= nt.VOCAB_WORDS
    with pytest.raises(UserError):
        nt.WordHaystack(["a"] * 2000 + ["<k001>"], name="bad")
    ev = nt.eval_haystack()
    assert ev.name == "tinyshakespeare[0.9:1]" and not set(ev.words) & set(nt.RESERVED)


def test_training_questions_follow_their_needles_beyond_window_and_chunk(text, tok):
    words = text.split(" ")
    assert words[: len(nt.RESERVED)] == list(nt.RESERVED)  # the vocabulary line
    needles, asked = {}, 0
    start = len(nt.RESERVED) + 1
    for i, w in enumerate(words[start:-2], start):
        if w == nt.NEEDLE:
            key, value = words[i + 1], words[i + 2]
            assert key in nt.KEYS[: nt.TRAIN_KEYS] and value in nt.VALUES  # training keys only
            needles[key] = (i + 2, value)
        elif w == nt.QUESTION:
            key, value = words[i + 1], words[i + 2]
            pos, want = needles[key]
            assert value == want
            assert 80 <= i + 1 - pos <= 240 + 3 * 4  # beyond a 32-token window and a 64-token chunk
            asked += 1
    assert asked > 0.9 * len(needles) - 10
    # every key and value is one token of the tokenizer built from this text
    ids = tok.encode(text)
    assert len(ids) == len(words) and tok.unk_id not in ids[: len(nt.RESERVED)]


def test_eval_samples_use_heldout_keys_and_are_deterministic(hay):
    ev = nt.eval_haystack()
    s = nt.make_sample(ev, 600, 0.5, seed=1, index=2)
    assert s.tokens == 600
    words = s.context.split(" ")
    assert len(words) == 600
    keys = [n.key for n in s.needles]
    assert len(set(keys)) == 5 and all(k in nt.KEYS[nt.TRAIN_KEYS:] for k in keys)
    assert len({n.value for n in s.needles}) == 5
    for n in s.needles:  # each needle once, at its recorded character offset
        assert words.count(n.key) == 1 and s.context[n.offset:].startswith(f"{nt.NEEDLE} {n.key} {n.value}")
    assert s.question == f" {nt.QUESTION} {s.needles[s.target].key}" and s.answer == s.needles[s.target].value
    target_word = words.index(s.needles[s.target].key) - 1
    assert abs(target_word / 600 - 0.5) < 0.02
    assert nt.make_sample(ev, 600, 0.5, seed=1, index=2) == s
    assert nt.make_sample(ev, 600, 0.5, seed=1, index=3) != s
    train = nt.make_sample(ev, 600, None, seed=1, index=2, keys="train")
    assert all(n.key in nt.KEYS[: nt.TRAIN_KEYS] for n in train.needles)
    with pytest.raises(UserError):
        nt.make_sample(ev, 10, 0.5)
    with pytest.raises(UserError):
        nt.make_sample(ev, 600, 0.5, keys="other")


def tiny_word_model(tok, seed=0):
    return tiny_lm(tok.vocab_size, seed=seed, memory="fwpkm", memory_layers=[0],
                   options={"fwpkm": dict(n_subkeys=8, d_key=8, d_value=8, topk=2, chunk_size=32,
                                          persistence="per_sequence"),
                            "attention": {"window": 8}})


def test_one_and_two_reads_on_a_token_sample(tok):
    model = tiny_word_model(tok)
    s = nt.make_sample(nt.eval_haystack(), 200, 0.3, seed=0)
    records, state = evaluate_sample(model, tok, s, NiahOptions(iters=(1, 2), piece=64))
    assert [r["iters"] for r in records] == [1, 2] and state["layers"][0]["memory"].writes == 2
    for r in records:
        assert r["prediction"] == r["prediction"].strip() and set(r) >= {"exact", "candidate"}


def test_niah_command_picks_the_token_format(tok, tmp_path):
    from fastweights import cli
    from fastweights.checkpoints.format import save_model

    ckpt = tmp_path / "ckpt"
    model = tiny_word_model(tok)
    save_model(model, ckpt, RunConfig(model=model.config, data=DataConfig(tokenizer="word"),
                                      train=TrainConfig(seq_len=64)), tok)
    out = tmp_path / "niah"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        argv = ["task", "niah", "--checkpoint", str(ckpt), "--lengths", "128,256", "--samples", "3", "--iters", "1,2",
                "--out", str(out), "--quiet", "--piece", "64"]
        assert cli.main(argv) == 0
        first = (out / "niah.json").read_text()
        assert cli.main(argv) == 2  # an earlier run's outputs are not replaced silently
        assert (out / "niah.json").read_text() == first
        assert cli.main([*argv, "--overwrite"]) == 0
    doc = json.loads((out / "niah.json").read_text())
    assert doc["format"] == "token" and doc["keys"] == "heldout" and doc["haystack"] == "tinyshakespeare[0.9:1]"
    assert len(doc["records"]) == 2 * 3 * 2
    assert all(r["answer"] in nt.VALUES for r in doc["records"])
    assert doc["heldout_key_embeddings"] == "mean + std * N(0, 1) of the trained keys'"
    # the trained keys: the record says their embeddings are the trained ones (mutation caught, issue 49 seed 7:
    # the label misspelt)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert cli.main([*argv, "--overwrite", "--keys", "train", "--lengths", "128", "--iters", "1"]) == 0
    doc = json.loads((out / "niah.json").read_text())
    assert doc["keys"] == "train" and doc["heldout_key_embeddings"] == "trained"


def test_memory_probe_finds_the_needle_after_one_write(tok):
    """At layer 0 a random-init FwPKM already binds key -> value: after one read (n = 2) its read at the
    question matches the target needle's value target, and with the fresh memory (n = 1) it does not."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, memory="fwpkm", memory_layers=[0],
                      options={"fwpkm": dict(n_subkeys=64, d_key=16, d_value=32, topk=4, chunk_size=32,
                                             persistence="per_sequence"), "attention": {"window": 8}})
    model = LanguageModel(cfg).eval()
    hay = nt.eval_haystack()
    rows = [r for i in range(4) for r in nt.memory_probe(model, tok, nt.make_sample(hay, 300, None, 0, i), (1, 2))]
    two = [r for r in rows if r["iters"] == 2]
    one = [r for r in rows if r["iters"] == 1]
    assert all(r["target_wins"] and r["cos_target"] > 0.9 for r in two)
    assert all(r["cos_target"] < 0.9 for r in one)


def test_frozen_memory_never_writes(tok):
    model = tiny_word_model(tok)
    s = nt.make_sample(nt.eval_haystack(), 200, 0.3, seed=0)
    _, state = evaluate_sample(model, tok, s, NiahOptions(iters=(1, 2), piece=64, frozen_memory=True))
    assert state["layers"][0]["memory"].writes == 0
    assert model.blocks[0].memory.frozen is False  # restored


def test_heldout_keys_are_drawn_from_the_trained_keys(tok):
    model = tiny_word_model(tok)
    ids = torch.as_tensor(tok.encode(" ".join(nt.KEYS)))
    with torch.no_grad():
        model.embed.weight[ids[: nt.TRAIN_KEYS]] += 3.0  # a shared "key" component the trained keys learned
    before = model.embed.weight.detach().clone()
    nt.init_heldout_keys(model, tok, seed=1)
    w = model.embed.weight.detach()
    held = w[ids[nt.TRAIN_KEYS:]]
    assert torch.equal(w[ids[: nt.TRAIN_KEYS]], before[ids[: nt.TRAIN_KEYS]])  # trained rows untouched
    others = torch.ones(len(w), dtype=torch.bool)
    others[ids] = False
    assert torch.equal(w[others], before[others])
    assert (held.mean(0) - 3.0).abs().max() < 0.2 and len(set(map(tuple, held.tolist()))) == len(held)
