"""What ``fastweights task niah`` shows of a :func:`fastweights.tasks.niah.summarize` summary: the text table
(:func:`format_table`) and the figure (:func:`draw_niah`, behind :func:`fastweights.tasks.niah.plot_niah`)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

EMPTY_CELL = {"color": "0.85", "hatch": "///", "edge": "0.55"}  # how draw_niah marks a heatmap cell without samples


def format_table(summary: dict) -> str:
    """The accuracy table ``fastweights task niah`` prints: one row per length, per n the exact match and
    the second metric (per-digit accuracy for the char format, candidate match for the token format), with
    the full metric names in the header and every column as wide as its header."""
    second = "digits" if "digits" in summary.get("metrics", ("digits",)) else "candidate"
    heads = [f"{n}-iter exact / {second}" for n in summary["iters"]]
    lines = [f"{'length':>8}  " + "  ".join(heads)]
    for L in summary["lengths"]:
        cells = []
        for n, head in zip(summary["iters"], heads):
            a = summary["by_iters"][n]["by_length"][L]
            cell = " / ".join("-" if a[m] is None else f"{a[m]:.2f}" for m in ("exact", second))
            cells.append(f"{cell:>{len(head)}}")
        lines.append(f"{L:>8}  " + "  ".join(cells))
    return "\n".join(lines)


def draw_niah(summary: dict, path: str | Path, title: str = "", metric: str = "exact") -> Path:
    """PNG of :func:`niah_figure` (``plot_niah``)."""
    import matplotlib.pyplot as plt

    from fastweights.core.files import atomic_write

    fig = niah_figure(summary, title, metric)
    path = Path(path)
    atomic_write(path, lambda p: fig.savefig(p, dpi=110, format="png", bbox_inches="tight"))
    plt.close(fig)
    return path


def niah_figure(summary: dict, title: str = "", metric: str = "exact"):
    """One depth x length accuracy heatmap per n (reads), and accuracy by length for each n.

    A cell without samples (a depth bin no random target fell in, or a cell not run) is grey and hatched,
    labelled "no samples", and a legend under the figure says why; bars carry their values, so a 0 shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    iters, lengths, labels = summary["iters"], summary["lengths"], summary["depth_labels"]
    empty = 0  # heatmap cells without samples
    ncols = len(iters) + 1
    fig, axes = plt.subplots(1, ncols, figsize=(3.2 * ncols + 1, 3.8), squeeze=False, layout="constrained")
    axes = axes[0]
    for ax, n in zip(axes, iters):
        grid = np.full((len(labels), len(lengths)), np.nan)
        for c in summary["cells"]:
            if c["iters"] == n and c[metric] is not None:
                grid[labels.index(c["depth"]), lengths.index(c["length"])] = c[metric]
        cmap = plt.get_cmap("RdYlGn").with_extremes(bad=EMPTY_CELL["color"])  # no samples: grey, hatched, never white
        im = ax.imshow(np.ma.masked_invalid(grid), vmin=0, vmax=1, cmap=cmap, aspect="auto", origin="upper")
        for i in range(len(labels)):
            for j in range(len(lengths)):
                if math.isnan(grid[i, j]):
                    empty += 1
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=EMPTY_CELL["color"],
                                           hatch=EMPTY_CELL["hatch"], edgecolor=EMPTY_CELL["edge"], lw=0))
                    ax.text(j, i, "no samples", ha="center", va="center", fontsize=6, color="0.25")
                else:
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [_fmt_len(L) for L in lengths])
        edges = summary.get("depth_edges")
        ax.set_yticks(range(len(labels)), [f"{a:.2f}-{b:.2f}" for a, b in zip(edges, edges[1:])] if edges
                      else [f"{d:g}" for d in labels])
        ax.set_xlabel("context length (tokens)")
        if n == iters[0]:
            ax.set_ylabel("target depth")
        ax.set_title(f"{n} read{'s' if n > 1 else ''}")
    fig.colorbar(im, ax=axes[: len(iters)].tolist(), shrink=0.8, label=metric)
    ax = axes[-1]
    width = 0.8 / max(1, len(iters))
    for k, n in enumerate(iters):
        ys = [summary["by_iters"][n]["by_length"][L][metric] or 0.0 for L in lengths]
        bars = ax.bar(np.arange(len(lengths)) + (k - (len(iters) - 1) / 2) * width, ys, width, label=f"{n}-iter")
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)  # a bar of 0 is visible as its label
    ax.set_xticks(range(len(lengths)), [_fmt_len(L) for L in lengths])
    ax.set_ylim(0, 1.08)
    ax.set_ylabel(f"{metric} (all depths)")
    ax.set_xlabel("context length (tokens)")
    ax.legend(fontsize=7)
    if empty:
        why = ("no sample's target needle fell in that depth bin (depths are drawn at random; more --samples fill "
               "every bin)" if summary.get("depth_edges") else "no sample was run at that depth and length")
        fig.legend(handles=[Patch(facecolor=EMPTY_CELL["color"], hatch=EMPTY_CELL["hatch"],
                                  edgecolor=EMPTY_CELL["edge"], label=f"no samples: {why}")],
                   loc="outside lower left", fontsize=7, frameon=False)
    fig.suptitle(title or f"needle in a haystack: {metric} match")
    return fig


def _fmt_len(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)
