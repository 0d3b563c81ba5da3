"""Token excerpts of bundled documents, named ``CORPUS:DOCUMENT@MARKER``: the texts the pretrained-model
comparisons (``benchmarks/quality/smollm2_dynamic_eval.py``, ``fwl_smollm2.py``, ``benchmarks/speed/fwl_scoring.py``,
``benchmarks/gpu/fwl_smollm2_gpu.py``) score, tune on and take gradient statistics from.

    rows = parse_excerpts(default_excerpts("scored"), "scored")     # [ExcerptSpec], the bundled scored texts
    ids, info = token_excerpt(tok, rows[0], predictions=4096)      # [4097] ids from the marker, and their source

An excerpt starts at the first occurrence of its marker (the document's start without one) and holds
``predictions + 1`` tokens of the tokenizer given; ``info`` names the document, its digest and where the
excerpt starts and ends, so a result says exactly which tokens it scored.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

import torch

from fastweights.core.errors import UserError
from fastweights.data.corpus import load_corpus, to_utf8


class ExcerptSpec(NamedTuple):
    """One excerpt: ``key`` (a result's field name), ``short`` and full ``title``, ``document``
    (``CORPUS:DOCUMENT`` of a registered corpus), start ``marker`` ("" = the document's start) and ``role``
    ("scored", "validation" = tuning, or "statistics")."""

    key: str
    short: str
    title: str
    document: str
    marker: str
    role: str


#: the bundled excerpts (none of their documents is in the FWL head's training mix: ``hf.fwl_training.HELD_OUT_NAMES``)
BUNDLED_EXCERPTS = (
    ExcerptSpec("anna_karenina", "Anna Karenina", "Tolstoy, Anna Karenina (Garnett translation)",
                "novels:anna_karenina_tolstoy_garnett.txt", "Happy families are all alike", "scored"),
    ExcerptSpec("hamlet", "Hamlet", "Shakespeare, Hamlet", "shakespeare-heldout:hamlet_gut.txt", "ACT I.\n", "scored"),
    ExcerptSpec("don_quijote", "Don Quijote (Spanish)", "Cervantes, Don Quijote (Spanish)",
                "don-quijote:don_quijote_cervantes.txt", "En un lugar de la Mancha", "scored"),
    ExcerptSpec("crime_and_punishment_part3", "Crime and Punishment",
                "Dostoevsky, Crime and Punishment (Garnett), from Part III",
                "novels:crime_and_punishment_dostoevsky_garnett.txt", "PART III\n", "validation"),
    ExcerptSpec("macbeth_act3", "Macbeth", "Shakespeare, Macbeth, from Act III", "shakespeare-heldout:macbeth_gut.txt",
                "ACT III.\n", "validation"),
    ExcerptSpec("war_and_peace_ch2", "War and Peace", "Tolstoy, War and Peace (Maude), from Chapter II",
                "novels:war_and_peace_tolstoy_maude.txt", "CHAPTER II\n", "statistics"),
)


def bundled_excerpt(key: str) -> ExcerptSpec:
    """The bundled excerpt called ``key`` (a :data:`BUNDLED_EXCERPTS` key)."""
    for row in BUNDLED_EXCERPTS:
        if row.key == key:
            return row
    raise UserError(f"no bundled excerpt {key!r} (there are {', '.join(r.key for r in BUNDLED_EXCERPTS)})")


def default_excerpts(role: str) -> str:
    """The bundled excerpts of ``role`` as a ``--data`` value: ``CORPUS:DOCUMENT@MARKER,...`` (newline written \\n)."""
    return ",".join(f"{r.document}@{r.marker}".replace("\n", "\\n") for r in BUNDLED_EXCERPTS if r.role == role)


def parse_excerpts(value: str, role: str) -> list[ExcerptSpec]:
    """``CORPUS:DOCUMENT[@MARKER],...`` -> excerpts of ``role``; the bundled ones keep their key and titles, any
    other document of the registry gets a key from its file name (``text`` when it has no letter or digit;
    ``\\n`` in a marker is a newline)."""
    rows = []
    for item in [v.strip() for v in value.split(",") if v.strip()]:
        document, _, marker = item.partition("@")
        marker = marker.replace("\\n", "\n")
        known = [r for r in BUNDLED_EXCERPTS if r.document == document and r.marker == marker]
        if known:
            rows.append(known[0]._replace(role=role))
            continue
        doc = document.rpartition(":")[2] or document
        key = "".join(c if c.isalnum() else "_" for c in Path(doc).stem.lower()).strip("_") or "text"
        key = key if marker == "" else f"{key}_{len(rows)}"
        title = document + (f" from {marker.strip()!r}" if marker else "")
        rows.append(ExcerptSpec(key, Path(doc).stem, title, document, marker, role))
    if not rows:
        raise UserError(f"no {role} text named (expected CORPUS:DOCUMENT[@MARKER],...)")
    return rows


def excerpt_document(spec: ExcerptSpec) -> str:
    """The text of the one document ``spec`` names (``CORPUS:DOCUMENT``), whole."""
    (doc,) = load_corpus(spec.document)
    return doc.text


def token_excerpt(tok, spec: ExcerptSpec, predictions: int) -> tuple[torch.Tensor, dict]:
    """``predictions`` + 1 token ids (``[predictions + 1]`` int64) of ``spec``'s document from its marker, cut by
    ``tok`` (anything with ``encode`` and ``decode``), and where they come from (``info``)."""
    text = excerpt_document(spec)
    start = text.find(spec.marker) if spec.marker else 0
    if start < 0:
        raise UserError(f"{spec.document}: start marker {spec.marker!r} not found")
    need = predictions + 1
    span = 8 * need  # characters: more than enough for `need` tokens, so the slice end never touches them
    ids = tok.encode(text[start : start + span])
    if len(ids) <= need:
        raise UserError(f"{spec.document}: fewer than {need} tokens after {spec.marker!r}")
    ids = torch.as_tensor(ids[:need], dtype=torch.long)
    chars = len(tok.decode(ids.tolist()))
    info = {"title": spec.title, "document": spec.document, "sha256": hashlib.sha256(to_utf8(text)).hexdigest(),
            "role": spec.role, "start_marker": spec.marker, "start_char": start, "file_chars": len(text),
            "tokens": need, "predictions": predictions, "ids_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
            "chars_decoded": chars, "chars_per_token": chars / need, "first_words": text[start : start + 80],
            "last_words": tok.decode(ids[-20:].tolist())}
    return ids, info
