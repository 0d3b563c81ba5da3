"""Loss against position under static and dynamic evaluation (Krause et al. 2018, Figure 2).

Per-token losses of each document, averaged across documents within non-overlapping windows of
positions, in bits per token: where in a document dynamic evaluation starts to pay, and by how much.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import torch

from fastweights.adapt.stream_state import as_token_stream
from fastweights.core.errors import UserError
from fastweights.core.files import save_figure
from fastweights.core.progress import Progress


def loss_by_position(per_doc_losses: list[list[float]], window: int = 100) -> dict:
    """Mean loss at each position across documents, averaged over non-overlapping windows.

    Returns {"position": window end positions, "loss": mean nats per window, "docs": documents
    covering each window}; windows are kept while at least one document covers them (not cumulative,
    as in the paper's Figure 2).
    """
    if not per_doc_losses:
        return {"position": [], "loss": [], "docs": []}
    T = max(len(d) for d in per_doc_losses)
    sums = torch.zeros(T, dtype=torch.float64)
    counts = torch.zeros(T, dtype=torch.float64)
    for d in per_doc_losses:
        sums[: len(d)] += torch.tensor(d, dtype=torch.float64)
        counts[: len(d)] += 1
    pos, loss, docs = [], [], []
    for a in range(0, T, window):
        b = min(a + window, T)
        c = counts[a:b]
        if c.sum() == 0:
            continue
        pos.append(b)
        loss.append(float(sums[a:b].sum() / c.sum()))
        docs.append(int(c.min()))
    return {"position": pos, "loss": loss, "docs": docs}


def timescale_analysis(evaluator, documents: Sequence, window: int = 100,
                       progress: bool = False) -> dict:
    """Static and dynamic loss against position (paper Figure 2), averaged over ``documents``.

    ``evaluator``: a :class:`~fastweights.adapt.dynamic.DynamicEvaluator` (or anything with its
    ``static`` and ``evaluate``). Each document is evaluated from theta_g and a fresh state.
    Returns {"window", "documents", "position", "static_bits", "dynamic_bits", "advantage_bits"}
    (bits per token per window).
    """
    docs = [as_token_stream(d) for d in documents if len(d) > 1]
    if not docs:
        raise UserError("timescale analysis needs at least one document of two or more tokens")
    bar = Progress(2 * sum(d.numel() - 1 for d in docs), "tok", desc="timescale", enabled=progress)
    static, dynamic = [], []
    for d in docs:
        static.append(evaluator.static(d, progress=bar).token_losses)
        dynamic.append(evaluator.evaluate(d, progress=bar)[0].token_losses)
    bar.close()
    s, dyn = loss_by_position(static, window), loss_by_position(dynamic, window)
    ln2 = math.log(2)
    sb = [v / ln2 for v in s["loss"]]
    db = [v / ln2 for v in dyn["loss"]]
    return {"window": window, "documents": len(docs), "position": s["position"], "docs_per_window": s["docs"],
            "static_bits": sb, "dynamic_bits": db, "advantage_bits": [a - b for a, b in zip(sb, db)],
            "static_mean_bits": sum(sum(d) for d in static) / sum(len(d) for d in static) / ln2,
            "dynamic_mean_bits": sum(sum(d) for d in dynamic) / sum(len(d) for d in dynamic) / ln2}


def plot_timescale(result: dict, path: str | Path, title: str = "") -> Path:
    """PNG of static and dynamic bits per token against position, and their difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax.plot(result["position"], result["static_bits"], label="static")
    ax.plot(result["position"], result["dynamic_bits"], label="dynamic")
    ax.set_ylabel(f"bits per token (window {result['window']})")
    ax.set_title(title or f"loss against position, {result['documents']} documents")
    ax.legend()
    ax.grid(alpha=0.3)
    ax2.plot(result["position"], result["advantage_bits"], color="C2")
    ax2.axhline(0, color="k", lw=0.5)
    ax2.set_xlabel("tokens processed")
    ax2.set_ylabel("static - dynamic")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
