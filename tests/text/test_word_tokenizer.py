"""Word-level tokenizer: round trips, <eos>/<unk>, vocabulary from the training split only,
save/load/fingerprint, piece-by-piece encoding, and training with ``data.tokenizer = "word"``."""

import json

import numpy as np
import pytest

from fastweights.data import (
    TOKENIZER_KINDS,
    WordTokenizer,
    build_tokenizer,
    check_fingerprint,
    encode_to_file,
    load_tokenizer,
    split_corpus,
    text_pieces,
)
from fastweights.data.corpus import Document
from fastweights.core.errors import UserError

# PTB-style text (Mikolov's files: leading space, one sentence per line, <unk> and N already in it)
PTB_LIKE = (" the cat sat on the mat \n the dog sat N times \n a <unk> ran to the cat \n"
            " the mat was red \n")


def test_vocabulary_specials_and_frequency_order():
    tok = WordTokenizer.from_text(PTB_LIKE)
    assert tok.words[:2] == ["<eos>", "<unk>"] and (tok.eos_id, tok.unk_id) == (0, 1)
    assert tok.words[2] == "the"  # the most frequent word (5 times)
    assert tok.words[3:6] == ["cat", "mat", "sat"]  # twice each: ties in code-point order
    # each distinct word once; the literal <unk> of the text is the unknown symbol, not a new word
    assert tok.vocab_size == 2 + len(set(PTB_LIKE.split()) - {"<unk>"})
    assert tok.encode("<unk>").tolist() == [tok.unk_id]


def test_encode_words_and_newlines():
    tok = WordTokenizer.from_text(PTB_LIKE)
    ids = tok.encode(" the cat \n the dog\n")
    assert [tok.words[i] for i in ids] == ["the", "cat", "<eos>", "the", "dog", "<eos>"]
    # tabs, several spaces and carriage returns only separate words; each newline is one <eos>
    assert tok.encode("the\t\tcat  \r\n\n mat").tolist() == tok.encode("the cat \n \n mat").tolist()
    assert tok.encode("").tolist() == [] and tok.encode(" \t ").tolist() == []
    assert tok.encode("the").dtype == np.int64


def test_unknown_words():
    tok = WordTokenizer.from_text(PTB_LIKE)
    ids = tok.encode("the zebra sat on a unicorn")
    assert [tok.words[i] for i in ids] == ["the", "<unk>", "sat", "on", "a", "<unk>"]
    assert tok.decode(ids) == "the <unk> sat on a <unk>"
    # case matters: "The" is not "the"
    assert tok.encode("The").tolist() == [tok.unk_id]


def test_round_trip():
    tok = WordTokenizer.from_text(PTB_LIKE)
    ids = tok.encode(PTB_LIKE)
    text = tok.decode(ids)
    # decode joins words with one space, a newline per <eos>: PTB lines lose their edge spaces
    assert text == "the cat sat on the mat\nthe dog sat N times\na <unk> ran to the cat\nthe mat was red\n"
    assert tok.encode(text).tolist() == ids.tolist()  # ids -> text -> ids is exact
    assert tok.decode(tok.encode(text)) == text  # normalised text round-trips exactly
    assert tok.decode([]) == "" and tok.decode(tok.eos_id) == "\n"
    assert tok.decode(np.array(ids)) == tok.decode(ids.tolist())
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])


def test_vocabulary_from_train_split_only():
    train = " alpha beta gamma \n beta gamma \n"
    held_out = " delta alpha epsilon \n"
    docs = [Document("train", train), Document("val", held_out), Document("test", held_out)]
    tok = build_tokenizer("word", train_text=text_pieces(docs[:1]))
    assert set(tok.words) == {"<eos>", "<unk>", "alpha", "beta", "gamma"}
    assert [tok.words[i] for i in tok.encode(held_out)] == ["<unk>", "alpha", "<unk>", "<eos>"]
    # through split_corpus as training does: held-out words are not in the vocabulary
    corpus = [Document("c", " ".join(f"w{i}" for i in range(100)))]
    splits = split_corpus(corpus, "span", 0.1, 0.1)
    tok = build_tokenizer("word", train_text=text_pieces(splits["train"]))
    train_words = set(splits["train"][0].text.split())
    assert set(tok.words[2:]) == train_words
    assert "w99" not in tok.words and tok.encode("w99").tolist() == [tok.unk_id]


def test_pieces_encode_like_the_whole_text():
    text = PTB_LIKE * 50
    tok = WordTokenizer.from_text(text)
    whole = tok.encode(text)
    pieces = list(Document("d", text).pieces(max_chars=37))  # cut only between a word and whitespace
    assert len(pieces) > 10
    assert np.concatenate([tok.encode(p) for p in pieces]).tolist() == whole.tolist()
    assert WordTokenizer.from_text(iter(pieces)).words == tok.words


def test_save_load_and_fingerprint(tmp_path):
    tok = WordTokenizer.from_text(PTB_LIKE + " naïve café 日本語 \n")
    tok.save(tmp_path)
    meta = json.loads((tmp_path / "tokenizer.json").read_text())
    assert meta["kind"] == "word" and meta["vocab_size"] == tok.vocab_size
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, WordTokenizer)
    assert loaded.words == tok.words and loaded.fingerprint() == tok.fingerprint()
    assert loaded.fingerprint().startswith(f"word:{tok.vocab_size}:")
    sample = "the café sat on a 日本語 mat \n zebra"
    assert loaded.encode(sample).tolist() == tok.encode(sample).tolist()
    check_fingerprint(loaded, tok.fingerprint(), "test")
    # another vocabulary (same size) has another fingerprint
    other = WordTokenizer(tok.words[:2] + tok.words[3:] + ["zzz"])
    assert other.vocab_size == tok.vocab_size and other.fingerprint() != tok.fingerprint()
    with pytest.raises(UserError):
        check_fingerprint(other, tok.fingerprint(), "checkpoint x")
    # an edited vocabulary no longer matches its recorded fingerprint
    meta["words"][2], meta["words"][3] = meta["words"][3], meta["words"][2]
    (tmp_path / "tokenizer.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="fingerprint"):
        load_tokenizer(tmp_path)
    meta["words"] = ["<unk>", "<eos>", "a"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="corrupt"):
        load_tokenizer(tmp_path)


def test_errors():
    assert "word" in TOKENIZER_KINDS
    with pytest.raises(UserError, match="training text"):
        build_tokenizer("word")
    with pytest.raises(UserError, match="no words"):
        build_tokenizer("word", train_text=" \n \n ")
    with pytest.raises(ValueError):
        WordTokenizer(["<eos>", "<unk>", "two words"])
    with pytest.raises(ValueError):
        WordTokenizer(["<eos>", "<unk>", "a", "a"])
    with pytest.raises(ValueError):
        WordTokenizer(["a", "<eos>", "<unk>"])


def test_token_stream_and_training_select_word(tmp_path):
    from fastweights.core.config import make_config
    from fastweights.loops.train import train

    tok = WordTokenizer.from_text(PTB_LIKE)
    stream = encode_to_file([PTB_LIKE, PTB_LIKE], tok, tmp_path / "s.bin", doc_separator=tok.eos_id)
    n = len(tok.encode(PTB_LIKE))
    assert stream.tokenizer_name == "word" and len(stream) == 2 * n + 1
    assert np.asarray(stream.tokens[:n]).tolist() == tok.encode(PTB_LIKE).tolist()

    # data.tokenizer = "word" in a run: the vocabulary comes from the training span, and the
    # checkpoint carries the tokenizer
    text = "".join(f" w{i} the cat sat \n" for i in range(200))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    cfg = make_config("tiny", [f"data.corpus={str(corpus)!r}", 'data.tokenizer="word"', "train.max_steps=2",
                               "train.seq_len=16", "train.batch_size=2", "train.eval_every=2",
                               "train.eval_tokens=64", 'train.device="cpu"'])
    summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["tokenizer"] == "word"
    saved = load_tokenizer(tmp_path / "run")
    train_text = split_corpus([Document("c", text)], "span", 0.05, 0.05)["train"][0].text
    assert isinstance(saved, WordTokenizer) and saved.words == WordTokenizer.from_text(train_text).words
    assert "w199" not in saved.words and "w0" in saved.words
