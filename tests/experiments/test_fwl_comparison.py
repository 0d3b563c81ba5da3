"""fastweights.experiments.fwl_comparison's arithmetic, searches and bookkeeping, on numbers and stand-in evaluators
(the benchmarks that use it run it end to end with tiny models in tests/cli; these hold each function to its
docstring exactly)."""

import itertools
import math
from collections import Counter

import pytest
import torch
from torch import nn

from fastweights.core.errors import UserError
from fastweights.experiments import fwl_comparison as fc


def _score(ppl: float, tok_s: float = 100.0, cpu_s: float = 1.0) -> dict:
    return {"perplexity": ppl, "loss_nats": math.log(ppl), "cpu_s": cpu_s, "tokens_per_cpu_s": tok_s}


def test_gain_split_adds_the_slow_and_fast_parts_to_the_full_reduction_per_text_and_in_the_mean():
    static = {"a": _score(20.0), "b": _score(40.0)}
    full = {"a": _score(15.0), "b": _score(36.0)}
    slow = {"a": _score(18.0), "b": _score(30.0)}  # on b the fast part hurts
    out = fc.gain_split(static, full, slow)
    a, b = out["per_text"]["a"], out["per_text"]["b"]
    assert a == pytest.approx({"full_perplexity": 15.0, "slow_perplexity": 18.0, "static_perplexity": 20.0,
                               "full_reduction": 0.25, "slow_reduction": 0.1, "fast_reduction": 0.15,
                               "fast_nats_per_token": math.log(18 / 15)})
    assert b["fast_reduction"] == pytest.approx(-0.15) and b["fast_nats_per_token"] == pytest.approx(math.log(30 / 36))
    for p in (a, b):
        assert p["slow_reduction"] + p["fast_reduction"] == pytest.approx(p["full_reduction"])
    assert out["mean_full_reduction"] == pytest.approx((0.25 + 0.1) / 2)
    assert out["mean_slow_reduction"] == pytest.approx((0.1 + 0.25) / 2)
    assert out["mean_fast_reduction"] == pytest.approx(0.0)
    assert out["mean_fast_nats_per_token"] == pytest.approx((math.log(18 / 15) + math.log(30 / 36)) / 2)
    assert list(out) == ["per_text", "mean_full_reduction", "mean_slow_reduction", "mean_fast_reduction",
                         "mean_fast_nats_per_token"]
    # only full's texts: a static or slow row with more texts does not enter the means
    assert fc.gain_split({**static, "c": _score(5.0)}, {"a": full["a"]}, slow)["mean_full_reduction"] == 0.25


def test_best_point_is_the_lowest_point_below_the_baseline_and_never_a_diverged_one():
    logged = []
    best, status = fc.best_point({1e-3: 2.9, 2e-3: 2.8, 4e-3: 3.05, 8e-3: math.nan}, 3.0, "lr", log=logged.append)
    assert best == 2e-3
    assert status == {"0.001": "ok", "0.002": "ok", "0.004": "worse than static", "0.008": "diverged"}
    assert logged == ["   lr 0.004: worse than static (3.0500 nats against 3.0000 without adaptation)",
                      "   lr 0.008: diverged (nan nats against 3.0000 without adaptation)"]
    # a grid's own no-adaptation point may be chosen (it equals the baseline), but is not logged
    logged.clear()
    best, _ = fc.best_point({0.0: 3.0, 1.0: 3.1}, 3.0, "step", allowed=(0.0,), log=logged.append)
    assert best == 0.0 and logged == ["   step 1: worse than static (3.1000 nats against 3.0000 without adaptation)"]
    # allowed but diverged: still never chosen
    with pytest.raises(UserError) as e:
        fc.best_point({0.0: math.inf, 1.0: 3.1}, 3.0, "step", allowed=(0.0,), log=logged.append)
    assert str(e.value) == ("step: no point of the grid beats 3.0000 nats per token without adaptation on the "
                            "tuning texts (0: inf, 1: 3.1000)")
    # the lowest of the usable points, not the first
    assert fc.best_point({3.0: 2.5, 1.0: 2.9, 2.0: 2.7}, 3.0, "x", log=logged.append)[0] == 3.0


class _Result:
    def __init__(self, nll: float, tokens: int):
        self.nll, self.tokens = nll, tokens


class _Evaluator:
    """evaluate_documents of an lr whose tuning loss is ``curve(lr)`` nats per token."""
    made: list = []

    def __init__(self, lr: float, curve):
        self.lr, self.curve = lr, curve
        _Evaluator.made.append(lr)

    def evaluate_documents(self, docs):
        n = sum(d.numel() - 1 for d in docs)
        return _Result(self.curve(self.lr) * n, n)


def _search(curve, grid, static=3.0, known=None):
    _Evaluator.made = []
    logged = []
    out = fc.search_lr(lambda lr: _Evaluator(lr, curve), [torch.zeros(11), torch.zeros(5)], grid, static,
                       logged.append, "top 2 blocks", known=known)
    return out, logged, list(_Evaluator.made)


def test_search_lr_extends_the_grid_past_a_best_edge_by_its_own_ratio_at_most_twice():
    # best at the large edge: x2 twice (LR_EXTENSIONS), still best at the edge
    out, logged, made = _search(lambda lr: 3.0 - lr, [0.1, 0.2, 0.4])
    assert made == [0.1, 0.2, 0.4, 0.8, 1.6] and fc.LR_EXTENSIONS == 2
    assert out["best"] == 1.6 and out["best_at_edge"] is True
    assert list(out["grid_nats"]) == ["0.1", "0.2", "0.4", "0.8", "1.6"]
    assert logged[0] == "   top 2 blocks lr 0.1: tuning loss 2.9000"
    # best at the small edge: / 3 (the grid's ratio), then a minimum inside: stop
    out, _, made = _search(lambda lr: abs(math.log(lr / 0.1)), [0.3, 0.9, 2.7])
    assert made == [0.3, 0.9, 2.7, 0.1, 0.0333] and out["best"] == 0.1 and out["best_at_edge"] is False
    # a minimum inside the grid: nothing added
    out, _, made = _search(lambda lr: abs(lr - 0.2), [0.1, 0.2, 0.4])
    assert made == [0.1, 0.2, 0.4] and out["best"] == 0.2 and out["static_nats"] == 3.0
    assert out["status"] == {"0.1": "ok", "0.2": "ok", "0.4": "ok"}
    # a two-point grid extends by its own ratio (3), not the one-point default (2)
    out, _, made = _search(lambda lr: 3.0 - lr, [0.1, 0.3])
    assert made == [0.1, 0.3, 0.9, 2.7]


def test_search_lr_reuses_known_points_and_rounds_lrs_to_three_digits():
    out, _, made = _search(lambda lr: abs(lr - 0.2), [0.1, 0.2, 0.4], known={0.2000001: 0.5})
    assert made == [0.1, 0.4, 0.05] and out["grid_nats"]["0.2"] == 0.5  # the known loss, not the curve's 0.0
    assert out["best"] == 0.1  # 0.1 (0.1 nats) beats the known 0.5 and the extension's 0.05 (0.15)


def test_search_lr_never_chooses_a_diverged_lr_and_refuses_a_grid_with_none_below_static():
    out, logged, made = _search(lambda lr: math.inf if lr > 0.3 else 2.0 + lr, [0.1, 0.2, 0.4])
    assert out["best"] == 0.025 and out["status"]["0.4"] == "diverged"
    assert "   top 2 blocks lr 0.4: diverged (inf nats against 3.0000 without adaptation)" in logged
    assert made == [0.1, 0.2, 0.4, 0.05, 0.025]  # finite best at the small edge: extended downwards
    with pytest.raises(UserError, match="^top 2 blocks lr: no point of the grid beats 3.0000"):
        _search(lambda lr: 3.5, [0.1, 0.2])
    # every point non-finite: no extension, one line
    with pytest.raises(UserError):
        _search(lambda lr: math.nan, [0.1, 0.2])
    assert _Evaluator.made == [0.1, 0.2]
    # one-point grid: the ratio is 2
    out, _, made = _search(lambda lr: 3.0 - lr, [0.1])
    assert made == [0.1, 0.2, 0.4]


def test_search_lr_reports_the_cpu_seconds_it_took(monkeypatch):
    clock = iter([1000.0, 1003.5])
    monkeypatch.setattr(fc, "cpu", lambda: next(clock))
    assert _search(lambda lr: abs(lr - 0.2), [0.1, 0.2, 0.4])[0]["cpu_s"] == 3.5


def test_search_lr_without_a_name_calls_its_points_lr():
    logged = []
    fc.search_lr(lambda lr: _Evaluator(lr, lambda x: abs(x - 0.2)), [torch.zeros(3)], [0.1, 0.2, 0.4], 3.0,
                 logged.append)
    assert logged[0] == "    lr 0.1: tuning loss 0.1000"
    with pytest.raises(UserError, match="^lr: no point"):
        fc.search_lr(lambda lr: _Evaluator(lr, lambda x: 4.0), [torch.zeros(3)], [0.1, 0.2, 0.4], 3.0, logged.append)


def test_tuning_loss_is_nats_per_prediction_and_inf_when_the_evaluation_diverged():
    docs = [torch.zeros(11), torch.zeros(5)]
    assert fc.tuning_loss(_Evaluator(0.1, lambda lr: 2.5), docs) == pytest.approx(2.5)
    assert fc.tuning_loss(_Evaluator(0.1, lambda lr: math.nan), docs) == math.inf


class _Blocks(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Module() for _ in range(n))

    @property
    def layers(self):
        return self.model.layers


def test_top_linears_names_the_last_k_blocks_mlps_or_every_linear_map():
    lm = _Blocks(4)
    assert fc.top_linears(lm, 2) == "model.layers.2.mlp.*,model.layers.3.mlp.*"
    assert fc.top_linears(lm, 1, "all") == "model.layers.3.*"
    assert fc.top_linears(lm, 4, "all").split(",")[0] == "model.layers.0.*"
    for k in (0, 5):
        with pytest.raises(UserError, match=f"^top blocks must be in 1..4, got {k}$"):
            fc.top_linears(lm, k)
    with pytest.raises(UserError, match="^parts must be one of mlp, all, got 'attn'$"):
        fc.top_linears(lm, 2, "attn")


def test_split_roles_sorts_the_texts_by_role_and_names_the_english_scored_ones():
    t = {k: torch.full((3,), i) for i, k in enumerate("abcde")}
    texts = {"a": (t["a"], {"role": "scored", "english": True}), "b": (t["b"], {"role": "validation", "english": True}),
             "c": (t["c"], {"role": "scored", "english": False}), "d": (t["d"], {"role": "statistics", "english": True}),
             "e": (t["e"], {"role": "validation", "english": False})}
    scored, tuning, stats, english = fc.split_roles(texts)
    assert list(scored) == ["a", "c"] and scored["c"] is t["c"]
    assert [x[0].item() for x in tuning] == [1, 4] and stats is t["d"] and english == {"a"}


def test_summarise_measures_every_row_against_static_per_text_and_in_the_means():
    rows = {"static": {"a": _score(20.0, 200.0), "b": _score(40.0, 100.0)},
            "dyn": {"a": _score(15.0, 50.0, cpu_s=4.0), "b": _score(36.0, 50.0)}}
    out = fc.summarise(rows, english={"b"})
    assert out["static"]["mean_relative_perplexity_reduction"] == 0.0
    assert out["static"]["mean_throughput_ratio_to_static"] == 1.0
    d = out["dyn"]
    assert d["per_text"]["a"] == pytest.approx({"perplexity": 15.0, "loss_nats": math.log(15), "cpu_s": 4.0,
                                               "tokens_per_cpu_s": 50.0, "relative_perplexity_reduction": 0.25,
                                               "throughput_ratio_to_static": 0.25})
    assert d["mean_relative_perplexity_reduction"] == pytest.approx((0.25 + 0.1) / 2)
    assert d["mean_relative_perplexity_reduction_english"] == pytest.approx(0.1)
    assert d["mean_throughput_ratio_to_static"] == pytest.approx((0.25 + 0.5) / 2)
    assert fc.summarise(rows, english=set())["dyn"]["mean_relative_perplexity_reduction_english"] is None


def test_frequency_bins_put_each_count_in_its_decade():
    counts = Counter({1: 1, 2: 9, 3: 10, 4: 99, 5: 100, 6: 999, 7: 1000, 8: 10**6})
    assert fc.frequency_bins(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8]), counts) == \
        ["unseen", "1-9", "1-9", "10-99", "10-99", "100-999", "100-999", "1000+", "1000+"]


def test_figure2_pools_the_gains_in_bits_by_position_frequency_and_first_occurrence():
    # text t: ids 5 6 5 6 7 (predictions 6, 5, 6, 7); static loses 1 nat more than the row at every target but the
    # second, where the row is worse by 2. Text u: ids 8 9 (one prediction, 9), 3 nats gained
    t, u = torch.tensor([5, 6, 5, 6, 7]), torch.tensor([8, 9])
    rows = {"static": {"t": {"losses": torch.tensor([2.0, 2.0, 2.0, 2.0], dtype=torch.float64)},
                       "u": {"losses": torch.tensor([4.0], dtype=torch.float64)}},
            "dyn": {"t": {"losses": torch.tensor([1.0, 4.0, 1.0, 1.0], dtype=torch.float64)},
                    "u": {"losses": torch.tensor([1.0], dtype=torch.float64)}}}
    out = fc.figure2({"t": t, "u": u}, rows, ["dyn"], Counter({5: 50, 6: 5000, 9: 3, 7: 500}))
    g = [x / fc.LN2 for x in (1.0, -2.0, 1.0, 1.0, 3.0)]  # t's four gains, then u's
    assert out["dyn"]["position"] == {"0-64": {"bits": pytest.approx(sum(g) / 5), "tokens": 5}}
    assert out["dyn"]["frequency"] == {"1-9": {"bits": pytest.approx(g[4]), "tokens": 1},
                                       "10-99": {"bits": pytest.approx(g[1]), "tokens": 1},
                                       "100-999": {"bits": pytest.approx(g[3]), "tokens": 1},
                                       "1000+": {"bits": pytest.approx((g[0] + g[2]) / 2), "tokens": 2}}
    # a text's first id is context, not a target: t's target 5 is a repeat of it (6 is not: only the first id
    # counts), its second 6 a repeat of its first; 7 and u's 9 are first occurrences
    assert out["dyn"]["repeat"] == {"first occurrence": {"bits": pytest.approx((g[0] + g[3] + g[4]) / 3), "tokens": 3},
                                    "repeat": {"bits": pytest.approx((g[1] + g[2]) / 2), "tokens": 2}}
    assert list(out["dyn"]["frequency"]) == ["1-9", "10-99", "100-999", "1000+"]  # in order, empty bins left out
    unseen = fc.figure2({"u": u}, rows, ["dyn"], Counter())["dyn"]["frequency"]
    assert unseen == {"unseen": {"bits": pytest.approx(g[4]), "tokens": 1}}


def test_figure2_position_bins_follow_the_token_index_across_the_edges():
    n = 4097  # position 4096 is past the last edge: in no position bin
    ids = torch.arange(n + 1)
    gains = torch.arange(n, dtype=torch.float64)
    rows = {"static": {"t": {"losses": gains * fc.LN2}}, "dyn": {"t": {"losses": torch.zeros(n, dtype=torch.float64)}}}
    pos = fc.figure2({"t": ids}, rows, ["dyn"], Counter())["dyn"]["position"]
    assert pos == {"0-64": {"bits": pytest.approx(31.5), "tokens": 64},
                   "64-256": {"bits": pytest.approx(159.5), "tokens": 192},
                   "256-1024": {"bits": pytest.approx(639.5), "tokens": 768},
                   "1024-2048": {"bits": pytest.approx(1535.5), "tokens": 1024},
                   "2048-4096": {"bits": pytest.approx(3071.5), "tokens": 2048}}


def test_the_figure_2_plot_draws_each_methods_gains_in_its_three_panels(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    fig2 = {"dynamic": {"position": {"0-64": {"bits": 0.5}, "64-256": {"bits": 0.25}},
                        "frequency": {"unseen": {"bits": -0.5}}, "repeat": {"repeat": {"bits": 1.0}}},
            "fwl": {"position": {"0-64": {"bits": 0.125}}, "frequency": {"1-9": {"bits": 2.0}},
                    "repeat": {"first occurrence": {"bits": -1.0}, "repeat": {"bits": 0.75}}}}
    fc.plot(fig2, {"dynamic": "dynamic evaluation", "fwl": "FWL"}, tmp_path / "f.png", "4 texts")
    (fig,) = closed
    assert (tmp_path / "f.png").stat().st_size > 0
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["by position in the text (tokens)",
                                               "by frequency of the target in the training mix",
                                               "first occurrence vs repeat in the text"]
    data = [{ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines() if not ln.get_label().startswith("_")}
            for ax in axes]
    assert data == [{"dynamic evaluation": [0.5, 0.25], "FWL": [0.125]}, {"dynamic evaluation": [-0.5], "FWL": [2.0]},
                    {"dynamic evaluation": [1.0], "FWL": [-1.0, 0.75]}]
    assert [t.get_text() for t in axes[2].get_xticklabels()] == ["first occurrence", "repeat"]
    assert fig._suptitle.get_text().startswith("SmolLM2-135M: where the FWL and dynamic evaluation gain (4 texts;")
    # sizes that keep the long title, the panel titles and the one-row legend inside a 3-panel figure
    assert fig._suptitle.get_fontsize() == 10 and all(ax.title.get_fontsize() == 10 for ax in axes)
    assert tuple(fig.get_size_inches()) == (14, 4.2)  # three panels in a row, the legend below them
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["dynamic evaluation", "FWL"]


def test_a_static_row_scores_within_the_models_context_in_segments_and_is_timed_on_this_process(monkeypatch):
    from fastweights.adapt.dynamic import DynamicEvaluator

    lm = _tiny_lm()  # learned positions: nothing past 32 can be scored at once
    ids = torch.randint(0, 50, (80,), generator=torch.Generator().manual_seed(0))
    ev = fc.static_evaluator(lm, 8)
    monkeypatch.setattr(ev, "evaluate", None)  # a static row never takes the updating loop (no backward is timed)
    monkeypatch.setattr(fc, "cpu", (5.0 + 0.25 * i for i in itertools.count()).__next__)  # 0.25 s between readings
    out = fc.score(ev, ids)
    reference = DynamicEvaluator(lm, rule="sgd", lr=0.0, segment_len=8, context=32).static(ids).token_losses
    torch.testing.assert_close(out["losses"], torch.tensor(reference, dtype=torch.float64), rtol=0, atol=0)
    with torch.no_grad():  # within the context the scores are one forward pass's
        logits = lm.hf(input_ids=ids[None, :32]).logits[0, :-1]
    torch.testing.assert_close(out["losses"][:31], -torch.log_softmax(logits, -1).gather(-1, ids[1:32, None])[:, 0])
    assert out["loss_nats"] == pytest.approx(out["losses"].mean().item())
    assert out["perplexity"] == pytest.approx(math.exp(out["loss_nats"]))
    assert out["cpu_s"] == 0.25 and out["tokens_per_cpu_s"] == 79 / 0.25
    assert fc.score_texts(ev, {"b": ids[:20], "a": ids}).keys() == {"b", "a"}


def test_an_updating_row_scores_each_text_from_the_models_own_weights():
    from fastweights.adapt.dynamic import DynamicEvaluator

    lm = _tiny_lm()
    ids = _texts(30, 20)

    def make():
        return DynamicEvaluator(lm, rule="sgd", lr=0.5, segment_len=8, context=32)

    out = fc.score_texts(make(), {"b": ids[0], "a": ids[1]})
    assert list(out) == ["b", "a"]
    for name, t in zip(("b", "a"), ids):  # each text as a fresh evaluator scores it: no update carried over
        expected = torch.tensor(make().evaluate(t)[0].token_losses, dtype=torch.float64)
        torch.testing.assert_close(out[name]["losses"], expected, rtol=0, atol=0)
    static = fc.score(fc.static_evaluator(lm, 8), ids[0])["loss_nats"]
    assert out["b"]["loss_nats"] != pytest.approx(static, rel=1e-6)


def _tiny_lm():
    pytest.importorskip("transformers")
    import helpers
    from fastweights.hf.transformers_as_ours import HFCausalLM

    return HFCausalLM(helpers.tiny_gpt2(50, 32, 1))


def _texts(*lengths):
    return [torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]


def _forward_nll(lm, ids) -> float:
    """Sum of -log p(ids[1:]) in one forward pass (ids within the model's 32 positions)."""
    with torch.no_grad():
        logits = lm.hf(input_ids=ids[None, :-1]).logits[0]
    return -torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).sum().item()


def test_the_static_tuning_loss_is_nats_per_prediction_over_every_text_each_its_own_document():
    lm, tuning = _tiny_lm(), _texts(20, 9, 31)
    expected = sum(_forward_nll(lm, t) for t in tuning) / (19 + 8 + 30)  # per prediction, not a mean of means
    assert fc.static_tuning_loss(lm, tuning, 8) == pytest.approx(expected, rel=1e-9)


def test_the_tuning_loss_restarts_the_weights_for_each_text():
    from fastweights.adapt.dynamic import DynamicEvaluator

    lm, tuning = _tiny_lm(), _texts(20, 9, 31)

    def make():
        return DynamicEvaluator(lm, rule="sgd", lr=0.5, segment_len=8, context=32)

    each = [make().evaluate(t)[0] for t in tuning]  # a fresh evaluator (and weights) per text
    expected = sum(r.nll for r in each) / sum(r.tokens for r in each)
    assert fc.tuning_loss(make(), tuning) == pytest.approx(expected, rel=1e-9)
    assert expected != pytest.approx(fc.static_tuning_loss(lm, tuning, 8), rel=1e-6)  # the updates act


def test_tuning_rate_takes_the_static_pass_at_lr_zero_and_counts_predictions_per_cpu_second(monkeypatch):
    from fastweights.adapt.dynamic import DynamicEvaluator

    lm, tuning = _tiny_lm(), _texts(20, 9, 31)
    for lr, loss in ((0.0, fc.static_tuning_loss(lm, tuning, 8)),
                     (0.5, fc.tuning_loss(DynamicEvaluator(lm, rule="sgd", lr=0.5, segment_len=8, context=32),
                                          tuning))):
        ev = DynamicEvaluator(lm, rule="sgd", lr=lr, segment_len=8, context=32)
        monkeypatch.setattr(fc, "cpu", iter([10.0, 10.5]).__next__)  # the CPU clock at the start and the end
        got, rate = fc.tuning_rate(ev, tuning)
        assert got == pytest.approx(loss, rel=1e-9)
        assert rate == 57 / 0.5  # 19 + 8 + 30 predictions


def test_a_tuning_loss_that_diverged_is_infinite():
    class Diverged:
        def __init__(self, nll):
            self.nll = nll

        def evaluate_documents(self, docs):
            return type("R", (), {"nll": self.nll, "tokens": 10})()

    assert fc.tuning_loss(Diverged(float("nan")), []) == math.inf
    assert fc.tuning_loss(Diverged(float("inf")), []) == math.inf
    assert fc.tuning_loss(Diverged(25.0), []) == 2.5


def test_head_loss_in_pieces_carries_the_heads_state_and_equals_one_call():
    class RunningHead(nn.Module):  # logits depend on every earlier position through the carried state
        def __init__(self):
            super().__init__()
            self.out = nn.Linear(4, 7).double()

        def forward(self, h, ids, state):
            run = h.cumsum(1) + (0 if state is None else state)
            return self.out(run), run[:, -1:]

    torch.manual_seed(0)
    model = type("M", (), {"head": RunningHead()})()
    texts = [(torch.randn(1, n, 4, dtype=torch.float64), torch.randint(0, 7, (n,))) for n in (11, 6)]
    with torch.no_grad():
        nll = sum(torch.nn.functional.cross_entropy(model.head(h[:, :-1], ids[None, :-1], None)[0][0], ids[1:],
                                                    reduction="sum").item() for h, ids in texts)
        for piece in (1, 3, 512):
            assert fc.head_loss_on(model, texts, piece) == pytest.approx(nll / 15, rel=1e-12)


def test_the_figure_2_plot_tells_its_six_methods_apart_and_keeps_the_legend_below_the_panels(tmp_path, monkeypatch):
    # what a reader needs: each method its own colour and marker (the same in every panel), readable tick labels,
    # the zero line (above it: better than static), the y unit, one legend row below all three panels, 110 dpi
    import matplotlib.image
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    methods = ["dynamic", "fwl", "fwl_test_time_only", "fwl_bias_only", "fwl_slow_part", "fwl_step_scaled"]
    panel = {"a": {"bits": 0.5}, "b": {"bits": -0.25}}
    fc.plot({m: {"position": panel, "frequency": panel, "repeat": panel} for m in methods},
            {m: m.upper() for m in methods}, tmp_path / "f.png", "4 texts")
    (fig,) = closed
    assert matplotlib.image.imread(tmp_path / "f.png").shape[:2] == (462, 1540)  # 14 x 4.2 inches at 110 dpi
    styles = []
    for ax in fig.axes:
        lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
        assert [ln.get_label() for ln in lines] == [m.upper() for m in methods]
        assert all(list(ln.get_xdata()) == [0, 1] for ln in lines)
        styles.append([(to_rgba(ln.get_color()), ln.get_marker(), ln.get_linestyle()) for ln in lines])
        assert [t.get_rotation() for t in ax.get_xticklabels()] == [20, 20]
        assert ax.get_ylabel() == "NLL improvement over static (bits/token)"
        zero = [ln for ln in ax.get_lines() if ln.get_label().startswith("_")]
        assert len(zero) == 1 and list(zero[0].get_ydata()) == [0, 0] and to_rgba(zero[0].get_color()) == (0, 0, 0, 1)
    assert styles[0] == styles[1] == styles[2]
    colours, markers, dashes = zip(*styles[0])
    assert len(set(colours)) == len(set(markers)) == 6 and "None" not in markers
    assert dashes[0] == "-" and "-" not in dashes[1:]  # the FWL variants dashed or dotted, dynamic evaluation solid
    (legend,) = fig.legends
    assert legend._ncols == 6 and not legend.get_frame_on() and legend._loc == 8  # 8: lower center
    assert [(to_rgba(h.get_color()), h.get_marker()) for h in legend.legend_handles] == [st[:2] for st in styles[0]]
    assert fig._suptitle.get_text() == ("SmolLM2-135M: where the FWL and dynamic evaluation gain (4 texts; above 0 = "
                                        "better than static)")
    fig.canvas.draw()
    to_figure = fig.transFigure.inverted()
    legend_top = legend.get_window_extent().transformed(to_figure).y1
    boxes = [ax.get_tightbbox().transformed(to_figure) for ax in fig.axes]  # each panel with its labels and title
    assert all(b.y0 > legend_top for b in boxes)  # the tick labels clear the legend
    assert all(0 <= b.x0 and b.x1 <= 1 and b.y1 <= 1 for b in boxes)  # nothing cut off at the edges
    assert len({ax.get_position().y0 for ax in fig.axes}) == 1  # one row of panels, left to right
    assert [ax.get_position().x0 for ax in fig.axes] == sorted(ax.get_position().x0 for ax in fig.axes)


def test_top_blocks_include_names_the_last_blocks_and_the_final_norm_of_llama_and_gpt2():
    pytest.importorskip("transformers")
    import helpers
    from fastweights.hf.transformers_as_ours import HFCausalLM

    gpt2 = HFCausalLM(helpers.tiny_gpt2(50, 32, 3))  # its final norm is ln_f
    assert fc.top_blocks_include(gpt2, 2) == "hf.transformer.h.1.*,hf.transformer.h.2.*,hf.transformer.ln_f.*"
    llama = HFCausalLM(helpers.tiny_llama(50, 32, 3))  # its final norm is norm
    assert fc.top_blocks_include(llama, 1) == "hf.model.layers.2.*,hf.model.norm.*"
    assert fc.top_blocks_include(gpt2, 3).startswith("hf.transformer.h.0.*,")  # every block
    for k in (0, 4):
        with pytest.raises(UserError, match=rf"^top blocks must be in 1\.\.3, got {k}$"):
            fc.top_blocks_include(gpt2, k)
    del gpt2.hf.transformer.ln_f
    with pytest.raises(UserError, match=r"^GPT2Model: no final norm \(norm or ln_f\) found$"):
        fc.top_blocks_include(gpt2, 1)
