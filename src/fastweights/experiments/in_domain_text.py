"""In-domain training text for an FWL head on each scored text of the FWL comparison
(``fastweights.experiments.fwl_comparison.TEXTS``; ``benchmarks/quality/fwl_in_domain.py``): other text of the same
author (:data:`SOURCES`), never the scored text (:func:`source_text` cuts the scored excerpt out where the source
holds it, :func:`check_disjoint` refuses a folder that holds a line of it), cut at paragraph ends into documents
spread evenly over the source (:func:`pieces`): the folder a user passes to ``fastweights fwl-head train --data``."""

from __future__ import annotations

from pathlib import Path

from fastweights.core.errors import UserError
from fastweights.experiments.fwl_comparison import TEXTS

#: scored text -> (training source: a corpus spec, what it is)
SOURCES = {
    "anna_karenina": ("novels:war_and_peace_tolstoy_maude.txt", "Tolstoy, War and Peace (Maude)"),
    "hamlet": ("shakespeare-train", "Shakespeare's plays but Hamlet, Macbeth and the other held-out ones"),
    "war_and_peace_ch2": ("novels:anna_karenina_tolstoy_garnett.txt", "Tolstoy, Anna Karenina (Garnett)"),
    "don_quijote": ("don-quijote:don_quijote_cervantes.txt",
                    "Cervantes, Don Quijote, without its opening chapters (the scored text)"),
}
PIECES = 16  # documents per training folder (the recipe's 96 windows take 8 from each of the first 12)
PIECE_CHARS = 40_000  # about 9-12 windows of 1,024 SmolLM2 tokens
EXCLUDE_CHARS = 200_000  # cut after the scored excerpt's marker when the source is the scored document


def source_text(key: str) -> str:
    """The training source of scored text ``key``: its documents joined by blank lines, with the scored excerpt
    and the :data:`EXCLUDE_CHARS` characters after its marker removed when the source holds it."""
    from fastweights.data import load_corpus

    spec = SOURCES[key][0]
    text = "\n\n".join(d.text.strip() for d in load_corpus(spec) if d.n_chars)
    excerpt = next(s for s, _ in TEXTS if s.key == key)
    if excerpt.document == spec:
        at = text.find(excerpt.marker)
        if at < 0:
            raise UserError(f"{spec}: the scored excerpt's marker {excerpt.marker!r} is not in it")
        text = text[:at] + "\n\n" + text[at + EXCLUDE_CHARS:]
    return text


def pieces(text: str, n: int = PIECES, size: int = PIECE_CHARS) -> list[str]:
    """``n`` pieces of about ``size`` characters, their starts spread evenly over ``text``, each from a paragraph
    start to a paragraph end; they never overlap."""
    if len(text) < n * size:
        raise UserError(f"a source of {len(text):,} characters is too short for {n} pieces of {size:,}")
    starts = [round(i * (len(text) - size) / max(1, n - 1)) for i in range(n)]
    out, prev_end = [], 0
    for s in starts:
        a = text.find("\n\n", max(s, prev_end))
        a = max(s, prev_end) if a < 0 else a + 2
        b = text.rfind("\n\n", a, a + size)
        b = a + size if b <= a else b
        out.append(text[a:b].strip())
        prev_end = b
    return out


def check_disjoint(runs: Path) -> None:
    """UserError when a training folder holds a line of 60+ characters of its own scored excerpt."""
    from fastweights.data.excerpts import excerpt_document

    for key in SOURCES:
        spec = next(s for s, _ in TEXTS if s.key == key)
        doc = excerpt_document(spec)
        at = doc.find(spec.marker)
        lines = [ln for ln in doc[at:at + 20_000].splitlines() if len(ln.strip()) >= 60]
        for f in sorted((runs / "data" / key).glob("*.txt")):
            body = f.read_text(encoding="utf-8")
            if any(ln.strip() in body for ln in lines):
                raise UserError(f"{f}: holds a line of the scored excerpt {key!r}")
