"""fastweights.experiments.fwl_comparison's searches and rows on stand-ins: the test-time step and step-scale
searches on a head whose loss is a made-up curve, and the FWL and dynamic-evaluation rows with stand-in evaluators,
statistics and searches that check what they are handed (the wiring the SmolLM2 benchmark's end-to-end runs cannot
see)."""

import itertools
import math

import pytest
import torch

from fastweights.core.errors import UserError
from fastweights.experiments import fwl_comparison as fc


class _StepHead:
    """A stand-in FWL head whose tuning loss is ``curve(step)`` at its test-time step size (or step scale)."""

    def __init__(self):
        self.options = type("O", (), {"test_time_step_size": None})()
        self.scale = 1.0

    def current_step_sizes(self):
        return {"lr": torch.tensor(0.25 * self.scale)}


def _step_model(monkeypatch, curve, attr="test_time_step_size"):
    model = type("M", (), {"head": _StepHead()})()
    tried = []

    def loss(m, hidden_and_ids):
        assert m is model and hidden_and_ids == "hidden"
        step = m.head.options.test_time_step_size if attr == "test_time_step_size" else m.head.scale
        tried.append(step)
        assert len(tried) < 20, "the search never stops"
        return curve(step)

    monkeypatch.setattr(fc, "head_loss_on", loss)
    return model, tried


def test_the_test_time_step_is_the_lowest_loss_of_the_grid_and_step_zero_and_is_set_on_the_head(monkeypatch):
    model, tried = _step_model(monkeypatch, lambda s: 2.0 + (s - 0.3) ** 2)
    out = fc.tune_test_time_step(model, "hidden", grid=[1.0, 0.3, 0.1])
    assert tried == [0.0, 0.1, 0.3, 1.0] and out["best"] == 0.3 and model.head.options.test_time_step_size == 0.3
    assert out["grid_nats"] == {"0": 2.09, "0.1": pytest.approx(2.04), "0.3": 2.0, "1": pytest.approx(2.49)}
    assert list(out["grid_nats"]) == ["0", "0.1", "0.3", "1"]
    assert out["status"] == {"0": "worse than static", "0.1": "ok", "0.3": "ok", "1": "diverged"}  # 19% above


def test_the_test_time_step_grid_grows_threefold_while_its_largest_step_is_best_up_to_ten(monkeypatch):
    model, tried = _step_model(monkeypatch, lambda s: 5.0 - s / 100)
    assert fc.tune_test_time_step(model, "hidden", grid=[1 / 3])["best"] == pytest.approx(27.0)  # past 10: no more
    assert tried == pytest.approx([0.0, 1 / 3, 1.0, 3.0, 9.0, 27.0])
    model, tried = _step_model(monkeypatch, lambda s: 5.0 - s / 100)
    assert fc.tune_test_time_step(model, "hidden", grid=[10.0])["best"] == 10.0 and tried == [0.0, 10.0]  # 10: no more
    model, tried = _step_model(monkeypatch, lambda s: 5.0 - s / 100 if s < 5 else math.nan)
    out = fc.tune_test_time_step(model, "hidden", grid=[0.5, 1.5])  # 4.5 is the last finite one: 13.5 diverged
    assert tried == [0.0, 0.5, 1.5, 4.5, 13.5] and out["best"] == 4.5 and out["status"]["13.5"] == "diverged"


def test_a_test_time_step_search_whose_baseline_diverged_names_itself(monkeypatch):
    model, tried = _step_model(monkeypatch, lambda s: math.nan)
    with pytest.raises(UserError, match=r"^test-time step: no point of the grid beats nan"):
        fc.tune_test_time_step(model, "hidden", grid=[1.0])
    assert tried == [0.0, 1.0]  # nothing finite: the grid is not extended


def test_step_zero_is_chosen_when_every_test_time_step_or_scale_is_worse(monkeypatch):
    import contextlib

    model, _ = _step_model(monkeypatch, lambda s: 2.0 + s / 100)  # within the margin: worse, not diverged
    assert fc.tune_test_time_step(model, "hidden", grid=[0.5, 1.0])["best"] == 0.0
    assert model.head.options.test_time_step_size == 0.0
    monkeypatch.setattr(fc, "scaled_step_sizes", lambda head, scale: contextlib.nullcontext())
    model, _ = _step_model(monkeypatch, lambda s: 2.0, attr="scale")
    assert fc.tune_step_scale(model, "hidden", grid=[0.5, 1.0])["best"] == 0.0


def test_the_step_scale_is_chosen_against_scale_zero_and_left_unset(monkeypatch):
    import contextlib

    @contextlib.contextmanager
    def scaled(head, scale):
        old, head.scale = head.scale, scale
        yield
        head.scale = old

    monkeypatch.setattr(fc, "scaled_step_sizes", scaled)
    model, tried = _step_model(monkeypatch, lambda s: {0.0: 3.0, 0.5: 2.5, 1.0: 2.8, 2.0: 3.05}[s], attr="scale")
    out = fc.tune_step_scale(model, "hidden", grid=[2.0, 0.5, 1.0])
    assert tried == [0.0, 0.5, 1.0, 2.0] and out["best"] == 0.5 and model.head.scale == 1.0  # restored
    assert out["grid_nats"] == {"0": 3.0, "0.5": 2.5, "1": 2.8, "2": 3.05}
    assert out["status"] == {"0": "worse than static", "0.5": "ok", "1": "ok", "2": "worse than static"}
    assert out["learned_step_sizes"] == {"lr": 0.25}
    model, _ = _step_model(monkeypatch, lambda s: math.nan, attr="scale")
    with pytest.raises(UserError, match=r"^step scale: no point of the grid beats nan"):
        fc.tune_step_scale(model, "hidden", grid=[1.0])


@pytest.mark.parametrize("rule", ["rms_global", "sgd"])
def test_the_dynamic_rows_hand_each_evaluator_the_chosen_setting_and_record_what_they_chose(monkeypatch, rule):
    # the wiring of dynamic_rows, on stand-ins for the evaluators, the statistics and the searches, each checking
    # that it is handed this model and these texts
    lm = type("LM", (), {"default_context": 1024})()
    stats_ids, scored, tuning, log = torch.arange(5), {"t": torch.arange(3)}, [torch.arange(4)], []
    say = log.append
    clock = itertools.count(100.0, 1.0)
    monkeypatch.setattr(fc, "cpu", lambda: float(next(clock)))
    calls = []

    def stats(model, ids, **kw):
        assert model is lm and ids is stats_ids
        calls.append(("stats", kw))
        return "MS_g"

    def lowrank_stats(model, ids, rank, **kw):
        assert model is lm and ids is stats_ids
        calls.append(("lowrank stats", rank, kw))
        return f"MS_g {rank}"

    class Recorded:
        def __init__(self, model, **kwargs):
            assert model is lm
            self.kwargs = kwargs

    def search(make, texts, grid, static, log_to, name):
        assert texts is tuning and log_to is say
        made[name] = make(0.5).kwargs
        calls.append(("search", name, grid, static))
        return {"best": 0.5, "grid_nats": {"0.5": 2.5}}

    def tuning_loss(ev, texts):
        assert texts is tuning and ev.kwargs["lr"] == 0.5
        return {8: 2.4, 32: 2.7}[ev.kwargs["rank"]]

    def top_blocks_row(model, *args):
        assert model is lm
        calls.append(("top", *args))
        return {"t": {"perplexity": 9.0}}, {"k": 2}

    def score_texts(ev, texts):
        assert texts is scored
        return {"t": {"perplexity": 10.0, "made": ev.kwargs}}

    made = {}
    monkeypatch.setattr(fc, "collect_grad_stats", stats)
    monkeypatch.setattr(fc, "collect_lowrank_grad_stats", lowrank_stats)
    monkeypatch.setattr(fc, "DynamicEvaluator", type("Full", (Recorded,), {}))
    monkeypatch.setattr(fc, "LowRankDynamicEvaluator", type("LowRank", (Recorded,), {}))
    monkeypatch.setattr(fc, "static_tuning_loss",
                        lambda model, texts, L: calls.append(("static", model is lm and texts is tuning, L)) or 3.0)
    monkeypatch.setattr(fc, "search_lr", search)
    monkeypatch.setattr(fc, "tuning_loss", tuning_loss)
    monkeypatch.setattr(fc, "top_blocks_row", top_blocks_row)
    monkeypatch.setattr(fc, "score_texts", score_texts)
    chosen = {"rule": rule, "lr": 0.01, "include": "blocks.*", "exclude": "embed*"}
    rows, tuned = fc.dynamic_rows(lm, scored, tuning, stats_ids, chosen, 64, say)

    rms = rule.startswith("rms")
    stats_kw = {"seq_len": 64, **fc.STATS}
    want_full = {"rule": rule, "lr": 0.5, "segment_len": 64, "context": 1024, "include": "blocks.*",
                 "exclude": "embed*", "grad_stats": "MS_g" if rms else None}
    assert made["dynamic"] == want_full and rows["dynamic"]["t"]["made"] == want_full
    assert tuned["dynamic"] == {"rule": rule, "include": "blocks.*", "exclude": "embed*",
                                "ms_g_cpu_s": 1.0, "lr_search": {"best": 0.5, "grid_nats": {"0.5": 2.5}}, "lr": 0.5}
    assert rows["dynamic_top_blocks"] == {"t": {"perplexity": 9.0}} and tuned["dynamic_top_blocks"] == {"k": 2}
    assert ("top", fc.TOP_BLOCKS, {"rule": rule, "lr_there": 0.01}, scored, tuning, "MS_g" if rms else None, 64,
            say, 3.0) in calls
    assert ("search", "dynamic", [0.01 * f for f in fc.DYNAMIC_LR_FACTORS], 3.0) in calls
    assert ("search", "low-rank 16", [0.01 * f for f in fc.LOWRANK_LR_FACTORS], 3.0) in calls  # the middle rank
    lowrank = {"rule": rule, "lr": 0.5, "segment_len": 64, "context": 1024, "rank": 16,
               "grad_stats": "MS_g 16" if rms else None}
    assert made["low-rank 16"] == lowrank
    assert rows["dynamic_lowrank"]["t"]["made"] == {**lowrank, "rank": 8, "grad_stats": "MS_g 8" if rms else None}
    assert tuned["dynamic_lowrank"] == {"rule": rule, "rank": 8, "lr": 0.5,
                                        "lr_search": {"best": 0.5, "grid_nats": {"0.5": 2.5}}, "lr_search_rank": 16,
                                        "rank_nats": {"8": 2.4, "16": 2.5, "32": 2.7},
                                        "ms_g_cpu_s": {"8": 1.0, "16": 1.0, "32": 1.0}}
    want_stats = [("stats", {"exclude": "embed*", **stats_kw})] if rms else []
    want_stats += [("lowrank stats", r, stats_kw) for r in (16, 8, 32)] if rms else []
    assert [c for c in calls if c[0] in ("stats", "lowrank stats")] == want_stats  # each rank's statistics once
    assert [c for c in calls if c[0] == "static"] == [("static", True, 64)]
    assert log == ["   low-rank 8 lr 0.5: tuning loss 2.4000", "   low-rank 32 lr 0.5: tuning loss 2.7000",
                   "dynamic: t 10.000", "dynamic_top_blocks: t 9.000", "dynamic_lowrank: t 10.000"]


def test_a_low_rank_rank_search_with_no_rank_below_static_names_itself(monkeypatch):
    monkeypatch.setattr(fc, "static_tuning_loss", lambda *a: 2.0)
    monkeypatch.setattr(fc, "search_lr", lambda make, *a: {"best": 0.5, "grid_nats": {"0.5": 2.5}})
    monkeypatch.setattr(fc, "tuning_loss", lambda ev, texts: 2.1)
    monkeypatch.setattr(fc, "LowRankDynamicEvaluator", lambda *a, **k: None)
    monkeypatch.setattr(fc, "top_blocks_row", lambda *a: ({}, {}))
    monkeypatch.setattr(fc, "score_texts", lambda ev, texts: {})
    monkeypatch.setattr(fc, "DynamicEvaluator", lambda *a, **k: None)
    lm = type("LM", (), {"default_context": 1024})()
    with pytest.raises(UserError, match=r"^low-rank rank: no point of the grid beats 2\.0000"):
        fc.dynamic_rows(lm, {}, [], None, {"rule": "sgd", "lr": 0.01, "include": None, "exclude": None}, 64,
                        lambda *_: None)


def test_the_fwl_rows_read_each_backbones_tuning_states_once_and_score_each_head_and_its_slow_part(monkeypatch):
    import contextlib

    shared, own, tuning, scored, log = object(), object(), ["tuning"], {"t": None, "u": None}, []
    heads = {"fwl": type("H", (), {"backbone": shared, "head": "fwl head"})(),
             "fwl_test_time_only": type("H", (), {"backbone": shared, "head": "tto head"})(),
             "fwl_bias_only": type("H", (), {"backbone": own, "head": "bias head"})()}
    hidden_calls, parts = [], []

    def tuning_hidden(backbone, texts):
        assert texts is tuning
        hidden_calls.append(backbone)
        return [backbone]

    def tune(best):
        def tuned(model, hidden):
            assert model in heads.values() and hidden == [model.backbone]
            return {"best": best, "head": model.head}
        return tuned

    @contextlib.contextmanager
    def part(name, head):
        assert head in ("fwl head", "tto head", "bias head")
        parts.append(f"{name} {head}")
        yield
        parts.pop()

    def score_texts(ev, texts):
        assert texts is scored and ev[0] in heads.values()
        return {k: {"perplexity": 1.0 + len(parts), "ev": ev, "as": list(parts)} for k in texts}

    monkeypatch.setattr(fc, "tuning_hidden", tuning_hidden)
    monkeypatch.setattr(fc, "tune_test_time_step", tune(0.5))
    monkeypatch.setattr(fc, "tune_step_scale", tune(2.0))
    monkeypatch.setattr(fc, "static_evaluator", lambda model, L: (model, L))
    monkeypatch.setattr(fc, "slow_part", lambda head: part("slow", head))
    monkeypatch.setattr(fc, "scaled_step_sizes", lambda head, scale: part(f"x{scale:g}", head))
    monkeypatch.setattr(fc, "score_texts", score_texts)
    rows, tuned = fc.fwl_rows(heads, scored, tuning, 64, log=log.append)
    assert hidden_calls == [shared]  # one pass for the backbone two heads share; none for a head not tuned
    assert tuned == {"fwl_test_time_only": {"best": 0.5, "head": "tto head"},
                     "fwl_step_scale": {"best": 2.0, "head": "fwl head"}}
    assert sorted(rows) == ["fwl", "fwl_bias_only", "fwl_bias_only_slow_part", "fwl_slow_part", "fwl_step_scaled",
                            "fwl_test_time_only", "fwl_test_time_only_slow_part"]
    for row, model in heads.items():
        assert rows[row]["t"]["ev"] == (model, 64) and rows[row]["t"]["as"] == []
        assert rows[f"{row}_slow_part"]["t"]["ev"] == (model, 64)
        assert rows[f"{row}_slow_part"]["t"]["as"] == [f"slow {model.head}"]
    assert rows["fwl_step_scaled"]["t"]["ev"] == (heads["fwl"], 64)
    assert rows["fwl_step_scaled"]["t"]["as"] == ["x2 fwl head"]
    both = "t 1.000 (slow part 2.000), u 1.000 (slow part 2.000)"
    assert log == ["test-time-only step size: 0.5", f"fwl: {both}", f"fwl_test_time_only: {both}",
                   f"fwl_bias_only: {both}", "FWL step-size scale chosen on tuning text: 2"]
