"""Corpora, splits and token streams: loaders, user errors, lazy big files, memory-mapped batches."""

import gzip
import hashlib
import json
import sys
import types

import numpy as np
import pytest
import torch

import fastweights.data.corpus as corpus_mod
from fastweights.data import (
    ByteTokenizer,
    CharTokenizer,
    Document,
    FileDocument,
    GPT2Tokenizer,
    TokenStream,
    cached_stream,
    content_digest,
    encode_to_file,
    load_corpus,
    split_corpus,
    text_pieces,
)
from fastweights.core.errors import UserError


class CodePointTokenizer:
    """id = code point, in a vocabulary too big for uint16: distinct characters give distinct ids."""

    name = "codepoint"
    vocab_size = 1 << 17

    def encode(self, text):
        return np.array([ord(c) for c in text], dtype=np.int64)

    def decode(self, ids):
        return "".join(map(chr, ids))

    def fingerprint(self):
        return "codepoint:131072:0"


def distinct_text(n, offset=0x100):
    return "".join(chr(offset + i) for i in range(n))


def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


# ---------------------------------------------------------------------------------- loaders


def test_bundled_tinyshakespeare():
    docs = load_corpus("tinyshakespeare")
    assert len(docs) == 1 and docs[0].name == "tinyshakespeare" and docs[0].n_chars == 1_115_394
    digest = hashlib.sha256(docs[0].text.encode("utf-8")).hexdigest()
    assert digest == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def test_load_text_file_and_gzip(tmp_path):
    f = write(tmp_path / "a.txt", "\ufeffhello é\n")  # a byte-order mark is dropped
    docs = load_corpus(str(f))
    assert docs == [Document("a.txt", "hello é\n")]
    g = tmp_path / "b.txt.gz"
    g.write_bytes(gzip.compress("zipped ñ".encode("utf-8")))
    assert load_corpus(str(g)) == [Document("b.txt.gz", "zipped ñ")]


def test_load_directory_recursive_sorted(tmp_path):
    write(tmp_path / "b.txt", "B")
    write(tmp_path / "a" / "z.txt", "AZ")
    write(tmp_path / "a" / "y.txt", "")  # empty documents are dropped
    write(tmp_path / "notes.md", "ignored: not .txt")
    docs = load_corpus(str(tmp_path))
    assert [(d.name, d.text) for d in docs] == [("a/z.txt", "AZ"), ("b.txt", "B")]


def test_load_jsonl(tmp_path):
    rows = [{"text": "first", "id": 1}, {"text": "second ü"}, {"body": "x", "text": "third"}]
    f = write(tmp_path / "c.jsonl", "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n")
    docs = load_corpus(str(f))
    assert [(d.name, d.text) for d in docs] == [("c.jsonl:1", "first"), ("c.jsonl:2", "second ü"), ("c.jsonl:3", "third")]
    f2 = write(tmp_path / "d.jsonl", json.dumps({"body": "in body"}) + "\n")
    assert load_corpus(str(f2), text_field="body")[0].text == "in body"
    # JSON escapes may encode a lone surrogate; without the check it becomes U+FFFD, pairs stay whole
    f3 = write(tmp_path / "e.jsonl", '{"text": "a\\ud83db \\ud83d\\ude00"}\n')
    assert load_corpus(str(f3), encoding_check=False)[0].text == "a\ufffdb \U0001F600"


@pytest.mark.parametrize("content, pattern", [
    ('{"text": "ok"}\n{"body": "x"}\n', r"d\.jsonl line 2: no field 'text' \(has: body\)"),
    ('{"text": "ok"}\n{"text": \n', r"d\.jsonl line 2: invalid JSON"),
    ('{"text": 5}\n', r"d\.jsonl line 1: field 'text' is int, not a string"),
    ('{"text": "broken \\ud83d emoji"}\n', r"d\.jsonl line 1: invalid Unicode \(lone surrogate U\+D83D"),
])
def test_jsonl_errors(tmp_path, content, pattern):
    f = write(tmp_path / "d.jsonl", content)
    with pytest.raises(UserError, match=pattern):
        load_corpus(str(f))


def test_missing_and_empty_corpora(tmp_path):
    with pytest.raises(UserError, match="no such file or directory, and not a registered corpus"):
        load_corpus(str(tmp_path / "nope.txt"))
    with pytest.raises(UserError, match="empty"):
        load_corpus(str(write(tmp_path / "empty.txt", "")))
    (tmp_path / "d").mkdir()
    with pytest.raises(UserError, match="no .txt files"):
        load_corpus(str(tmp_path / "d"))
    write(tmp_path / "d" / "x.txt", "")
    with pytest.raises(UserError, match="empty"):
        load_corpus(str(tmp_path / "d"))
    with pytest.raises(UserError, match="no documents"):
        load_corpus(str(write(tmp_path / "blank.jsonl", "\n\n")))


@pytest.mark.parametrize("lazy", [False, True])
def test_invalid_utf8_names_file_and_byte_offset(tmp_path, monkeypatch, lazy):
    monkeypatch.setattr(corpus_mod, "READ_BYTES", 5)  # lazy reads cross the bad byte's neighbourhood
    data = "añb€c".encode("utf-8") + b"\xff" + b"rest"  # "añb€c" is 8 bytes: the bad byte is at offset 8
    f = write(tmp_path / "bad.txt", data)
    with pytest.raises(UserError, match=r"bad\.txt: not valid UTF-8 at byte offset 8 \(bytes ff"):
        load_corpus(str(f), lazy_bytes=0 if lazy else 1 << 30)
    # a truncated multi-byte character that straddles two reads
    f2 = write(tmp_path / "cut.txt", b"abcd\xe2\x82" + b"xyz")
    with pytest.raises(UserError, match=r"cut\.txt: not valid UTF-8 at byte offset 4 "):
        load_corpus(str(f2), lazy_bytes=0 if lazy else 1 << 30)


@pytest.mark.parametrize("lazy", [False, True])
def test_without_encoding_check_bad_bytes_are_kept(tmp_path, lazy):
    data = b"caf\xe9 \xff ok \xe2\x82\xac"
    f = write(tmp_path / "latin1.txt", data)
    (doc,) = load_corpus(str(f), encoding_check=False, lazy_bytes=0 if lazy else 1 << 30)
    assert ByteTokenizer().encode(doc.text).tolist() == list(data)
    assert np.array_equal(np.concatenate([GPT2Tokenizer().encode(p) for p in doc.pieces()]),
                          GPT2Tokenizer().encode(doc.text))
    assert GPT2Tokenizer().decode(GPT2Tokenizer().encode(doc.text)) == data.decode("utf-8", "replace")


def test_hf_needs_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # "import datasets" raises ImportError
    with pytest.raises(UserError, match=r"needs the Hugging Face `datasets` package"):
        load_corpus("hf:wikitext:wikitext-2-raw-v1:test")
    with pytest.raises(UserError, match="expected hf:<dataset>"):
        load_corpus("hf:")


def test_hf_loader_with_a_stand_in_datasets_module(monkeypatch):
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        if name == "offline":
            raise ConnectionError("Couldn't reach the Hub\nmore detail")
        return [{"text": "row zero"}, {"text": ""}, {"text": "row two"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(corpus_mod, "_hub_unreachable", lambda: None)  # as with network
    docs = load_corpus("hf:wikitext:wikitext-2-raw-v1:test")
    assert [(d.name, d.text) for d in docs] == [("wikitext/test:0", "row zero"), ("wikitext/test:2", "row two")]
    load_corpus("hf:tiny::validation")
    assert calls[1] == ("tiny", None, "validation")
    with pytest.raises(UserError, match="no field 'body'"):
        load_corpus("hf:wikitext", text_field="body")
    with pytest.raises(UserError, match="could not load Hugging Face dataset 'offline'.*Couldn't reach the Hub$"):
        load_corpus("hf:offline")


def test_hf_dataset_without_network_fails_at_once_or_reads_the_cache(monkeypatch):
    """No network (the hub's host does not answer): datasets runs in offline mode, so a cached dataset still loads
    and an uncached one fails in one line at once, not after minutes of retries (issue 39)."""
    import socket

    seen = []

    def load_dataset(name, config, split):
        from huggingface_hub import constants

        seen.append(constants.HF_HUB_OFFLINE)
        if name == "cached":
            return [{"text": "from the cache"}]
        raise ConnectionError("Couldn't reach 'missing' on the Hub (LocalEntryNotFoundError)")

    def no_network(*a, **k):
        raise OSError(-2, "Name or service not known")

    pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(socket, "create_connection", no_network)
    assert [d.text for d in load_corpus("hf:cached")] == ["from the cache"]
    with pytest.raises(UserError, match="'missing'.*is not in the local cache, and huggingface.co cannot be reached"):
        load_corpus("hf:missing")
    assert seen == [True, True] and constants.HF_HUB_OFFLINE is False  # offline inside the call only


# ---------------------------------------------------------------------------------- lazy files


@pytest.fixture
def multibyte_file(tmp_path):
    text = "".join(f"línea {i}: ñ€😀 {'x' * (i % 7)}\n" for i in range(3000))
    return write(tmp_path / "big.txt", "\ufeff" + text), text


def test_lazy_file_document_matches_eager(multibyte_file, monkeypatch):
    monkeypatch.setattr(corpus_mod, "READ_BYTES", 1000)  # many reads, characters cut between them
    path, text = multibyte_file
    (lazy,) = load_corpus(str(path), lazy_bytes=0)
    (eager,) = load_corpus(str(path))
    assert isinstance(lazy, FileDocument) and isinstance(eager, Document)
    assert lazy.n_chars == eager.n_chars == len(text) and lazy.text == text
    assert "".join(lazy.pieces(500)) == text
    cuts = [0, 1, 12345, 40000, len(text)]
    assert [d.text for d in lazy.split_at(cuts)] == [d.text for d in eager.split_at(cuts)]
    assert content_digest([lazy]) == content_digest([eager]) == content_digest([text])
    lazy_split, eager_split = split_corpus([lazy], "span"), split_corpus([eager], "span")
    assert all(isinstance(d, FileDocument) for v in lazy_split.values() for d in v)
    assert ({k: [(d.name, d.text) for d in v] for k, v in lazy_split.items()}
            == {k: [(d.name, d.text) for d in v] for k, v in eager_split.items()})


def test_encode_multi_megabyte_file_streaming(tmp_path, monkeypatch):
    """A few MB encoded from disk in small pieces gives exactly the tokens of the whole text."""
    line = "Ünïcödé line with € and 😀, number {}.\n"
    text = "".join(line.format(i) for i in range(80_000))  # ~3.3 M characters, ~4 MB of UTF-8
    path = write(tmp_path / "big.txt", text)
    (doc,) = load_corpus(str(path), lazy_bytes=1 << 20)
    assert isinstance(doc, FileDocument) and path.stat().st_size > 3_000_000
    byte_stream = encode_to_file([doc], ByteTokenizer(), tmp_path / "bytes.bin", piece_chars=100_000)
    assert byte_stream.tokens.dtype == np.uint16
    assert np.array_equal(byte_stream.tokens, np.frombuffer(path.read_bytes(), dtype=np.uint8))
    char = CharTokenizer.from_text(text_pieces([doc], 100_000))
    char_stream = encode_to_file([path], char, tmp_path / "chars.bin", piece_chars=100_000)  # a path works too
    assert np.array_equal(char_stream.tokens, char.encode(text))
    assert char.decode(char_stream.tokens[-len(line) - 4:]) == text[-len(line) - 4:]


# ---------------------------------------------------------------------------------- splits


def test_span_split_sizes_order_and_contiguity():
    text = distinct_text(1000)
    out = split_corpus([Document("t", text)], "span", 0.05, 0.1)
    joined = {k: "".join(d.text for d in v) for k, v in out.items()}
    assert (len(joined["train"]), len(joined["val"]), len(joined["test"])) == (850, 50, 100)
    assert joined["train"] + joined["val"] + joined["test"] == text  # held-out text is the end
    assert [d.name for d in out["test"]] == ["t[900:1000]"]
    assert split_corpus([Document("t", text)], "span", 0.05, 0.1) == out  # deterministic


def test_span_split_across_documents():
    docs = [Document("a", "a" * 60), Document("b", "b" * 30), Document("c", "c" * 10)]
    out = split_corpus(docs, "span", 0.2, 0.1)  # 100 chars: train 70, val 20, test 10
    assert [(d.name, d.n_chars) for d in out["train"]] == [("a", 60), ("b[0:10]", 10)]
    assert [(d.name, d.n_chars) for d in out["val"]] == [("b[10:30]", 20)]
    assert [(d.name, d.n_chars) for d in out["test"]] == [("c", 10)]
    assert split_corpus(docs, "span", 0.0, 0.0) == {"train": docs, "val": [], "test": []}


def test_document_split_is_deterministic_disjoint_and_order_free():
    docs = [Document(f"doc{i:03d}.txt", f"text {i}") for i in range(40)]
    out = split_corpus(docs, "document", 0.1, 0.1)
    names = {k: [d.name for d in v] for k, v in out.items()}
    assert (len(names["train"]), len(names["val"]), len(names["test"])) == (32, 4, 4)
    assert sorted(sum(names.values(), [])) == sorted(d.name for d in docs)  # disjoint and complete
    reversed_out = split_corpus(docs[::-1], "document", 0.1, 0.1)
    assert {k: sorted(d.name for d in v) for k, v in reversed_out.items()} == {k: sorted(v) for k, v in names.items()}
    three = split_corpus(docs[:3], "document", 0.05, 0.05)
    assert [len(three[k]) for k in ("train", "val", "test")] == [1, 1, 1]


@pytest.mark.parametrize("docs, kwargs, pattern", [
    ([Document("a", "x"), Document("b", "y")], {"how": "document"}, "needs at least 3 documents, the corpus has 2"),
    ([Document("a", "xyz")], {"how": "random"}, "unknown split 'random'"),
    ([Document("a", "xyz")], {"val_fraction": 0.6, "test_fraction": 0.5}, "must be below 1"),
    ([Document("a", "xyz")], {"val_fraction": -0.1}, r"val_fraction must be in \[0, 1\)"),
    ([Document("a", "xy")], {}, "too small to split"),
    ([], {}, "empty corpus"),
])
def test_split_errors(docs, kwargs, pattern):
    with pytest.raises(UserError, match=pattern):
        split_corpus(docs, **kwargs)


# ---------------------------------------------------------------------------------- streams


@pytest.fixture
def stream(tmp_path):
    return encode_to_file([distinct_text(300), distinct_text(200, offset=0x1000)], CodePointTokenizer(),
                          tmp_path / "s.bin", doc_separator=7)


def test_stream_file_format(stream, tmp_path):
    assert stream.tokens.dtype == np.uint32  # vocabulary above 65,536
    assert len(stream) == 501 and stream.doc_offsets.tolist() == [0, 301]
    assert stream.tokens[300] == 7 and stream.tokens[301] == 0x1000
    meta = json.loads((tmp_path / "s.bin.json").read_text())
    assert meta["length"] == 501 and meta["tokenizer_fingerprint"] == "codepoint:131072:0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin", "s.bin.json"]  # no temporary files left
    assert encode_to_file(["ab"], ByteTokenizer(), tmp_path / "b.bin").tokens.dtype == np.uint16


def test_get_batch_windows_shift_and_bounds(stream):
    tokens = np.asarray(stream.tokens, dtype=np.int64)
    position = {int(t): i for i, t in enumerate(tokens)}  # every token but the separator is unique
    x, y = stream.get_batch(16, 20, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (16, 20) and x.dtype == y.dtype == torch.int64
    for row_x, row_y in zip(x, y):
        start = position[int(row_x[0])] if int(row_x[0]) != 7 else position[int(row_x[1])] - 1
        assert row_x.tolist() == tokens[start:start + 20].tolist()
        assert row_y.tolist() == tokens[start + 1:start + 21].tolist()
    again = stream.get_batch(16, 20, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], x) and torch.equal(again[1], y)
    x_full, _ = stream.get_batch(64, 500, torch.Generator().manual_seed(1))  # the only window: start 0
    assert (x_full[:, 0] == int(tokens[0])).all()
    with pytest.raises(UserError, match="has 501 tokens, fewer than"):
        stream.get_batch(1, 501, torch.Generator())


def test_iter_chunks_cover_the_stream_exactly_once(stream):
    tokens = torch.as_tensor(np.asarray(stream.tokens, dtype=np.int64))
    chunks = list(stream.iter_chunks(64))
    assert [x.shape[1] for x, _ in chunks] == [64] * 7 + [500 - 7 * 64]
    assert all(x.shape[0] == 1 and x.dtype == torch.int64 for x, _ in chunks)
    assert torch.equal(torch.cat([x for x, _ in chunks], 1)[0], tokens[:-1])
    assert torch.equal(torch.cat([y for _, y in chunks], 1)[0], tokens[1:])


def test_open_errors(stream, tmp_path):
    with pytest.raises(UserError, match="missing s2.bin"):
        TokenStream.open(tmp_path / "s2.bin")
    with pytest.raises(UserError, match="was made with tokenizer codepoint:131072:0"):
        TokenStream.open(stream.path, ByteTokenizer())
    side = tmp_path / "s.bin.json"
    meta = json.loads(side.read_text())
    side.write_text(json.dumps({**meta, "length": 500}))
    with pytest.raises(UserError, match="delete it to re-encode"):
        TokenStream.open(stream.path)
    side.write_text("{")
    with pytest.raises(UserError, match="corrupt"):
        TokenStream.open(stream.path)


def test_failed_encode_leaves_nothing(tmp_path):
    class Failing(CodePointTokenizer):
        def encode(self, text):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        encode_to_file(["abc"], Failing(), tmp_path / "f.bin")
    assert list(tmp_path.iterdir()) == []


def test_cached_stream_reuses_and_rekeys(tmp_path, monkeypatch):
    docs = [Document("a", "hello there"), Document("b", "general kenobi")]
    first = cached_stream(docs, ByteTokenizer(), tmp_path, "train")
    deep = cached_stream(docs, ByteTokenizer(), tmp_path / "a" / "b", "train")  # a folder not there yet: made
    assert deep.path.parent == tmp_path / "a" / "b" and deep.path.is_file()
    assert first.path.name.startswith("train-") and len(first) == len("hello there") + len("general kenobi")

    def must_not_encode(*args, **kwargs):
        raise AssertionError("re-encoded a cached stream")

    monkeypatch.setattr("fastweights.data.streams.encode_to_file", must_not_encode)
    renamed = [Document("x", "hello there"), Document("y", "general kenobi")]  # names do not count
    assert cached_stream(renamed, ByteTokenizer(), tmp_path, "train").path == first.path
    monkeypatch.undo()
    char = CharTokenizer.from_text("hello there general kenobi")
    moved = [Document("a", "hello theregeneral"), Document("b", " kenobi")]  # same text, other boundaries
    paths = {first.path, cached_stream(docs, char, tmp_path, "train").path,
             cached_stream(moved, ByteTokenizer(), tmp_path, "train").path,
             cached_stream(docs, ByteTokenizer(), tmp_path, "train", doc_separator=0).path}
    assert len(paths) == 4
    first.path.write_bytes(b"\x00")  # a damaged entry is rebuilt
    assert np.array_equal(cached_stream(docs, ByteTokenizer(), tmp_path, "train").tokens,
                          np.frombuffer(b"hello theregeneral kenobi", dtype=np.uint8))


def test_the_hubs_reachability_is_asked_with_a_timeout(monkeypatch):
    """The check before an uncached dataset is read gives up after its timeout: without one, a network that drops
    packets would hang the command for the system's connect timeout (minutes). Mutation caught: the timeout
    dropped from ``socket.create_connection``."""
    import socket

    pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    calls = []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "create_connection", lambda address, **kw: calls.append(kw) or socket.socket())
    assert corpus_mod._hub_unreachable() is None
    assert calls and 0 < calls[0].get("timeout", 0) <= 30, calls


def test_a_split_fraction_of_one_is_refused():
    from fastweights.data.corpus import Document

    docs = [Document("a", "text " * 100)]
    for val, test, label in ((1.0, 0.0, "val_fraction"), (0.0, 1.0, "test_fraction")):
        with pytest.raises(UserError) as e:
            split_corpus(docs, "span", val, test)
        assert str(e.value) == f"{label} must be in [0, 1), got 1.0"


def test_a_document_named_with_an_undecodable_byte_still_has_its_rank():
    """A file name that is not UTF-8 reaches Python with a lone surrogate (os.fsdecode): the document split still
    hashes it (seed-16 mutation draw: the error handler's name misspelt, a LookupError on such a name only)."""
    import hashlib

    from fastweights.data.corpus import Document
    from fastweights.data.splits import _name_rank_key

    name = "caf\udce9.txt"
    assert _name_rank_key(Document(name, "text")) == (hashlib.sha256(b"caf\xed\xb3\xa9.txt").digest(), name)
