"""Every figure the project draws from a stored result, redrawn from that JSON and checked as a reader would look at
it (issue 33, scope 6): the file is written, no two series of a panel share colour and line style, and no legend
covers plotted data. The leaderboard, whose seventeen rows are the hardest to tell apart, is held to more: a colour
of its own for every row, far from every other row's, one legend outside every panel, the rows that collapse when
streamed in a panel of their own, and the committed PNG equal to what its JSON draws now.

A figure is captured as it is saved (``Figure.savefig``), so the check sees the figure the drawing code wrote."""

import json
import math
from pathlib import Path

import matplotlib
import matplotlib.image
import numpy as np
import pytest

matplotlib.use("Agg")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.colors import to_hex, to_rgb  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from helpers import BENCHMARKS

from fastweights.experiments import leaderboard  # the figure of benchmarks/quality/leaderboard.py's record

RESULTS = BENCHMARKS / "results"


def stored(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def drawn(draw, path: Path) -> Figure:
    """Run ``draw(path)`` and return the figure it saved, after checking that ``path`` is a PNG it wrote."""
    saved = []
    original = Figure.savefig

    def capture(fig, *args, **kwargs):
        saved.append(fig)
        return original(fig, *args, **kwargs)

    Figure.savefig = capture
    try:
        draw(path)
    finally:
        Figure.savefig = original
    assert saved, "the drawing code saved no figure"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width >= 400 and height >= 250, f"{path.name}: {width}x{height} pixels"
    fig = saved[-1]
    FigureCanvasAgg(fig)  # closing a figure detaches its canvas; the checks need positions on the page
    fig.canvas.draw()
    return fig


def style(line) -> tuple[str, str]:
    """(colour, line style) of a line, the dash pattern included ("--" and "-." are different styles)."""
    ls = line.get_linestyle()
    return to_hex(line.get_color()), ls if ls in ("-", "None", "") else repr(line._unscaled_dash_pattern)


def same_style_in_a_panel(fig: Figure) -> list[str]:
    """Pairs of lines of one panel that look alike (same colour, same line style)."""
    out = []
    for i, ax in enumerate(fig.axes):
        seen = {}
        for line in ax.get_lines():
            if len(line.get_xdata()) < 2:
                continue
            key = style(line)
            if key in seen:
                out.append(f"panel {i}: {seen[key]!r} and {line.get_label()!r} share colour and style {key}")
            seen.setdefault(key, line.get_label())
    return out


def _display_points(line, step: float = 2.0) -> np.ndarray:
    """Points every ``step`` pixels along a drawn line, in display coordinates."""
    xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
    xy = xy[np.isfinite(xy).all(axis=1)]
    if len(xy) < 2:
        return xy
    pts = [xy[:1]]
    for a, b in zip(xy[:-1], xy[1:]):
        n = max(1, int(np.hypot(*(b - a)) / step))
        pts.append(a + (b - a) * (np.arange(1, n + 1)[:, None] / n))
    return np.concatenate(pts)


def legend_over_data(fig: Figure) -> list[str]:
    """Legends (of a panel or of the figure) drawn over a line or a bar of any panel."""
    renderer = fig.canvas.get_renderer()
    legends = [lg for lg in [ax.get_legend() for ax in fig.axes] + list(fig.legends) if lg is not None]
    out = []
    for lg in legends:
        box = lg.get_window_extent(renderer).shrunk(0.98, 0.98)
        for i, ax in enumerate(fig.axes):
            clip = ax.get_window_extent(renderer)
            for line in ax.get_lines():
                pts = _display_points(line)
                inside = [(x, y) for x, y in pts if clip.contains(x, y) and box.contains(x, y)]
                if inside:
                    out.append(f"a legend covers {len(inside)} points of {line.get_label()!r} (panel {i})")
            for patch in ax.patches:
                if isinstance(patch, Rectangle) and patch.get_height() and box.overlaps(patch.get_window_extent(renderer)):
                    out.append(f"a legend covers a bar of panel {i}")
    return out


# ----------------------------------------------------------------------------- the leaderboard


def delta_e(a: str, b: str) -> float:
    """CIE76 colour difference of two colours (about 2.3: just noticeable; 20 and more: different colours)."""

    def lab(c):
        lin = [v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4 for v in to_rgb(c)]
        x, y, z = (sum(m * v for m, v in zip(row, lin)) for row in
                   ((0.4124, 0.3576, 0.1805), (0.2126, 0.7152, 0.0722), (0.0193, 0.1192, 0.9505)))
        f = [t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116 for t in (x / 0.95047, y, z / 1.08883)]
        return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])

    return math.dist(lab(a), lab(b))


def row_lines(fig: Figure, entries: list[str]) -> dict[str, list]:
    """Each row's lines: those labelled with its entry name (optionally followed by words: "fwl streamed")."""
    lines = {e: [] for e in entries}
    for ax in fig.axes:
        for line in ax.get_lines():
            word = line.get_label().split(" ")[0]
            if word in lines:
                lines[word].append((ax, line))
    return lines


def draw_leaderboard(rec: dict, path: Path):
    return leaderboard.plot_leaderboard(rec, path)


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    rec = stored("leaderboard")
    path = tmp_path_factory.mktemp("figures") / "leaderboard.png"
    return rec, drawn(lambda p: draw_leaderboard(rec, p), path), path


def test_leaderboard_gives_every_row_a_colour_of_its_own_and_a_distinct_style(board):
    rec, fig, _ = board
    entries = [t["entry"] for t in rec["table"]]
    lines = row_lines(fig, entries)
    assert not [e for e, ls in lines.items() if not ls], "rows without a line"
    looks = {e: {style(line) for _, line in ls} for e, ls in lines.items()}
    assert all(len(v) == 1 for v in looks.values()), "a row drawn in two styles"
    looks = {e: v.pop() for e, v in looks.items()}
    assert len(set(looks.values())) == len(entries), "two rows share colour and line style"
    close = [(a, b, round(delta_e(looks[a][0], looks[b][0]), 1)) for i, a in enumerate(entries)
             for b in entries[i + 1:] if delta_e(looks[a][0], looks[b][0]) < 20]
    assert not close, f"rows whose colours are alike (CIELAB distance < 20): {close}"
    assert not same_style_in_a_panel(fig)


def test_leaderboard_legend_is_outside_every_panel_and_names_every_row(board):
    rec, fig, _ = board
    renderer = fig.canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
    assert legends, "no legend"
    for lg in legends:
        box = lg.get_window_extent(renderer)
        assert not [i for i, ax in enumerate(fig.axes) if box.overlaps(ax.get_window_extent(renderer))], \
            "a legend overlaps a panel"
        assert box.x1 <= fig.bbox.x1 + 1 and box.y0 >= fig.bbox.y0 - 1, "the legend runs off the figure"
    named = " ".join(t.get_text() for lg in legends for t in lg.get_texts())
    assert all(f" {t['entry']} " in f" {named} " for t in rec["table"]), "a row missing from the legend"
    assert not legend_over_data(fig)


def test_leaderboard_draws_collapsed_rows_apart_so_they_do_not_set_the_others_range(board):
    rec, fig, _ = board
    table = rec["table"]
    collapsed = {t["entry"] for t in table if t["streamed_minus_windows_bits"] > leaderboard.COLLAPSE_BITS}
    assert collapsed == {"fwp-sum", "fwp-delta"}, collapsed  # the committed result: what this test is about
    lines = row_lines(fig, [t["entry"] for t in table])
    loss_panels = [ax for ax in fig.axes if ax.get_yscale() == "linear"]  # the state norm panel is log-scaled
    mixed = [ax for ax in loss_panels
             if {e for e, ls in lines.items() for a, _ in ls if a is ax} & collapsed
             and {e for e, ls in lines.items() for a, _ in ls if a is ax} - collapsed]
    assert not mixed, "a loss panel mixes collapsed rows with the others"
    low = min(t["streamed_bits_per_char"] for t in table if t["entry"] in collapsed)
    for ax in loss_panels:
        if not {e for e, ls in lines.items() for a, _ in ls if a is ax} & collapsed:
            assert ax.get_ylim()[1] < low, "the other rows' y-range reaches up to the collapsed rows"
    assert any(e in collapsed for e, ls in lines.items() for a, _ in ls if a in loss_panels), \
        "the collapsed rows are not drawn at all"


def test_committed_leaderboard_png_is_what_its_json_draws(board):
    """The PNG in the repository is derived from leaderboard.json by the current drawing code (re-render it
    with ``python benchmarks/quality/leaderboard.py --plot-only`` after changing either)."""
    _, _, path = board
    new, old = matplotlib.image.imread(path), matplotlib.image.imread(RESULTS / "leaderboard.png")
    assert new.shape == old.shape, f"committed {old.shape[:2]} vs drawn now {new.shape[:2]}: re-render it"
    assert float(np.abs(new - old).mean()) < 0.01, "the committed leaderboard.png differs from what its JSON draws"


# ----------------------------------------------------------------------------- the other figures of stored results


def _stream_runs(rec: dict) -> list[dict]:
    """benchmarks/quality/fwp_streaming.py's plot input, from its JSON."""
    return [{"label": f"{name} {label}", "checkpoint": name, "mode": mode, "curve": row[label]["curve"],
             "state_norm": row[label]["state_norm"]}
            for name, row in rec["variants"].items() for label, mode in (("carry", "carry"), ("windows", "memory"))]


def _figures():
    from fastweights.adapt.continual import plot_adapt
    from fastweights.adapt.timescale import plot_timescale
    from fastweights.experiments.analysis import plot_analysis
    from fastweights.experiments.streaming import plot_stream
    from fastweights.tasks.assoc import plot_capacity

    def capacity(setting):
        return lambda p: plot_capacity([r for r in stored("assoc_capacity")["runs"] if r["setting"] == setting], p,
                                       title=f"associative retrieval, setting {setting} (CPU-sized sweep)")

    return {
        # (the drawing, redrawn from the JSON the benchmark wrote; the committed PNG beside it)
        "assoc_capacity_setting1": capacity(1),
        "assoc_capacity_setting2": capacity(2),
        "dynamic_timescale_spanish": lambda p: plot_timescale(stored("dynamic_timescale_spanish"), p, title="Don Quijote"),
        "adapt_test_dynamic": lambda p: plot_adapt(stored("adapt_test_dynamic"), p, title="continual adaptation"),
        "adapt_test_fwpkm": lambda p: plot_adapt(stored("adapt_test_fwpkm"), p, title="continual adaptation"),
        "fwl_analysis/analysis": lambda p: plot_analysis(stored("fwl_analysis/analysis"), p),
        "fwp_streaming": lambda p: plot_stream(_stream_runs(stored("fwp_streaming")), p, unit="bits",
                                               title="delta-rule LMs on the Shakespeare test split"),
    }


@pytest.mark.parametrize("name", list(_figures()))
def test_figure_of_a_stored_result_is_written_and_readable(name, tmp_path):
    assert (RESULTS / f"{name}.png").exists(), f"benchmarks/results/{name}.png is not committed"
    fig = drawn(_figures()[name], tmp_path / f"{Path(name).name}.png")
    assert fig.axes and any(ax.has_data() for ax in fig.axes), "an empty figure"
    assert not same_style_in_a_panel(fig)
    assert not legend_over_data(fig)


def test_readme_shows_the_leaderboard_figure_below_its_table():
    readme = (BENCHMARKS.parent / "README.md").read_text()
    board_end = readme.index("<!-- leaderboard:end -->")
    image = readme.find("](benchmarks/results/leaderboard.png)")
    assert image > board_end and readme[board_end:image].count("\n") <= 3 and readme.rfind("![", 0, image) > board_end


def _board_record():
    """A leaderboard record of three rows: the baseline, a better row without a state norm, and one that collapses
    when streamed; curves in nats at three positions (one gap)."""
    ln2 = math.log(2)

    def row(cum, win, norm=None):
        streamed = {"curve": {"bin_width": 256, "position": [256, 512, 768], "cumulative": [c * ln2 for c in cum],
                              "windowed": [None if w is None else w * ln2 for w in win]}}
        if norm is not None:
            streamed["state_norm"] = {"position": [256, 512, 768], "max": norm}
        return [{"streamed": streamed}]

    table = [{"entry": "fwp-gated-delta", "rank": 1, "streamed_bits_per_char": 1.9, "windows_bits_per_char": 1.95,
              "streamed_minus_windows_bits": -0.05},
             {"entry": "attention", "rank": 2, "streamed_bits_per_char": 2.0, "windows_bits_per_char": 2.0,
              "streamed_minus_windows_bits": 0.0},
             {"entry": "fwp-sum", "rank": 3, "streamed_bits_per_char": 4.5, "windows_bits_per_char": 2.25,
              "streamed_minus_windows_bits": 2.25}]
    rows = {"fwp-gated-delta": row([2.5, 2.2, 1.9], [2.4, None, 1.7], norm=[1.0, 2.0, None]),
            "attention": row([2.6, 2.3, 2.0], [2.5, 2.1, 1.8]),
            "fwp-sum": row([3.0, 4.0, 4.5], [3.0, 5.0, 6.0], norm=[10.0, 100.0, 1000.0])}
    return {"table": table, "rows": rows}


def test_the_leaderboard_figure_draws_each_rows_curves_in_bits_in_its_panel():
    rec = _board_record()
    fig = leaderboard.leaderboard_figure(rec)
    cum, rel, collapsed, norm = fig.axes
    styles = leaderboard.row_styles(["fwp-gated-delta", "attention", "fwp-sum"])

    def lines(ax):
        return {ln.get_label(): (list(ln.get_xdata()), [round(float(y), 9) for y in ln.get_ydata()], ln.get_color(),
                                 ln.get_linestyle()) for ln in ax.get_lines() if ln.get_label() != "_child0"}

    got = lines(cum)
    assert set(got) == {"fwp-gated-delta", "attention"}  # the collapsed row is in its own panel
    assert got["fwp-gated-delta"][:2] == ([256, 512, 768], [2.5, 2.2, 1.9])
    assert got["attention"][2] == styles["attention"]["color"]
    got = lines(rel)  # windowed minus attention's, where both have a value
    assert got["fwp-gated-delta"][:2] == ([256, 768], [round(2.4 - 2.5, 9), round(1.7 - 1.8, 9)])
    assert got["attention"][:2] == ([256, 512, 768], [0.0, 0.0, 0.0])
    got = lines(collapsed)
    assert got["fwp-sum"][:2] == ([256, 512, 768], [3.0, 5.0, 6.0]) and got["fwp-sum"][2] == styles["fwp-sum"]["color"]
    assert got["_attention, for scale"][1] == [2.5, 2.1, 1.8] and got["_attention, for scale"][2] == "#aaaaaa"
    got = lines(norm)
    assert set(got) == {"fwp-gated-delta", "fwp-sum"} and got["fwp-gated-delta"][:2] == ([256, 512], [1.0, 2.0])
    assert norm.get_yscale() == "log" and norm.get_title() == "no state norm recorded for attention"
    assert cum.get_ylabel() == "bits/char, cumulative\n(from the document's start)"
    assert cum.get_title() == ("held-out Shakespeare plays, streamed with the state carried: loss by position (seed 0 "
                               "of each row)")
    assert rel.get_ylabel() == "bits/char in 256 characters\nminus attention's (< 0: better)"
    assert collapsed.get_title() == (
        "rows that collapse when streamed (more than 1 bit/char above their windows score), in their own panel so "
        "that the others stay readable\nfwp-sum 4.500 streamed vs 2.250 in windows (grey: attention, for scale)")
    assert collapsed.get_ylabel() == "bits/char in 256 characters" and norm.get_ylabel() == "carried state's norm\n(largest layer)"
    assert norm.get_xlabel() == "position in the document (characters)"
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["1. fwp-gated-delta  1.900", "2. attention  2.000",
                                                          "3. fwp-sum  4.500 (own panel)"]
    assert [(h.get_color(), h.get_linestyle()) for h in legend.legend_handles] == [
        (styles[e]["color"], Line2D([], [], ls=styles[e]["ls"]).get_linestyle()) for e in styles]
    assert legend.get_title().get_text() == "rank. row  streamed bits/char\n(mean over seeds; README table)"
    heights = [ax.get_position().height for ax in fig.axes]
    assert heights[0] > heights[1] > heights[2] and abs(heights[1] - heights[3]) < 1e-9  # 1.25 : 1 : 0.75 : 1
    rows = [ln for ax in (cum, rel, collapsed, norm) for ln in ax.get_lines() if not ln.get_label().startswith("_")]
    assert {ln.get_linewidth() for ln in rows} == {1.6}
    grey = next(ln for ln in collapsed.get_lines() if ln.get_label() == "_attention, for scale")
    assert grey.get_linewidth() == 1.0
    (zero,) = [ln for ln in rel.get_lines() if ln.get_label().startswith("_child")]
    assert list(zero.get_ydata()) == [0.0, 0.0] and (zero.get_color(), zero.get_linewidth(), zero.get_zorder()) == (
        "#999999", 0.8, 0)
    assert (cum.title.get_fontsize(), collapsed.title.get_fontsize(), norm.title.get_fontsize()) == (11, 9, 8.5)
    assert all(ax.xaxis.get_gridlines()[0].get_alpha() == 0.3 for ax in fig.axes)
    assert {h.get_linewidth() for h in legend.legend_handles} == {1.8}
    assert legend.get_texts()[0].get_fontsize() == 9 and legend.get_title().get_fontsize() == 8.5
    fig.canvas.draw()  # where the legend is drawn: its upper left corner at its anchor (0.76, 0.985), no frame
    box = legend.get_window_extent().transformed(fig.transFigure.inverted())
    assert abs(box.x0 - 0.76) < 0.02 and abs(box.y1 - 0.985) < 0.02 and not legend.get_frame_on()
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_rows_past_the_collapse_margin_share_their_panel_and_say_so_without_a_baseline():
    rec = _board_record()
    rec["table"][0]["streamed_minus_windows_bits"] = leaderboard.COLLAPSE_BITS  # exactly at the margin: stays
    rec["table"][1] = {**rec["table"][1], "entry": "fwp-delta", "streamed_bits_per_char": 3.5,
                       "windows_bits_per_char": 2.0, "streamed_minus_windows_bits": 1.5}
    rec["rows"]["fwp-delta"] = rec["rows"].pop("attention")
    del rec["rows"]["fwp-gated-delta"][0]["streamed"]["state_norm"]
    fig = leaderboard.leaderboard_figure(rec)
    cum, win, collapsed, norm = fig.axes
    assert norm.get_title() == "no state norm recorded for fwp-gated-delta, fwp-delta"
    assert [ln.get_label() for ln in cum.get_lines()] == ["fwp-gated-delta"]
    assert sorted(ln.get_label() for ln in collapsed.get_lines()) == ["fwp-delta", "fwp-sum"]  # no grey baseline
    assert collapsed.get_title().endswith("\nfwp-delta 3.500 streamed vs 2.000 in windows; fwp-sum 4.500 streamed vs "
                                          "2.250 in windows")
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_without_the_baseline_the_figure_draws_windowed_losses_and_no_collapse_or_norm_panel():
    rec = _board_record()
    rec["table"] = rec["table"][:1]
    rec["rows"] = {"fwp-gated-delta": rec["rows"]["fwp-gated-delta"]}
    del rec["rows"]["fwp-gated-delta"][0]["streamed"]["state_norm"]
    fig = leaderboard.leaderboard_figure(rec)
    cum, win = fig.axes
    (line,) = win.get_lines()
    assert list(line.get_xdata()) == [256, 768] and [round(float(y), 9) for y in line.get_ydata()] == [2.4, 1.7]
    assert win.get_ylabel() == "bits/char in 256 characters" and win.get_xlabel() == "position in the document (characters)"
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_a_record_without_rows_draws_empty_panels():
    import matplotlib.pyplot as plt

    fig = leaderboard.leaderboard_figure({"table": [], "rows": {}})
    cum, win = fig.axes
    assert not cum.get_lines() and win.get_ylabel() == "bits/char in 0 characters"
    plt.close(fig)
