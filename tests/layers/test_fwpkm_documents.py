"""``experiments.fwpkm_documents.score_documents`` (the long-document FwPKM benchmark's scoring, moved into the
library): each document from a fresh state, its bits per char before and after EARLY characters adding up to the
whole, the reads recorded per memory layer when asked, and frozen memories scoring as the model without writes."""

import math

import pytest

import torch

from fastweights.data import CharTokenizer
from fastweights.data.corpus import Document
from fastweights.experiments.fwpkm_documents import EARLY, memory_layers, score_documents
from fastweights.loops.evaluate import score_tokens
from helpers import tiny_lm

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 30


def _model(tok):
    fw = dict(n_subkeys=6, d_key=8, d_value=8, topk=2, chunk_size=16)
    return tiny_lm(tok.vocab_size, memory="fwpkm", memory_layers=[1], options={"fwpkm": fw}).eval()


def test_each_document_is_scored_alone_and_its_parts_add_up():
    tok = CharTokenizer.from_text(TEXT)
    model = _model(tok)
    docs = [Document("long", TEXT[:EARLY + 300]), Document("short", TEXT[:500])]
    out, reads = score_documents(model, tok, docs, seq_len=64, frozen=False, record=False)
    assert reads == [] and [d["doc"] for d in out["per_document"]] == ["long", "short"]
    assert out["tokens"] == (EARLY + 299) + 499 == sum(d["tokens"] for d in out["per_document"])
    first = score_tokens(model, torch.tensor(tok.encode(docs[1].text)), 64, 32, keep_token_losses=True)[0]
    assert math.isclose(out["per_document"][1]["bits_per_char"], first.loss / math.log(2), rel_tol=1e-6)  # fresh state
    early_n, late_n = (EARLY - 1) + 499, 300
    whole = (out["bits_per_char_first_2048"] * early_n + out["bits_per_char_after_2048"] * late_n) / (early_n + late_n)
    assert math.isclose(whole, out["bits_per_char"], rel_tol=1e-6)
    assert math.isclose(out["perplexity_per_char"], 2 ** out["bits_per_char"], rel_tol=1e-12)


def test_frozen_memories_are_not_written_and_reads_are_recorded_per_layer():
    tok = CharTokenizer.from_text(TEXT)
    model = _model(tok)
    docs = [Document("a", TEXT[:400])]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    frozen, reads = score_documents(model, tok, docs, seq_len=64, frozen=True, record=True)
    written, _ = score_documents(model, tok, docs, seq_len=64, frozen=False, record=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # scoring never changes weights
    assert frozen["bits_per_char"] != written["bits_per_char"]  # the writes within a document matter
    assert frozen["bits_per_char_after_2048"] is None  # a document shorter than EARLY
    (per_layer,) = reads  # one document
    assert len(per_layer) == len(memory_layers(model)) == 1
    indices, gates = per_layer[0]
    assert indices.shape[0] == 399 and gates.shape[0] == 399
    assert all(not m.record_reads and m.read_log == [] for m in memory_layers(model))  # logging switched off after


def test_addressing_pools_windows_of_the_memorys_size_over_documents_and_averages_the_layers():
    """Two memory layers of N = 8 slots read k = 2 per token by one head: windows of 8 / 2 = 4 tokens (x the factor),
    each window's statistics from its read counts (collision: reads of slots read more than once; coverage: slots
    read / N; KLD to uniform), pooled over both documents' windows, then the mean over the layers."""
    import types

    from fastweights.experiments.fwpkm_documents import addressing

    mems = [types.SimpleNamespace(n_slots=8, heads=1, k=2), types.SimpleNamespace(n_slots=8, heads=1, k=2)]

    def reads(rows):  # [T, 2] slot ids of one document
        return torch.tensor(rows)

    doc_a = [(reads([[0, 1], [2, 3], [4, 5], [6, 7]]), torch.full((4, 1), 0.5)),  # layer 0: one window, all distinct
             (reads([[0, 0], [0, 0], [1, 1], [1, 1]]), torch.full((4, 1), 1.0))]  # layer 1: 2 slots, 4 reads each
    doc_b = [(reads([[0, 1], [0, 1], [0, 1], [0, 1], [5, 5]]), torch.zeros(5, 1)),  # 1 window (the 5th token left)
             (reads([[2, 3], [4, 5], [6, 7], [0, 1], [7, 7]]), torch.zeros(5, 1))]
    got = addressing([doc_a, doc_b], mems)
    l0, l1 = got["layers"]
    # layer 0: window a: 8 distinct slots once each (collision 0, coverage 1, KLD 0); window b: slots 0, 1 read 4
    # times each (collision 1, coverage 2/8, KLD log(8 / 2))
    assert l0 == {"collision": pytest.approx(0.5), "coverage": pytest.approx((1 + 0.25) / 2),
                  "kld": pytest.approx(math.log(4) / 2), "windows": 2, "window_tokens": 4, "n_slots": 8,
                  "gate_mean": pytest.approx(0.5 * 4 / 9)}
    # layer 1: window a as layer 0's b; window b: 8 distinct slots
    assert l1 == {"collision": pytest.approx(0.5), "coverage": pytest.approx(0.625), "kld": pytest.approx(math.log(4) / 2),
                  "windows": 2, "window_tokens": 4, "n_slots": 8, "gate_mean": pytest.approx(4 / 9)}
    assert got["mean_over_layers"] == {"collision": pytest.approx(0.5), "coverage": pytest.approx(0.625),
                                       "kld": pytest.approx(math.log(4) / 2)}
    assert list(got) == ["mean_over_layers", "layers"]
    # a window factor of 2: one window of 8 tokens per document only where there are 8 (else the partial window)
    wide = addressing([doc_a, doc_b], mems, window_factor=2)["layers"][0]
    assert wide["window_tokens"] == 8 and wide["windows"] == 2
    # the window is N / (heads x k) tokens: 8 / (1 x 4) = 2, so each document gives two windows
    narrow = addressing([doc_a, doc_b], [types.SimpleNamespace(n_slots=8, heads=1, k=4), mems[1]])["layers"][0]
    assert (narrow["window_tokens"], narrow["windows"]) == (2, 4)
    # layers that differ: the mean is over the layers, not a copy of the first
    skew = addressing([[doc_a[1], doc_a[0]]], mems)  # one document: layer 0 skewed, layer 1 uniform
    assert skew["layers"][0]["coverage"] == 0.25 and skew["layers"][1]["coverage"] == 1.0
    assert skew["mean_over_layers"] == {"collision": 0.5, "coverage": 0.625, "kld": pytest.approx(math.log(4) / 2)}
