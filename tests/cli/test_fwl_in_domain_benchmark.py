"""benchmarks/quality/fwl_in_domain.py's training folders (issue 50; fastweights.experiments.in_domain_text):
other text of each scored text's author, cut into documents that never overlap, and never the scored excerpt
itself (the scored document's excerpt region is cut out, and a folder holding a line of it is refused)."""

import pytest

pytest.importorskip("transformers")

from fastweights.core.errors import UserError  # noqa: E402
from fastweights.experiments import in_domain_text as idt  # noqa: E402
from fastweights.experiments.fwl_comparison import TEXTS  # noqa: E402


def test_pieces_spread_over_the_text_end_at_paragraphs_and_never_overlap():
    text = "\n\n".join(f"paragraph {i} " + "word " * (i % 7 + 3) for i in range(3000))
    docs = idt.pieces(text, n=10, size=2000)
    assert len(docs) == 10 and all(0 < len(d) <= 2000 for d in docs)
    starts = [text.index(d) for d in docs]
    assert starts == sorted(starts) and all(b >= a + len(d) for a, b, d in zip(starts, starts[1:], docs))
    assert all(d.startswith("paragraph") for d in docs) and starts[-1] > 0.8 * len(text)
    with pytest.raises(UserError):
        idt.pieces("short text", n=10, size=2000)
    # no paragraph end inside a piece's reach: the piece is its full size (seed 18: `a - size` gave empty pieces)
    assert [len(d) for d in idt.pieces("word " * 2000, n=3, size=500)] == [499, 499, 499]


def test_a_source_holding_the_scored_text_leaves_its_excerpt_out():
    spec = next(s for s, _ in TEXTS if s.key == "don_quijote")
    text = idt.source_text("don_quijote")
    assert spec.marker not in text and len(text) > idt.PIECES * idt.PIECE_CHARS
    # a source of several documents: each stripped, joined by a blank line
    from fastweights.data import load_corpus

    docs = [d for d in load_corpus(idt.SOURCES["hamlet"][0]) if d.n_chars]
    plays = idt.source_text("hamlet")
    assert len(docs) > 2 and plays.startswith(docs[0].text.strip() + "\n\n" + docs[1].text.strip() + "\n\n")
    assert idt.SOURCES["anna_karenina"][0] != next(s for s, _ in TEXTS if s.key == "anna_karenina").document


def test_a_training_folder_with_a_line_of_its_scored_excerpt_is_refused(tmp_path):
    from fastweights.data import load_corpus

    for key in idt.SOURCES:
        (tmp_path / "data" / key).mkdir(parents=True)
        (tmp_path / "data" / key / "00.txt").write_text("nothing of the scored texts\n")
    idt.check_disjoint(tmp_path)
    spec = next(s for s, _ in TEXTS if s.key == "hamlet")
    doc = "\n".join(d.text for d in load_corpus(spec.document))
    line = next(ln for ln in doc[doc.find(spec.marker):].splitlines() if len(ln.strip()) >= 60)
    (tmp_path / "data" / "hamlet" / "01.txt").write_text("before\n" + line + "\nafter\n")
    with pytest.raises(UserError, match="hamlet"):
        idt.check_disjoint(tmp_path)


def test_a_source_that_opens_with_the_scored_excerpt_leaves_it_out(monkeypatch):
    """The excerpt's marker at the very start of its source (position 0) is found, not refused (seed-15 mutation
    draw: ``at <= 0``)."""
    import fastweights.data as data
    from fastweights.data.corpus import Document

    spec = next(s for s, _ in TEXTS if s.key == "don_quijote")
    body = spec.marker + " " + "x" * idt.EXCLUDE_CHARS + " the rest of the source"
    monkeypatch.setattr(data, "load_corpus", lambda name: [Document(name, body)])
    text = idt.source_text("don_quijote")
    assert spec.marker not in text and text.endswith("the rest of the source")
