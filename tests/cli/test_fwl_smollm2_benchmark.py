"""benchmarks/quality/fwl_smollm2.py and its rows (fastweights.experiments.fwl_comparison) on a tiny offline Llama, in
seconds: the texts are long enough and never training text, the slow-part block zeroes the FWL's fast effect whatever
the step sizes' parameterisation and puts the head back, the static row is the model without a head, the gain split
adds up, and every row has its throughput and its setting chosen on tuning text."""

import json
import math
import re
import sys

import pytest
import torch

pytest.importorskip("transformers")

from helpers import benchmark_script, import_benchmark, run_script, tiny_llama_dir  # noqa: E402

from fastweights.hf.fwl_head import PRETRAINED_FWL_DEFAULTS, HFCausalLMWithFWL  # noqa: E402
from fastweights.hf.fwl_training import HELD_OUT_NAMES, TRAINING_MIX  # noqa: E402
from fastweights.layers.fwl import scaled_step_sizes, slow_part  # noqa: E402
from fastweights.layers.fwl import FWLOptions  # noqa: E402
import fastweights.experiments.fwl_comparison as fc  # noqa: E402

sys.path.insert(0, str(benchmark_script("fwl_smollm2").parent))
import fwl_smollm2 as bench  # noqa: E402

from fastweights.core.errors import UserError  # noqa: E402

sys.path.pop(0)

L = 8  # segment length of the tiny rows


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from fastweights.hf.transformers_as_ours import load_hf_model

    lm, tok = load_hf_model(str(tiny_llama_dir(tmp_path_factory.mktemp("llama"), max_positions=512)))
    return lm.double().eval(), tok


def head_on(lm, acting=True, **options):
    """An FWL head on ``lm``; ``acting``: a LayerNorm gain and step sizes as after training, so the fast part acts;
    otherwise the identity (gain, bias and step sizes 0: f(h) = 0 and no update)."""
    identity = {} if acting else {"ln_gain_init": 0.0, "step_size_log": False, "step_size_init": 0.0}
    opts = FWLOptions(**{**PRETRAINED_FWL_DEFAULTS, "segment_len": 4, "chunk_size": 8, **identity, **options})
    model = HFCausalLMWithFWL(lm, opts).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.head.ln_weight.copy_(0.5 + 0.1 * torch.randn(model.head.ln_weight.shape, generator=g) if acting else 0.0)
        model.head.ln_bias.zero_()
    return model.eval()


def ids(n, seed=3, vocab=50257):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_the_texts_are_long_enough_and_never_training_text(llama):
    """>= 3 English scored texts and Don Quijote, 2 tuning texts, each >= 4,096 predictions (GPT-2's tokenizer,
    a BPE of SmolLM2's kind); every scored and tuning document is held out of the training mix, by name and by
    content."""
    from fastweights.data import load_corpus

    _, tok = llama
    texts = fc.load_texts(tok, 4096, 4096)
    roles = {k: info["role"] for k, (_, info) in texts.items()}
    scored = [k for k, r in roles.items() if r == "scored"]
    assert len([k for k in scored if texts[k][1]["english"]]) >= 3 and "don_quijote" in scored
    assert list(roles.values()).count("validation") >= 2 and list(roles.values()).count("statistics") == 1
    for k, (x, info) in texts.items():
        assert x.numel() == {"statistics": fc.STATS_TOKENS}.get(info["role"], 4096) + 1, k
    mix = "\n".join(d.text for corpus in TRAINING_MIX for d in load_corpus(corpus)
                    if not any(n in d.name.lower() for n in HELD_OUT_NAMES))
    for spec, _ in fc.TEXTS:
        if spec.role == "statistics":
            continue  # gradient statistics come from training-like text (the module docstring)
        assert any(n in spec.document.lower() for n in HELD_OUT_NAMES), spec
        (doc,) = load_corpus(spec.document)
        start = doc.text.find(spec.marker)
        assert doc.text[start + 500: start + 700] not in mix, spec


@pytest.mark.parametrize("options", [{}, {"step_size_log": True, "step_size_init": 0.2},
                                     {"test_time_only": True, "test_time_step_size": 0.2},
                                     {"bias_only": True}], ids=["learned", "log", "test-time-only", "bias-only"])
def test_the_slow_part_zeroes_the_fast_effect_and_puts_the_head_back(llama, options):
    """Inside ``slow_part`` the head's logits are its slow pass (step sizes 0: theta' = theta), however the step
    sizes are parameterised; after it (also after an error inside) the head's step sizes and logits are as
    before and no replacement is left on it. Mutant caught: the method not put back on exit."""
    lm, _ = llama
    model = head_on(lm, **{"step_size_init": 0.2, **options})
    head = model.head
    x = ids(40)[None]
    with torch.no_grad():
        h, _ = lm.forward_features(x)
        full, _ = head(h, x)
        slow = head.slow_forward(h)
        before = {n: a.detach().clone() for n, a in head.current_step_sizes().items()}
        assert (full - slow).abs().max() > 1e-4  # the fast part acts
        with slow_part(head):
            assert all(float(a) == 0.0 for a in head.current_step_sizes().values())
            zeroed, _ = head(h, x)
        torch.testing.assert_close(zeroed, slow, rtol=0, atol=1e-10)
        with pytest.raises(RuntimeError), slow_part(head):
            raise RuntimeError("inside the block")
        assert "current_step_sizes" not in vars(head)
        after = head.current_step_sizes()
        assert set(after) == set(before) and all(torch.equal(after[n].detach(), before[n]) for n in before)
        again, _ = head(h, x)
    torch.testing.assert_close(again, full, rtol=0, atol=0)


def test_scaled_step_sizes_nest_and_scale(llama):
    lm, _ = llama
    head = head_on(lm, step_size_init=0.2).head
    with scaled_step_sizes(head, 0.5):
        with scaled_step_sizes(head, 0.5):
            assert all(math.isclose(float(a.detach()), 0.05, rel_tol=1e-6) for a in head.current_step_sizes().values())
        assert all(math.isclose(float(a.detach()), 0.1, rel_tol=1e-6) for a in head.current_step_sizes().values())
    assert all(math.isclose(float(a.detach()), 0.2, rel_tol=1e-6) for a in head.current_step_sizes().values())


DYNAMIC_LOG: list[str] = []  # what dynamic_rows and fwl_rows said while the rows were made


@pytest.fixture(scope="module")
def rows(llama, monkeypatch_module):
    """Every row of the benchmark on the tiny Llama: 2 scored texts of 40 predictions, 2 tuning texts of 24."""
    lm, _ = llama
    monkeypatch_module.setattr(fc, "LOWRANK_RANKS", (2, 4, 8))  # the tiny MLP's projections have rank <= 16
    scored = {"a": ids(41, seed=5), "b": ids(41, seed=6)}
    # tuning texts that repeat themselves, so adapting to them beats static (a search refuses a grid where nothing
    # does, and on random tokens nothing does)
    tuning = [torch.cat([ids(8, seed=s)] * 3 + [ids(1, seed=s)]) for s in (7, 8)]
    stats_ids = ids(600, seed=9)
    chosen = {"rule": "rms", "lr": 1e-3, "include": None, "exclude": "hf.model.embed_tokens.*"}
    heads = {"fwl": head_on(lm, step_size_init=0.2),  # first, as the script loads them (freezing the backbone)
             "fwl_test_time_only": head_on(lm, test_time_only=True),
             "fwl_bias_only": head_on(lm, bias_only=True, step_size_init=0.2)}
    out = {"static": fc.score_texts(fc.static_evaluator(lm, L), scored)}
    dyn, tuned = fc.dynamic_rows(lm, scored, tuning, stats_ids, chosen, L, log=DYNAMIC_LOG.append)
    out.update(dyn)
    fwl, fwl_tuned = fc.fwl_rows(heads, scored, tuning, L, log=DYNAMIC_LOG.append)
    out.update(fwl)
    return out, {**tuned, **fwl_tuned}, scored, heads


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_the_static_row_is_the_model_without_a_head(llama, rows):
    """Static: the backbone's own one-pass losses (not a head's), and an identity head scores the same."""
    lm, _ = llama
    out, _, scored, _ = rows
    for k, x in scored.items():
        with torch.no_grad():
            logits = lm(x[None]).logits[0, :-1]
        want = torch.nn.functional.cross_entropy(logits.double(), x[1:], reduction="none")
        torch.testing.assert_close(out["static"][k]["losses"], want, rtol=0, atol=1e-9)
        identity = fc.score(fc.static_evaluator(head_on(lm, acting=False), L), x)
        torch.testing.assert_close(identity["losses"], want, rtol=0, atol=1e-9)


def test_each_lr_search_of_the_dynamic_rows_is_named_in_the_log(rows):
    """The full dynamic evaluation's search says its name on each lr it tries (seed-15 mutation draw: the name
    misspelt), as the other rows' searches do theirs."""
    full = [line for line in DYNAMIC_LOG if line.lstrip().startswith("dynamic lr ")]
    assert len(full) >= 2 and all(": tuning loss " in line for line in full)
    ranks = [line.split()[1] for line in DYNAMIC_LOG if line.lstrip().startswith("low-rank ") and " lr " in line]
    # the lr search at the middle rank names it on each lr it tries (its grid and any extension), the others once
    # (seed-16 draw: the search named None)
    assert ranks.count("4") >= len(fc.LOWRANK_LR_FACTORS) and ranks.count("2") == ranks.count("8") == 1, ranks
    # each head's line: every text's perplexity with its slow part's, the texts separated by ", "
    (fwl,) = [line for line in DYNAMIC_LOG if line.startswith("fwl: ")]
    assert re.fullmatch(r"fwl: a [0-9.]+ \(slow part [0-9.]+\), b [0-9.]+ \(slow part [0-9.]+\)", fwl), fwl


def test_every_row_has_its_throughput_and_the_summary_its_ratios(rows):
    out, tuned, scored, heads = rows
    expected = {"static", "dynamic", "dynamic_top_blocks", "dynamic_lowrank", "fwl", "fwl_slow_part",
                "fwl_test_time_only", "fwl_test_time_only_slow_part", "fwl_bias_only", "fwl_bias_only_slow_part",
                "fwl_step_scaled"}
    assert set(out) == expected
    results = fc.summarise(out, english={"a"})
    for row in expected:
        for k in scored:
            r = results[row]["per_text"][k]
            assert r["tokens_per_cpu_s"] > 0 and math.isfinite(r["throughput_ratio_to_static"]), (row, k)
        assert math.isfinite(results[row]["mean_throughput_ratio_to_static"])
        assert results[row]["mean_relative_perplexity_reduction_english"] == pytest.approx(
            results[row]["per_text"]["a"]["relative_perplexity_reduction"])
    assert results["static"]["mean_relative_perplexity_reduction"] == 0.0
    for row in ("dynamic", "dynamic_top_blocks", "dynamic_lowrank", "fwl"):  # each one changes the scores
        assert out[row]["a"]["loss_nats"] != out["static"]["a"]["loss_nats"], row
    acc = bench.acceptance_of(results)
    assert {"share_met", "speed_met", "throughput_over_static_met", "fwl_throughput_over_static"} <= set(acc)


def test_the_settings_are_chosen_on_tuning_text(llama, rows):
    lm, _ = llama
    out, tuned, _, heads = rows
    for row in ("dynamic", "dynamic_top_blocks"):
        search = tuned[row]["lr_search"]
        assert tuned[row]["lr"] == search["best"] and search["grid_nats"][f"{search['best']:.3g}"] == min(
            search["grid_nats"].values())
    assert tuned["dynamic_lowrank"]["rank"] in (2, 4, 8)
    assert tuned["dynamic_lowrank"]["rank_nats"][str(tuned["dynamic_lowrank"]["rank"])] == min(
        tuned["dynamic_lowrank"]["rank_nats"].values())
    assert heads["fwl_test_time_only"].head.options.test_time_step_size == tuned["fwl_test_time_only"]["best"]
    assert str(tuned["fwl_step_scale"]["best"]) in {f"{s:g}" for s in fc.STEP_SCALES} | {
        str(s) for s in fc.STEP_SCALES}
    # the top-blocks row adapts the last 2 decoder blocks and the final norm, nothing else
    from fastweights.adapt.parameter_selection import select_parameters

    names = set(select_parameters(lm, fc.top_blocks_include(lm)))
    assert names and all(n.startswith(("hf.model.layers.1.", "hf.model.layers.0.", "hf.model.norm.")) for n in names)
    assert any(n.startswith("hf.model.norm.") for n in names)
    # the tiny Llama has 2 blocks: both are the top 2
    assert {n.split(".")[3] for n in names if ".layers." in n} == {"0", "1"}


class _Quadratic:
    """An evaluator stand-in whose tuning loss is (log10 lr - log10 optimum)^2 per prediction."""

    def __init__(self, lr, optimum):
        self.loss = (math.log10(lr) - math.log10(optimum)) ** 2

    def evaluate_documents(self, docs):
        from fastweights.loops.evaluate import EvalResult

        return EvalResult(self.loss * 10, 10)


@pytest.mark.parametrize("optimum, best, at_edge", [(2.2e-5, 2e-5, False), (1e-2, 1.6e-4, True), (1e-9, 2.5e-6, True)])
def test_the_lr_search_extends_past_a_best_edge_at_most_twice(optimum, best, at_edge):
    """Mutants caught: extension in the wrong direction, or without limit."""
    r = fc.search_lr(lambda lr: _Quadratic(lr, optimum), [], [1e-5, 2e-5, 4e-5], static=100.0, log=lambda _m: None)
    assert r["best"] == pytest.approx(best) and r["best_at_edge"] is at_edge
    assert len(r["grid_nats"]) == 3 + (2 if at_edge else 0)


def test_a_point_already_measured_is_not_run_again_by_the_lr_search():
    """``search_lr(known={lr: loss})``: smollm2_fast_dynamic hands over the point it timed at that lr; the search
    takes its loss (the same grid key, rounded as the search rounds) and runs only the others."""
    made = []

    def make(lr):
        made.append(lr)
        return _Quadratic(lr, 2.2e-5)

    measured = _Quadratic(2e-5, 2.2e-5).loss
    r = fc.search_lr(make, [], [1e-5, 2e-5, 4e-5], static=100.0, log=lambda _m: None, known={2.0000001e-5: measured})
    assert sorted(made) == [1e-5, 4e-5] and r["grid_nats"]["2e-05"] == measured and r["best"] == 2e-5


def test_the_top_blocks_linears_are_their_mlps_or_every_linear_map(llama):
    """smollm2_fast_dynamic's two parts of the last K blocks (fwl_comparison.top_linears), as low-rank adaptation
    matches them: the MLP projections, or every linear map (attention's too), of those blocks only."""
    from fastweights.adapt.lowrank import LowRankAdaptation

    top = fc
    lm, _ = llama
    mlp = LowRankAdaptation(lm, top.top_linears(lm, 1, "mlp"), rank=2).names
    every = LowRankAdaptation(lm, top.top_linears(lm, 1, "all"), rank=2).names
    assert mlp and all(".layers.1.mlp." in n for n in mlp)
    assert set(mlp) < set(every) and all(".layers.1." in n for n in every)
    assert any("self_attn" in n for n in every)
    with pytest.raises(UserError, match="parts must be one of mlp, all"):
        top.top_linears(lm, 1, "attention")


def test_the_gain_split_adds_up(rows):
    out, _, scored, heads = rows
    for row in heads:
        split = fc.gain_split(out["static"], out[row], out[row + bench.SLOW_PART])
        for k in scored:
            p = split["per_text"][k]
            assert p["slow_reduction"] + p["fast_reduction"] == pytest.approx(p["full_reduction"], abs=1e-12)
            assert p["fast_nats_per_token"] == pytest.approx(
                out[row + bench.SLOW_PART][k]["loss_nats"] - out[row][k]["loss_nats"])
        assert split["mean_slow_reduction"] + split["mean_fast_reduction"] == pytest.approx(
            split["mean_full_reduction"], abs=1e-12)
    # the FWL's slow part is its slow pass: an identity-free head whose fast part acts differs from it
    assert out["fwl"]["a"]["loss_nats"] != out["fwl_slow_part"]["a"]["loss_nats"]


def test_missing_checkpoints_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from fastweights.cli.script_parser import exit_status_of

    monkeypatch.setattr(sys, "argv", ["fwl_smollm2.py", "--runs", str(tmp_path / "none")])
    assert exit_status_of(bench.main) == 2  # the script's entry: sys.exit(exit_status_of(main))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no trained FWL head" in err[0]


def test_a_later_token_moves_no_earlier_score_in_the_rows(llama):
    """Through score(), the rows that learn from the text (the FWL with scaled steps, its slow part, dynamic
    evaluation of the top blocks, low-rank) give the same losses before position j whatever follows j."""
    lm, _ = llama
    x = ids(41, seed=11)
    y = x.clone()
    y[25:] = ids(16, seed=12)
    model = head_on(lm, step_size_init=0.2)
    evaluators = [fc.static_evaluator(model, L),
                  fc.DynamicEvaluator(lm, rule="sgd", lr=1e-2, segment_len=L, context=lm.default_context,
                                      include=fc.top_blocks_include(lm)),
                  fc.LowRankDynamicEvaluator(lm, rule="sgd", lr=1e-2, segment_len=L, context=lm.default_context, rank=4)]
    for factor in (0.5, 0.0):
        for ev in evaluators:
            with scaled_step_sizes(model.head, factor):
                a, b = fc.score(ev, x)["losses"], fc.score(ev, y)["losses"]
            torch.testing.assert_close(a[:24], b[:24], rtol=0, atol=0)
            assert not torch.equal(a[24:], b[24:])


def test_the_tuning_loss_in_pieces_equals_one_call(llama):
    """head_loss_on reads each text in pieces with the head's state carried: the same loss as one call."""
    lm, _ = llama
    model = head_on(lm, step_size_init=0.2)
    hidden = fc.tuning_hidden(lm, [ids(40, seed=13), ids(29, seed=14)])
    one = fc.head_loss_on(model, hidden, piece=10_000)
    assert fc.head_loss_on(model, hidden, piece=7) == pytest.approx(one, rel=1e-10)
    assert fc.head_loss_on(model, hidden, piece=1) == pytest.approx(one, rel=1e-10)


def test_the_two_halves_are_saved_and_refused_when_they_do_not_match(tmp_path):
    """--part dynamic / fwl then --combine: a half made with other settings, or whose static losses are not the
    other half's, is refused in one line (mutants caught: the settings not compared; the static rows not compared);
    the dynamic setting's file is compared by content, so halves run from two checkouts combine."""
    import argparse

    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    for d in ("one", "two"):
        (tmp_path / d / "x.json").write_text('{"chosen": "rms"}')
    args = argparse.Namespace(part="dynamic", tokens=8, val_tokens=8, dynamic_from=str(tmp_path / "one" / "x.json"),
                              threads=1)
    static = {"a": {"losses": torch.tensor([1.0, 2.0], dtype=torch.float64)}}
    bench.save_part(tmp_path, args, {"static": static}, {"dynamic": {}}, 1.0, 2.0)
    got = bench.load_part(tmp_path, "dynamic", args)
    assert got["rows"]["static"]["a"]["losses"].tolist() == [1.0, 2.0] and got["cpu_s"] == 1.0
    elsewhere = argparse.Namespace(**{**vars(args), "dynamic_from": str(tmp_path / "two" / "x.json")})
    assert bench.load_part(tmp_path, "dynamic", elsewhere)["cpu_s"] == 1.0  # the same file in another checkout
    (tmp_path / "two" / "x.json").write_text('{"chosen": "sgd"}')
    with pytest.raises(UserError, match="made with"):
        bench.load_part(tmp_path, "dynamic", elsewhere)
    with pytest.raises(UserError, match="--part fwl"):
        bench.load_part(tmp_path, "fwl", args)
    with pytest.raises(UserError, match="made with"):
        bench.load_part(tmp_path, "dynamic", argparse.Namespace(**{**vars(args), "tokens": 16}))
    bench.same_static(static, {"a": {"losses": static["a"]["losses"].clone()}})
    with pytest.raises(UserError, match="static losses differ on a"):
        bench.same_static(static, {"a": {"losses": static["a"]["losses"] + 1e-6}})


def test_the_lr_comparison_reads_head_folders_by_lr_and_refuses_none(tmp_path):
    """fwl_head_lr.py's --runs: the folders with a training.json, ordered by their learning rate; none is one line."""
    lr_bench = import_benchmark("fwl_head_lr")
    for name, lr in (("b", 1e-3), ("a", 3e-4), ("c", 1e-4)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "training.json").write_text(json.dumps({"lr": lr}))
    (tmp_path / "cache").mkdir()  # no training.json: not a head
    assert [d.name for d in lr_bench.head_dirs(tmp_path)] == ["c", "a", "b"]
    with pytest.raises(UserError, match="no trained head"):
        lr_bench.head_dirs(tmp_path / "cache")
    with pytest.raises(UserError, match="no trained head"):
        lr_bench.head_dirs(tmp_path / "missing")


def test_the_lr_comparison_without_heads_is_one_line_and_exit_2(tmp_path):
    r = run_script(benchmark_script("fwl_head_lr"), "--runs", str(tmp_path / "none"), "--out", str(tmp_path / "x.json"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "no trained head" in r.stderr, r.stderr
    assert not (tmp_path / "x.json").exists()


def test_each_head_is_tuned_on_its_own_backbones_hidden_states(llama, monkeypatch):
    """Heads trained with top blocks each replace those blocks in their own backbone copy (fwl_top_blocks.py): the
    test-time step and the step scale are chosen on the hidden states of the head's own backbone, not of the first
    head's. Mutant caught: one tuning pass on the first head's backbone for every head."""
    import copy

    lm, _ = llama
    other = copy.deepcopy(lm)
    with torch.no_grad():
        for p in other.layers[-1].parameters():
            p.mul_(1.5)
    heads = {"fwl": head_on(lm, step_size_init=0.2), "fwl_test_time_only": head_on(other, test_time_only=True)}
    tuning = [ids(25, seed=7)]
    seen = {}
    for name in ("tune_test_time_step", "tune_step_scale"):
        real = getattr(fc, name)
        monkeypatch.setattr(fc, name, lambda m, h, _real=real, _n=name: seen.setdefault(_n, (m, h)) and _real(m, h))
    fc.fwl_rows(heads, {"a": ids(17, seed=5)}, tuning, L, log=lambda _m: None)
    for name, model in (("tune_test_time_step", heads["fwl_test_time_only"]), ("tune_step_scale", heads["fwl"])):
        m, hidden = seen[name]
        assert m is model
        torch.testing.assert_close(hidden[0][0], fc.tuning_hidden(model.backbone, tuning)[0][0], rtol=0, atol=0)
    assert not torch.equal(seen["tune_test_time_step"][1][0][0], seen["tune_step_scale"][1][0][0])


def test_a_point_that_diverged_or_does_not_beat_the_baseline_is_never_chosen(capsys):
    """fwl_comparison.best_point (issue 49, scope 4): NaN, inf and a loss past the margin are never chosen, a loss
    above the baseline only when it is the grid's own no-adaptation point, and a grid with nothing to choose is one
    UserError naming every point."""
    nan, inf = float("nan"), float("inf")
    best, status = fc.best_point({1e-3: nan, 2e-3: 2.9, 4e-3: 2.8, 8e-3: inf}, 3.0, "lr")
    assert best == 4e-3 and status == {"0.001": "diverged", "0.002": "ok", "0.004": "ok", "0.008": "diverged"}
    assert "0.001: diverged" in capsys.readouterr().out
    assert fc.best_point({0.0: 3.0, 1.0: 3.05}, 3.0, "scale", allowed=(0.0,))[0] == 0.0
    with pytest.raises(UserError, match=r"no point of the grid beats 3\.0000.*0\.001: nan"):
        fc.best_point({1e-3: nan, 2e-3: 3.01, 4e-3: 99.0}, 3.0, "lr")
    with pytest.raises(UserError):  # the no-adaptation point itself not finite: nothing to compare against
        fc.best_point({0.0: nan, 1.0: 2.0}, nan, "scale", allowed=(0.0,))


def test_an_lr_search_where_every_lr_hurts_is_refused_and_a_diverged_lr_never_wins():
    """Mutant caught: search_lr choosing the lowest loss whatever static's (a diverged grid named best)."""
    quiet = {"log": lambda _m: None}
    with pytest.raises(UserError, match="dynamic lr"):
        fc.search_lr(lambda lr: _Quadratic(lr, 2e-5), [], [1e-5, 2e-5, 4e-5], static=-1.0, name="dynamic", **quiet)

    class _NaNAbove(_Quadratic):
        def __init__(self, lr, optimum):
            super().__init__(lr, optimum)
            self.loss = float("nan") if lr > 3e-5 else self.loss

    r = fc.search_lr(lambda lr: _NaNAbove(lr, 1e-3), [], [1e-5, 2e-5, 4e-5], static=100.0, **quiet)
    assert r["best"] == 2e-5 and r["status"]["4e-05"] == "diverged" and r["static_nats"] == 100.0


def test_the_test_time_step_search_refuses_a_head_whose_slow_part_is_not_finite(llama, monkeypatch):
    """A NaN at step 0 (the baseline, first in the grid) was chosen by min(); now the search is a UserError."""
    lm, _ = llama
    model = head_on(lm, test_time_only=True)
    monkeypatch.setattr(fc, "head_loss_on", lambda m, _h: float("nan") if m.head.options.test_time_step_size == 0
                        else 3.0 - m.head.options.test_time_step_size)
    with pytest.raises(UserError, match="test-time step"):
        fc.tune_test_time_step(model, [])
    bowl = lambda step: 3.0 - step + 50 * step**2  # noqa: E731  (lowest at 0.01 of the grid; 0.03 is worse)
    monkeypatch.setattr(fc, "head_loss_on", lambda m, _h: {0.0: 3.0, 3e-3: float("nan")}.get(
        m.head.options.test_time_step_size, bowl(m.head.options.test_time_step_size)))
    r = fc.tune_test_time_step(model, [])
    assert r["best"] == 1e-2 and r["status"]["0.003"] == "diverged" and model.head.options.test_time_step_size == 1e-2


def test_a_user_error_anywhere_in_a_script_is_one_line_and_exit_2(capsys):
    from fastweights.cli.script_parser import exit_status_of

    def main():
        raise UserError("nothing to choose")

    assert exit_status_of(main) == 2 and capsys.readouterr().err == "error: nothing to choose\n"
    assert exit_status_of(lambda: 0) == 0


def test_the_step_scale_falls_back_to_the_slow_part_when_no_scale_helps(monkeypatch):
    """``tune_step_scale``: scale 0 (the head's slow part) is the baseline and may itself be chosen; when every other
    scale is worse on the tuning texts it is the best, not the least bad of the others; a scale that helps wins."""
    import contextlib
    from types import SimpleNamespace

    from fastweights.experiments import fwl_comparison as fwc

    now = {"scale": None}

    @contextlib.contextmanager
    def scaled(head, scale):
        now["scale"] = scale
        yield

    monkeypatch.setattr(fwc, "scaled_step_sizes", scaled)
    model = SimpleNamespace(head=SimpleNamespace(current_step_sizes=lambda: {"s": torch.tensor(0.5)}))
    losses = {0.0: 3.0, 0.125: 3.01, 0.25: 3.02, 0.5: 3.05, 1.0: 3.1, 2.0: 3.4}
    monkeypatch.setattr(fwc, "head_loss_on", lambda m, h: losses[now["scale"]])
    got = fwc.tune_step_scale(model, None)
    assert got["best"] == 0.0 and got["learned_step_sizes"] == {"s": 0.5} and set(got["grid_nats"]) == {
        "0", "0.125", "0.25", "0.5", "1", "2"}
    losses[0.5] = 2.9
    assert fwc.tune_step_scale(model, None)["best"] == 0.5
