"""FwPKM along long documents (Zhao & Jones 2026, App. D; ``benchmarks/quality/fwpkm_longdocs.py``): each document
streamed from a fresh state with the state carried within it, its loss before and after :data:`EARLY` characters
(:func:`score_documents`, memory writes on or frozen), and the slots each memory layer read, as collision,
coverage and KL divergence per window of the memory's size, pooled over the documents (:func:`addressing`)."""

from __future__ import annotations

import math
import time

import torch

from fastweights.experiments.addressing import windowed_addressing_stats
from fastweights.loops.evaluate import score_tokens
from fastweights.models.memory_switches import memory_writes

EARLY = 2048  # characters: per-document positions before / after this are reported separately


def memory_layers(model) -> list:
    """The model's FwPKM layers, in order."""
    return [m for m in model.modules() if type(m).__name__ == "FwPKM"]


@torch.no_grad()
def score_documents(model, tokenizer, docs, seq_len: int, frozen: bool, record: bool) -> dict:
    """Stream each document from a fresh state, state carried within it; per-document NLL and reads."""
    mems = memory_layers(model)
    per_doc, reads = [], []
    nll_early = n_early = nll_late = n_late = 0.0
    with memory_writes(model, frozen=True if frozen else None):
        for doc in docs:
            text = doc.text
            ids = torch.as_tensor(tokenizer.encode(text), dtype=torch.long)
            for m in mems:
                m.read_log, m.gate_log, m.record_reads = [], [], record
            t0 = time.perf_counter()
            res, _ = score_tokens(model, ids, seq_len, seq_len // 2, keep_token_losses=True)
            dt = time.perf_counter() - t0
            losses = torch.tensor(res.token_losses, dtype=torch.float64)
            nll_early += float(losses[: EARLY - 1].sum())
            n_early += min(len(losses), EARLY - 1)
            nll_late += float(losses[EARLY - 1:].sum())
            n_late += max(0, len(losses) - (EARLY - 1))
            per_doc.append({"doc": doc.name, "tokens": res.tokens, "bits_per_char": res.loss / math.log(2),
                            "seconds": round(dt, 2)})
            if record:
                reads.append([(torch.cat([e["indices"][0] for e in m.read_log], 0),
                               torch.cat([g[0] for g in m.gate_log])) for m in mems])
            for m in mems:
                m.read_log, m.gate_log, m.record_reads = [], [], False
    tokens = sum(d["tokens"] for d in per_doc)
    nll = sum(d["bits_per_char"] * d["tokens"] for d in per_doc)
    out = {"bits_per_char": nll / tokens, "tokens": tokens,
           "bits_per_char_first_2048": nll_early / n_early / math.log(2),
           "bits_per_char_after_2048": nll_late / n_late / math.log(2) if n_late else None,
           "per_document": per_doc}
    out["perplexity_per_char"] = 2 ** out["bits_per_char"]
    return out, reads


def addressing(reads, mems, window_factor: int = 1) -> dict:
    """Collision / coverage / KLD per window of window_factor * N / (H k) tokens, pooled over documents."""
    layers = []
    for li, m in enumerate(mems):
        n_slots = m.n_slots
        window = window_factor * n_slots // (m.heads * m.k)
        windows = []
        gates = []
        for doc_reads in reads:
            idx, g = doc_reads[li]
            windows += windowed_addressing_stats(idx, n_slots, window)["per_window"]
            gates.append(g)
        stats = {k: sum(w[k] for w in windows) / len(windows) for k in ("collision", "coverage", "kld")}
        stats.update(windows=len(windows), window_tokens=window, n_slots=n_slots,
                     gate_mean=float(torch.cat(gates).float().mean()))
        layers.append(stats)
    mean = {k: sum(s[k] for s in layers) / len(layers) for k in ("collision", "coverage", "kld")}
    return {"mean_over_layers": mean, "layers": layers}
