"""Tokenizers: round trips, GPT-2 reference ids, char unknowns, save/load/fingerprint, errors."""

import json
import random

import numpy as np
import pytest
import torch

from fastweights.data import (
    ByteTokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    build_tokenizer,
    check_fingerprint,
    load_corpus,
    load_tokenizer,
    to_utf8,
)
from fastweights.data.corpus import Document
from fastweights.data.tokenizers import bytes_to_unicode
from fastweights.core.errors import UserError

SPANISH = ("En un lugar de la Mancha, de cuyo nombre no quiero acordarme, no ha mucho tiempo que vivía un "
           "hidalgo de los de lanza en astillero, adarga antigua, rocín flaco y galgo corredor. ¿Qué? ¡Sí! Ñandú")
EMOJI = "Hello 👋🏽 world! 😀🎉 日本語 Über straße — “quotes” ½ 𝔘𝔫𝔦\u0301 tabs\t\tand\r\nlines\n\n  "
SAMPLES = ["", "a", "Hello world", SPANISH, EMOJI, "  leading and trailing  \n\n\n", "<|endoftext|> is text"]


@pytest.fixture(scope="module")
def shakespeare():
    return load_corpus("tinyshakespeare")[0].text


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer()


# GPT-2 ids below were produced by tiktoken 0.14 (OpenAI's implementation) with the r50k_base ranks
# from ../shared/data/tokenizers/gpt2 and `encode_ordinary`; the first two are also in SOURCES.md.
GPT2_REFERENCE = {
    "Hello world": [15496, 995],
    "Hello world, this is GPT-2 BPE.": [15496, 995, 11, 428, 318, 402, 11571, 12, 17, 347, 11401, 13],
    "En un lugar de la Mancha, de cuyo nombre no quiero acordarme":
        [4834, 555, 300, 35652, 390, 8591, 1869, 11693, 11, 390, 269, 4669, 78, 299, 2381, 260, 645, 627, 959, 78,
         936, 585, 283, 1326],
    "¿Qué tal? Über straße 😀": [126, 123, 4507, 2634, 3305, 30, 49363, 527, 3534, 39683, 68, 30325, 222],
    "hello\n\nworld": [31373, 198, 198, 6894],
    "  two  spaces\n\n \tend ": [220, 734, 220, 9029, 628, 220, 197, 437, 220],
    "I'll say it's 1234567 <|endoftext|>": [40, 1183, 910, 340, 338, 17031, 2231, 3134, 1279, 91, 437, 1659, 5239, 91, 29],
}


@pytest.mark.parametrize("text", list(GPT2_REFERENCE))
def test_gpt2_matches_reference_ids(gpt2, text):
    assert gpt2.encode(text).tolist() == GPT2_REFERENCE[text]


def test_gpt2_tinyshakespeare_token_count_and_round_trip(gpt2, shakespeare):
    ids = gpt2.encode(shakespeare)
    assert len(ids) == 338_025  # nanoGPT's figure, and tiktoken's
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 50257
    assert gpt2.decode(ids) == shakespeare


def test_gpt2_vocabulary_facts(gpt2):
    assert gpt2.vocab_size == 50257 and gpt2.eot_id == 50256
    assert gpt2.decode([gpt2.eot_id]) == "<|endoftext|>"
    table = bytes_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120"  # GPT-2's "Ġ"


@pytest.mark.parametrize("kind", ["byte", "char", "gpt2"])
@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(kind, text):
    tok = build_tokenizer(kind, train_text="".join(SAMPLES))
    ids = tok.encode(text)
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.ndim == 1
    assert (ids >= 0).all() and (ids < tok.vocab_size).all()
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    assert tok.decode(torch.as_tensor(ids)) == text


def test_gpt2_pieces_encode_like_the_whole_text(gpt2):
    """Document.pieces cuts only where the GPT-2 pre-tokenizer would cut anyway."""
    rng = random.Random(0)
    alphabet = list(" \n\t\r\u00a0\u2028\x1c\x85abcXZ09'sdltmvre!?.,-éñ日😀\u0301") + ["'s", "'ll", "  ", "\n\n", "'S"]
    text = "".join(rng.choice(alphabet) for _ in range(20_000))
    whole = gpt2.encode(text)
    for max_chars in (1, 7, 300):
        pieces = list(Document("t", text).pieces(max_chars))
        assert "".join(pieces) == text and len(pieces) > 10
        assert np.array_equal(np.concatenate([gpt2.encode(p) for p in pieces]), whole)


def test_gpt2_merges_lowest_rank_first(tmp_path):
    """A tiny custom BPE: the same text merges differently when the merge ranks change."""
    byte_symbols = list(bytes_to_unicode().values())

    def make(merges):
        vocab = {s: i for i, s in enumerate(byte_symbols)}
        for a, b in merges:
            vocab[a + b] = len(vocab)
        d = tmp_path / "_".join(a + b for a, b in merges)
        d.mkdir()
        (d / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
        (d / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
        return GPT2Tokenizer(d / "vocab.json", d / "merges.txt"), vocab

    tok, vocab = make([("a", "b"), ("ab", "c")])
    assert tok.encode("abcab").tolist() == [vocab["abc"], vocab["ab"]]
    tok, vocab = make([("b", "c"), ("a", "b")])
    assert tok.encode("abcab").tolist() == [vocab["a"], vocab["bc"], vocab["ab"]]
    assert tok.decode(tok.encode("abcab xyz")) == "abcab xyz"


def test_char_vocabulary_and_unknown():
    tok = CharTokenizer.from_text("hello world")
    assert tok.chars == sorted(set("hello world"))
    assert tok.unk_id == len(tok.chars) == tok.vocab_size - 1
    ids = tok.encode("hold? é")
    assert ids.tolist()[:4] == [tok.chars.index(c) for c in "hold"]
    assert ids[4] == tok.unk_id and ids[6] == tok.unk_id  # "?" and "é" were never seen
    assert tok.decode(ids) == "hold\ufffd \ufffd"
    assert tok.decode([tok.unk_id]) == "\ufffd"


def test_char_vocabulary_from_pieces_equals_from_string():
    text = SPANISH + EMOJI
    pieces = [text[i:i + 13] for i in range(0, len(text), 13)]
    assert CharTokenizer.from_text(pieces).chars == CharTokenizer.from_text(text).chars


def test_char_vocabulary_of_tinyshakespeare(shakespeare):
    tok = build_tokenizer("char", train_text=shakespeare)
    assert tok.vocab_size == 66  # 65 distinct characters + unknown
    assert tok.encode(shakespeare).max() < tok.unk_id


def test_byte_tokenizer_ids_are_utf8_bytes():
    tok = ByteTokenizer()
    assert tok.encode("é€").tolist() == list("é€".encode("utf-8"))
    assert tok.decode([0xC3]) == "\ufffd"  # half a character decodes with replacement
    raw = b"ok \xff\xfe bad \xe2\x82"
    text = raw.decode("utf-8", "surrogateescape")  # how load_corpus(encoding_check=False) keeps bad bytes
    assert tok.encode(text).tolist() == list(raw)
    assert to_utf8(text) == raw


@pytest.mark.parametrize("kind", ["byte", "char", "gpt2"])
def test_save_load_keeps_fingerprint_and_encoding(tmp_path, kind):
    tok = build_tokenizer(kind, train_text=SPANISH)
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert type(loaded) is type(tok) and loaded.vocab_size == tok.vocab_size
    assert loaded.fingerprint() == tok.fingerprint()
    assert loaded.fingerprint().startswith(f"{kind}:{tok.vocab_size}:")
    assert np.array_equal(loaded.encode(SPANISH + "?"), tok.encode(SPANISH + "?"))
    check_fingerprint(loaded, tok.fingerprint(), "checkpoint x")
    assert not list(tmp_path.glob("*.tmp"))


def test_custom_bpe_travels_with_save(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    vocab["hi"] = len(vocab)
    (source / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (source / "merges.txt").write_text("h i\n", encoding="utf-8")
    tok = GPT2Tokenizer(source / "vocab.json", source / "merges.txt")
    tok.save(tmp_path / "ckpt")
    loaded = load_tokenizer(tmp_path / "ckpt")
    assert loaded.fingerprint() == tok.fingerprint() != GPT2Tokenizer().fingerprint()
    assert loaded.encode("hi hi").tolist() == [vocab["hi"], vocab["\u0120"], vocab["hi"]]
    # a link planted at a companion file is refused before anything is written, and the message says what
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "vocab.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(UserError, match="refusing to write the tokenizer through it"):
        tok.save(tmp_path / "linked")
    assert not (tmp_path / "elsewhere.json").exists()


def test_fingerprints_tell_tokenizers_apart():
    prints = {build_tokenizer("byte").fingerprint(), build_tokenizer("gpt2").fingerprint(),
              build_tokenizer("char", train_text="abc").fingerprint(), build_tokenizer("char", train_text="abd").fingerprint()}
    assert len(prints) == 4
    assert build_tokenizer("char", train_text="cab").fingerprint() == build_tokenizer("char", train_text="abc").fingerprint()
    with pytest.raises(UserError, match="tokenizer in use is byte:256"):
        check_fingerprint(ByteTokenizer(), build_tokenizer("char", train_text="abc").fingerprint(), "checkpoint runs/x")


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(UserError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="corrupt"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"format": "fastweights-tokenizer", "version": 1, "kind": "char"}))
    with pytest.raises(UserError, match="corrupt"):
        load_tokenizer(tmp_path)
    # an edited vocabulary no longer matches the recorded fingerprint
    CharTokenizer.from_text("abc").save(tmp_path)
    meta = json.loads((tmp_path / "tokenizer.json").read_text())
    meta["code_points"] = [ord("a"), ord("b"), ord("d")]
    (tmp_path / "tokenizer.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="fingerprint"):
        load_tokenizer(tmp_path)


def test_build_tokenizer_errors():
    with pytest.raises(UserError, match="unknown tokenizer 'wordpiece'"):
        build_tokenizer("wordpiece")
    with pytest.raises(UserError, match="needs training text"):
        build_tokenizer("char")
    with pytest.raises(UserError, match="empty"):
        build_tokenizer("char", train_text="")


@pytest.mark.parametrize("kind", ["byte", "char", "gpt2"])
def test_decode_rejects_ids_outside_the_vocabulary(kind):
    tok = build_tokenizer(kind, train_text="abc")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([-1])
