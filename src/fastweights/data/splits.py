"""Splitting a corpus into train, validation and test.

Splits (``split_corpus``), both deterministic with no random state:

- ``"span"``: the documents are taken in order as one stream of characters (no separator is
  inserted between documents; token streams may add a separator *token*, see
  ``streams.encode_to_file``). The first ``1 - val - test`` of the characters are train, the next
  ``val`` are validation, the last ``test`` are test, so held-out text is the end of the corpus. A
  document that straddles a cut is split into two pieces named ``"name[a:b]"`` (character offsets).
- ``"document"``: whole documents, ranked by the SHA-256 of their name; the first
  ``round(n * test)`` (at least one when ``test > 0``) are test, the next ``round(n * val)`` are
  validation, the rest train. Needs at least 3 documents; never falls back to ``"span"``.
"""

from __future__ import annotations

import hashlib

from fastweights.core.errors import UserError
from fastweights.data.corpus import AnyDocument


def split_corpus(docs: list[AnyDocument], how: str = "span", val_fraction: float = 0.05,
                 test_fraction: float = 0.05) -> dict[str, list[AnyDocument]]:
    """Deterministic train/val/test split; returns ``{"train": [...], "val": [...], "test": [...]}``.

    ``how="span"`` cuts the character stream of all documents (in order) into contiguous train, val,
    test spans; ``how="document"`` assigns whole documents by the SHA-256 rank of their names (needs
    >= 3 documents). See the module docstring. A split whose fraction is 0 is an empty list; a
    split with a positive fraction is never empty (``UserError`` if the corpus is too small).
    """
    if how not in ("span", "document"):
        raise UserError(f"unknown split {how!r}; choose 'span' or 'document'")
    for label, f in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not (isinstance(f, (int, float)) and 0.0 <= f < 1.0):
            raise UserError(f"{label} must be in [0, 1), got {f!r}")
    if val_fraction + test_fraction >= 1.0:
        raise UserError(f"val_fraction + test_fraction must be below 1, got {val_fraction + test_fraction:g}")
    if not docs:
        raise UserError("cannot split an empty corpus")
    if how == "span":
        return _split_span(docs, val_fraction, test_fraction)
    return _split_documents(docs, val_fraction, test_fraction)


def _held_out_count(total: int, fraction: float) -> int:
    """round(total * fraction), but at least 1 when the fraction is positive."""
    return 0 if fraction == 0 else max(1, int(round(total * fraction)))


def _split_span(docs: list[AnyDocument], val_fraction: float, test_fraction: float) -> dict[str, list[AnyDocument]]:
    total = sum(d.n_chars for d in docs)
    n_val, n_test = _held_out_count(total, val_fraction), _held_out_count(total, test_fraction)
    n_train = total - n_val - n_test
    if n_train < 1:
        raise UserError(f"corpus of {total} characters is too small to split into train/val/test")
    # global character offsets where val and test begin
    cut_val, cut_test = n_train, n_train + n_val
    out: dict[str, list[AnyDocument]] = {"train": [], "val": [], "test": []}
    start = 0  # global offset of the current document's first character
    for doc in docs:
        end = start + doc.n_chars
        # a set: with val_fraction 0 both cuts coincide, and an empty piece would be a phantom document
        local_cuts = sorted({c - start for c in (cut_val, cut_test) if start < c < end})
        pieces = doc.split_at(local_cuts)
        # each piece starts at `a` (global); the split is decided by where the piece starts
        a = start
        for piece in pieces:
            label = "train" if a < cut_val else ("val" if a < cut_test else "test")
            out[label].append(piece)
            a += piece.n_chars
        start = end
    return out


def _name_rank_key(doc: AnyDocument) -> tuple[bytes, str]:
    return hashlib.sha256(doc.name.encode("utf-8", "surrogatepass")).digest(), doc.name


def _split_documents(docs: list[AnyDocument], val_fraction: float, test_fraction: float) -> dict[str, list[AnyDocument]]:
    n = len(docs)
    if n < 3:
        raise UserError(f"split 'document' needs at least 3 documents, the corpus has {n}; use split 'span'")
    n_val, n_test = _held_out_count(n, val_fraction), _held_out_count(n, test_fraction)
    if n - n_val - n_test < 1:
        raise UserError(f"split 'document': {n} documents leave none for training "
                        f"({n_val} val, {n_test} test); use split 'span' or more documents")
    order = sorted(range(n), key=lambda i: _name_rank_key(docs[i]))
    test_ids = set(order[:n_test])
    val_ids = set(order[n_test:n_test + n_val])
    # keep corpus order inside each split
    return {
        "train": [d for i, d in enumerate(docs) if i not in test_ids and i not in val_ids],
        "val": [d for i, d in enumerate(docs) if i in val_ids],
        "test": [d for i, d in enumerate(docs) if i in test_ids],
    }
