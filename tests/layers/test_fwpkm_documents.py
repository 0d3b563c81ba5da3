"""``experiments.fwpkm_documents.score_documents`` (the long-document FwPKM benchmark's scoring, moved into the
library): each document from a fresh state, its bits per char before and after EARLY characters adding up to the
whole, the reads recorded per memory layer when asked, and frozen memories scoring as the model without writes."""

import math

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
