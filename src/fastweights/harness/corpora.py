"""The documents of the local harness tasks (``harness/tasks/*.yaml``): excerpts of the corpora shipped in
the package, read offline (no ``datasets`` download, no hub)."""

from __future__ import annotations


def excerpt(text: str, chars: int, start: str | None = None) -> str:
    """``chars`` characters of ``text`` from the first occurrence of ``start`` (from the beginning without one;
    a ``start`` that does not occur is an error, not a silent change of text)."""
    at = 0
    if start:
        at = text.find(start)
        if at < 0:
            raise ValueError(f"start marker {start!r} not found")
    return text[at:at + int(chars)]


def documents(corpus: str, names: list[str], chars: int, start: str | None = None) -> list[dict]:
    """``[{"name", "text"}]``: an excerpt of each named document of a bundled corpus, in the order given."""
    from fastweights.data import load_corpus

    docs = {d.name: d.text for d in load_corpus(corpus)}
    missing = [n for n in names if n not in docs]
    if missing:
        raise ValueError(f"corpus {corpus!r} has no document {missing[0]!r} (it has {sorted(docs)})")
    return [{"name": n, "text": excerpt(docs[n], chars, start)} for n in names]


def load(corpus: str, names: list[str], chars: int, start: str | None = None, **_metadata):
    """lm-eval's ``custom_dataset``: a DatasetDict with one ``test`` split of :func:`documents`."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(documents(corpus, list(names), chars, start))})
