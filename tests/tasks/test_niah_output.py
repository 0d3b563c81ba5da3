"""What `fastweights task niah` shows (issue 33): heatmap cells without samples are marked and explained, never
left white; the table's header names its metrics in full over columns as wide as it."""

import pytest

from fastweights.tasks.niah import summarize
from fastweights.tasks.niah_report import EMPTY_CELL, draw_niah, format_table, niah_figure


def _records(depths):
    """One char-format record per (n, length, target depth): exact 1 at 1K, 0 at 2K."""
    return [{"iters": n, "length": L, "depth": d, "format": "char", "exact": float(L == 1024), "digits": 0.5,
             "candidate": 1.0} for n in (1, 2) for L in (1024, 2048) for d in depths]


@pytest.mark.parametrize("depths,bins,empty,why", [("uniform", 4, 4, "depth bin"), ([0.0, 0.5, 1.0], 0, 2, "was run")])
def test_empty_heatmap_cells_are_hatched_labelled_and_explained(depths, bins, empty, why, tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    ran = [0.1, 0.9] if depths == "uniform" else [0.0, 1.0]  # no sample in bins 2 and 3 of 4, or at depth 0.5
    summary = summarize(_records(ran), depths, bins or 5)
    fig = niah_figure(summary)
    heatmaps = fig.axes[:2]  # one per n; then the bars and the colour bar
    for ax in heatmaps:
        hatched = [p for p in ax.patches if p.get_hatch() == EMPTY_CELL["hatch"]]
        assert len(hatched) == empty  # the empty depth rows x 2 lengths
        assert sum(t.get_text() == "no samples" for t in ax.texts) == empty
        bad = ax.images[0].get_cmap().get_bad()
        assert tuple(bad) == to_rgba(EMPTY_CELL["color"]) and tuple(bad) != (1.0, 1.0, 1.0, 1.0)
    notes = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert any(n.startswith("no samples:") and why in n for n in notes), notes
    bars = fig.axes[2]
    assert "0.00" in [t.get_text() for t in bars.texts]  # the bars of 0 at 2K are labelled, not invisible
    plt.close(fig)
    assert draw_niah(summary, tmp_path / "niah.png").stat().st_size > 1000


def test_a_full_grid_has_no_empty_cell_note():
    import matplotlib.pyplot as plt

    fig = niah_figure(summarize(_records([0.0, 1.0]), [0.0, 1.0]))
    assert not fig.legends and not any(p.get_hatch() for ax in fig.axes for p in ax.patches)
    plt.close(fig)


def test_the_table_header_names_both_metrics_in_full():
    lines = format_table(summarize(_records([0.5]), [0.5])).splitlines()
    assert lines[0].split() == ["length", "1-iter", "exact", "/", "digits", "2-iter", "exact", "/", "digits"]
    assert all(len(line) == len(lines[0]) for line in lines)  # every column as wide as its header
    assert lines[1].split()[:4] == ["1024", "1.00", "/", "0.50"]
