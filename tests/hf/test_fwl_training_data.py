"""The training text of ``fwl-head train`` (``hf.fwl_training.training_windows``, issue 41): the default mix is
English long documents with none the comparison scores or tunes on; user data is read as ``--data`` elsewhere,
with one warning when it holds a compared text; documents give consecutive windows in order."""

import warnings

import numpy as np
import pytest

from fastweights.hf.fwl_training import HELD_OUT_NAMES, TRAINING_MIX, training_windows


class Chars:
    """A character tokenizer (one id per character): the windows without a model."""

    def encode(self, text):
        return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)


def test_the_default_mix_is_english_long_documents_without_a_compared_text():
    """Mutation caught: a held-out document (or Spanish text) let into the default mix."""
    text = training_windows(Chars(), 2048, max_windows=60, doc_windows=4)
    corpora = {s.split(":")[0] for s in text.sources}
    assert corpora == set(TRAINING_MIX) and "bible-es" not in corpora and "novels" not in TRAINING_MIX
    assert not any(n in s.lower() for s in text.sources for n in HELD_OUT_NAMES)
    assert sum(text.doc_windows) == len(text.tokens) == 60 and max(text.doc_windows) == 4
    every = training_windows(Chars(), 64, max_windows=None, doc_windows=1)  # one window of every document of the mix
    assert not any(n in s.lower() for s in every.sources for n in HELD_OUT_NAMES)


def test_a_documents_windows_are_consecutive(tmp_path):
    """Each document gives its first windows in order, at most doc_windows, a short one none. Mutation caught:
    windows taken from every other stretch of the document (the carried state would join unrelated text)."""
    (tmp_path / "a.txt").write_text("".join(chr(65 + i % 26) for i in range(1000)))
    (tmp_path / "b.txt").write_text("short")
    (tmp_path / "c.txt").write_text("xyz" * 100)
    text = training_windows(Chars(), 100, str(tmp_path), doc_windows=4)
    assert text.doc_windows == [4, 3]
    a = Chars().encode((tmp_path / "a.txt").read_text())
    np.testing.assert_array_equal(text.tokens[:4].ravel(), a[:400])
    assert text.tokens.dtype == np.int64  # whatever integer type a tokenizer returns (uint16 here): int64 windows
    narrow = training_windows(type("Narrow", (), {"encode": lambda self, t: Chars().encode(t).astype(np.uint16)})(),
                              100, str(tmp_path), doc_windows=4)
    assert narrow.tokens.dtype == np.int64 and np.array_equal(narrow.tokens, text.tokens)
    assert text.sources[:5] == ["%s:a.txt#%d" % (tmp_path, i) for i in range(4)] + [f"{tmp_path}:c.txt#0"]


def test_one_long_file_gives_runs_of_consecutive_windows_until_the_windows_are_filled(tmp_path):
    """Issue 49: ``--data`` one file gave its first doc_windows windows and nothing more (8 of 96 cached, 4 trained
    on). Mutation caught: a document giving one run only."""
    (tmp_path / "a.txt").write_text("".join(chr(65 + i % 26) for i in range(1000)))  # 10 windows of 100
    (tmp_path / "b.txt").write_text("b" * 300)  # 3 windows
    text = training_windows(Chars(), 100, str(tmp_path / "a.txt"), max_windows=10, doc_windows=4)
    assert text.doc_windows == [4, 4, 2]
    a = Chars().encode((tmp_path / "a.txt").read_text())
    np.testing.assert_array_equal(text.tokens.ravel(), a)
    assert text.sources == ["%s:a.txt#%d" % (tmp_path / "a.txt", i) for i in range(10)]
    both = training_windows(Chars(), 100, str(tmp_path), max_windows=12, doc_windows=4)
    assert both.doc_windows == [4, 3, 4, 1]  # each document's first run, then the next run of those with more
    assert [s.rsplit(":", 1)[1] for s in both.sources] == [f"a.txt#{i}" for i in range(4)] + \
        [f"b.txt#{i}" for i in range(3)] + [f"a.txt#{i}" for i in range(4, 9)]
    assert training_windows(Chars(), 100, str(tmp_path), doc_windows=4).doc_windows == [4, 3]  # no limit: one run


def test_text_with_no_document_of_a_window_is_one_line_naming_it(tmp_path):
    """Seed 18: the message replaced by None survived."""
    from fastweights.core.errors import UserError

    (tmp_path / "a.txt").write_text("short")
    with pytest.raises(UserError, match=r"^the training text \(%s\) holds no document of 100 tokens or more$"
                       % tmp_path):
        training_windows(Chars(), 100, str(tmp_path), doc_windows=4)


def test_a_long_files_later_runs_are_tokenized_once(tmp_path):
    """The runs after the first read the ids one encoding made for all of them (not the growing prefix once per
    run, quadratic in a long file)."""
    (tmp_path / "a.txt").write_text("".join(chr(65 + i % 26) for i in range(30000)))  # 300 windows of 100
    calls = []

    class Counting(Chars):
        def encode(self, text):
            calls.append(len(text))
            return super().encode(text)

    text = training_windows(Counting(), 100, str(tmp_path / "a.txt"), max_windows=20, doc_windows=4)
    assert text.doc_windows == [4] * 5 and len(calls) == 2
    np.testing.assert_array_equal(text.tokens.ravel(), Chars().encode((tmp_path / "a.txt").read_text())[:2000])


def test_user_data_holding_a_compared_text_is_trained_on_with_one_warning(tmp_path):
    (tmp_path / "anna_karenina.txt").write_text("x" * 500)
    (tmp_path / "mine.txt").write_text("y" * 500)
    with pytest.warns(UserWarning, match="anna_karenina") as record:
        text = training_windows(Chars(), 100, str(tmp_path))
    assert len(record) == 1 and text.doc_windows == [5, 5]
    (tmp_path / "anna_karenina.txt").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        training_windows(Chars(), 100, str(tmp_path))


def test_round_robin_takes_each_iterator_in_turn_until_all_run_out():
    from fastweights.hf.fwl_training import round_robin

    assert list(round_robin([iter("abc"), iter("x"), iter("12")])) == ["a", "x", "1", "b", "2", "c"]
    assert list(round_robin([])) == [] and list(round_robin([iter(())])) == []
