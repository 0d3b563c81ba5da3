"""Data: corpora, splits, tokenizers and memory-mapped token streams.

Typical use (what training does)::

    docs = load_corpus("tinyshakespeare")              # or a file, a directory, a .jsonl, "hf:..."
    splits = split_corpus(docs, "span", 0.05, 0.05)    # contiguous 90/5/5, held-out text at the end
    tok = build_tokenizer("char", train_text=text_pieces(splits["train"]))
    train = cached_stream(splits["train"], tok, "runs/x/data", "train")
    x, y = train.get_batch(32, 128, torch.Generator().manual_seed(0))   # [32, 128] int64 each

Each module's docstring gives the details: ``corpus`` (loaders, lazy big files, splits),
``tokenizers`` (byte, char, word, GPT-2 BPE, fingerprints), ``streams`` (file format, streaming encode).
"""

from fastweights.data.corpus import (
    CORPORA,
    AnyDocument,
    Document,
    FileDocument,
    content_digest,
    first_chars,
    load_corpus,
    text_pieces,
    to_utf8,
)
from fastweights.data.splits import split_corpus
from fastweights.data.streams import TokenStream, cached_stream, encode_to_file
from fastweights.data.tokenizers import (
    TOKENIZER_KINDS,
    TRAINED_KINDS,
    ByteTokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    WordTokenizer,
    build_tokenizer,
    check_fingerprint,
    load_tokenizer,
)


def _register_external_corpora() -> None:
    """Register the corpora that are not shipped (``bundled.EXTERNAL``: ``ptb``) under their names, so
    ``load_corpus("ptb")`` reads them through their optional package (or names the pip command)."""
    from fastweights.data.bundled import EXTERNAL

    for name, corpus in EXTERNAL.items():
        CORPORA.setdefault(name, lambda corpus=corpus: [Document(n, t) for n, t in corpus.read()])


_register_external_corpora()

__all__ = [
    "CORPORA", "AnyDocument", "Document", "FileDocument", "content_digest", "first_chars", "load_corpus", "split_corpus",
    "text_pieces", "to_utf8", "TokenStream", "cached_stream", "encode_to_file", "TOKENIZER_KINDS",
    "TRAINED_KINDS", "ByteTokenizer", "CharTokenizer", "WordTokenizer", "GPT2Tokenizer", "Tokenizer", "build_tokenizer", "check_fingerprint",
    "load_tokenizer",
]
