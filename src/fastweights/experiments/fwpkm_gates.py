"""The FwPKM gate map (``fastweights inspect gates``): the gate g_t of every FwPKM layer at every token of
a text, read with memory writes on, drawn as a heatmap laid out like the text.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fastweights.components import GatedMemory
from fastweights.core.errors import UserError
from fastweights.models.memory_switches import memory_writes, read_tokens


# ----------------------------------------------------------------------------- FwPKM gate map


@torch.no_grad()
def gate_values(model, tokenizer, text: str, chunk_size: int | None = 32, piece: int = 512):
    """Per-token gate g_t of every FwPKM layer while ``model`` reads ``text`` (memory writes on).

    ``chunk_size``: the memories write every this many tokens (the paper's visualisation uses 32;
    None keeps the trained chunk). Returns ``(token ids [T], {layer index: gates [T] numpy})``.
    """
    layers = {i: b.memory for i, b in enumerate(getattr(model, "blocks", [])) if isinstance(b.memory, GatedMemory)}
    if not layers:
        raise UserError("this model has no FwPKM layer (no memory exposing its gate)")
    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(tokenizer.encode(text)), dtype=torch.long, device=device)
    if ids.numel() == 0:
        raise UserError("the text to visualise is empty")
    saved = {i: (m.record_reads, m.gate_log, m.read_log) for i, m in layers.items()}
    was_training = model.training
    model.eval()
    try:
        for m in layers.values():
            m.record_reads, m.gate_log, m.read_log = True, [], []
        with memory_writes(model, chunk_size=chunk_size):
            read_tokens(model, ids, None, piece)
        gates = {i: torch.cat([g.reshape(-1) for g in m.gate_log]).float().numpy() for i, m in layers.items()}
    finally:
        for i, m in layers.items():
            m.record_reads, m.gate_log, m.read_log = saved[i]
        model.train(was_training)
    return ids.cpu().numpy(), gates


def plot_gate_map(tokens: Sequence[str], gates: dict, path: str | Path, width: int = 64, title: str = "") -> Path:
    """PNG: the text laid out in rows of ``width`` tokens, each cell coloured by its gate, one panel per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastweights.core.files import save_figure

    T = len(tokens)
    rows = max(1, math.ceil(T / width))
    n = len(gates)
    fig, axes = plt.subplots(n, 1, figsize=(max(6, width * 0.16), (rows * 0.22 + 0.8) * n), squeeze=False)
    for ax, (layer, g) in zip(axes[:, 0], sorted(gates.items())):
        grid = np.full((rows, width), np.nan)
        grid.flat[:T] = g[:T]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", interpolation="nearest")
        for t, tok in enumerate(tokens):
            shown = tok.replace("\n", "\u21b5").replace(" ", "\u00b7")[:3]
            ax.text(t % width, t // width, shown, ha="center", va="center", fontsize=5,
                    color="white" if g[t] < 0.5 else "black")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_ylabel(f"layer {layer}")
        fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01, label="gate g_t")
    axes[0, 0].set_title(title or "FwPKM gate per token (1 = memory read, 0 = bypass)")
    return save_figure(fig, path, dpi=130, bbox_inches="tight")
