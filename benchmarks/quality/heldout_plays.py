"""The held-out text that benchmarks/quality/leaderboard.py and benchmarks/quality/fast_rnn_sweep.py score: whole plays that
``shakespeare-train`` leaves out, read at batch 1 in calls of ``STRIDE`` characters, with windows of
``SEQ_LEN`` characters (the presets' training length)."""

from __future__ import annotations

HELDOUT = ("hamlet_gut.txt", "julius_caesar_gut.txt", "macbeth_gut.txt", "othello_gut.txt")
STRIDE = 64
SEQ_LEN = 128  # the presets' training length: the windows of ``eval --stream``'s "windows" mode


def heldout_documents(tokenizer, chars: int):
    """``(name, blocks)`` of the first ``chars`` characters of each held-out play (``encode_documents``)."""
    from fastweights.data import load_corpus
    from fastweights.data.corpus import Document
    from fastweights.experiments.streaming import encode_documents

    docs = [load_corpus(f"shakespeare-heldout:{name}")[0] for name in HELDOUT]
    return encode_documents([Document(d.name, d.text[:chars]) for d in docs], tokenizer)
