"""Dynamic evaluation (Krause et al. 2018): exactness (lr = 0, hand-written loops), no leakage,
state carry, batched documents, sparse adaptation, statistics, tuning, generation, the CLI."""

import json

import pytest
import torch

from fastweights.adapt.dynamic import DynamicEvaluator, DynamicState
from fastweights.adapt.sparse import SparseAdaptation, SparseDynamicEvaluator, collect_sparse_grad_stats
from fastweights.adapt.timescale import loss_by_position, timescale_analysis
from fastweights.adapt.tune import format_table, tune_dynamic
from fastweights.adapt.grad_stats import GradStats, collect_grad_stats
from fastweights.adapt.parameter_selection import select_parameters
from fastweights.adapt.update_rules import DEFAULT_DECAY, DEFAULT_LR, UpdateRule
from fastweights.core.errors import UserError
from fastweights.loops.evaluate import score_tokens
from fastweights.loops.generate import generate_tokens
from fastweights.models.lm import detach_state
from helpers import assert_json_shape, assert_score_ignores_its_own_token, motif_tokens, own_token_probabilities, tiny_lm

V = 13


def tiny_model(dtype=torch.float32, seed=0, **kw):
    return tiny_lm(V, seed=seed, dtype=dtype, **kw)


def tokens(n, seed=1):
    return motif_tokens(n, V, seed)


def fake_stats(model, seed=2):
    g = torch.Generator().manual_seed(seed)
    return GradStats({n: (torch.rand(p.shape, generator=g, dtype=torch.float64) * 1e-2 + 1e-4).float()
                      for n, p in model.named_parameters()}, batches=1, batch_size=1, seq_len=1)


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("rule", ["sgd", "sgd-global-prior", "rms", "rms-prior", "rms-global-prior"])
def test_lr_zero_is_exactly_static(rule):
    model = tiny_model()
    x = tokens(150)
    ev = DynamicEvaluator(model, rule=rule, lr=0.0, decay=0.01, segment_len=9, context=24, grad_stats=fake_stats(model))
    dyn, _ = ev.evaluate(x)
    static, _ = score_tokens(model, x, seq_len=24, stride=9, keep_token_losses=True)
    assert dyn.token_losses == static.token_losses  # bit for bit
    assert dyn.nll == static.nll and dyn.tokens == static.tokens == 149


def test_model_is_restored_after_evaluation():
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ev = DynamicEvaluator(model, rule="sgd", lr=0.5, segment_len=5)
    _, st = ev.evaluate(tokens(40))
    assert any(d.abs().max() > 0 for d in st.values)  # it did adapt
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.requires_grad for p in model.parameters())


def _hand_written(model, x, L, context, rule, lr, decay, eps, ms):
    """Dynamic evaluation written out from the paper's equations, with a copy of the parameters."""
    names = [n for n, _ in model.named_parameters()]
    theta_g = {n: p.detach().clone() for n, p in model.named_parameters()}
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    if rule == "rms-global-prior":
        rms = {n: ms[n].double().sqrt() for n in names}
        avg = sum(rms[n].mean() for n in names) / len(names)  # mean over tensors of per-tensor means
        rms_norm = {n: torch.clamp(rms[n] / avg, max=1 / decay) for n in names}
    losses, state = [], None
    for pos in range(0, x.numel() - 1, L):
        m = min(L, x.numel() - 1 - pos)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(theta[n])
        out = model(x[None, pos : pos + m], state)
        nll = -torch.log_softmax(out.logits, -1)[0].gather(-1, x[pos + 1 : pos + m + 1, None])[:, 0]
        losses += nll.tolist()
        grads = torch.autograd.grad(nll.mean(), [p for _, p in model.named_parameters()])
        for n, g in zip(names, grads):
            old = theta[n]
            if rule == "sgd":
                theta[n] = old - lr * g
            elif rule == "sgd-global-prior":  # eq. 4
                theta[n] = old - lr * g + decay * (theta_g[n] - old)
            elif rule == "rms":  # eq. 6 without the prior
                theta[n] = old - lr * g / (ms[n].double().sqrt() + eps)
            elif rule == "rms-prior":  # eq. 6
                theta[n] = old - lr * g / (ms[n].double().sqrt() + eps) + decay * (theta_g[n] - old)
            elif rule == "rms-global-prior":  # eq. 8
                theta[n] = old - lr * g / (ms[n].double().sqrt() + eps) + decay * (theta_g[n] - old) * rms_norm[n]
        state = model.trim_state(detach_state(out.state), context - L)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(theta_g[n])
    return losses, {n: theta[n] - theta_g[n] for n in names}


@pytest.mark.parametrize("rule", ["sgd", "sgd-global-prior", "rms", "rms-prior", "rms-global-prior"])
def test_rules_equal_hand_written_loops(rule):
    model = tiny_model(torch.float64)
    x = tokens(60)
    stats = fake_stats(model)
    lr = {"sgd": 0.3, "sgd-global-prior": 0.3}.get(rule, 2e-3)
    decay = 0.05
    ref_losses, ref_delta = _hand_written(model, x, 7, 20, rule, lr, decay, 1e-3, stats.ms)
    ev = DynamicEvaluator(model, rule=rule, lr=lr, decay=decay, eps=1e-3, segment_len=7, context=20, grad_stats=stats)
    res, st = ev.evaluate(x)
    torch.testing.assert_close(torch.tensor(res.token_losses), torch.tensor(ref_losses), rtol=1e-10, atol=1e-10)
    for n, d in zip(ev.names, st.values):
        torch.testing.assert_close(d, ref_delta[n], rtol=1e-9, atol=1e-11)
    static, _ = score_tokens(model, x, 20, 7)
    assert abs(res.nll - static.nll) > 1e-3  # the updates changed the scores


def test_rms_global_prior_clips_decay_at_one():
    ms = [torch.tensor([1e-8, 1.0, 100.0])]
    rule = UpdateRule("rms-global-prior", lr=0.0, decay=0.5, eps=0.0, ms=ms)
    # RMS_norm = sqrt(ms) / mean(sqrt(ms)) = [~0, 0.27, 2.7]; lambda * RMS_norm clipped at 1
    d = [torch.ones(3)]
    rule.apply(d, [torch.zeros(3)])
    root = ms[0].sqrt()
    expected = 1 - torch.clamp(0.5 * root / root.mean(), max=1.0)
    torch.testing.assert_close(d[0], expected)
    assert d[0][2] == 0  # fully decayed, not past theta_g


# ----------------------------------------------------------------------------- no leakage


@pytest.mark.parametrize("j", [13, 16, 20])  # segment = targets 11..20 (positions 10..19 predict them)
def test_score_is_unaffected_by_its_own_tokens(j):
    """p(x_j | x_<j) must not depend on x_j: summed over every value of x_j it is 1.

    If an update saw a segment before scoring it, the scored token would raise its own
    probability and the sum would exceed 1. Scores before position j must not change either.
    """
    model = tiny_model(torch.float64)
    evaluate = lambda y: DynamicEvaluator(model, rule="sgd", lr=2.0, segment_len=10, context=40).evaluate(y)[0]  # noqa: E731
    assert_score_ignores_its_own_token(evaluate, tokens(31), j, V)


def test_leak_detector_detects_scoring_after_an_update_on_the_same_text():
    """The same check fails for a protocol that leaks: scoring with weights already adapted on the
    text (here, a second pass with the weights from a first pass, pitfall 1)."""
    model = tiny_model(torch.float64)

    def second_pass(y):
        _, seen = DynamicEvaluator(model, rule="sgd", lr=0.3, segment_len=10).evaluate(y)
        return DynamicEvaluator(model, rule="sgd", lr=0.0, segment_len=10).evaluate(y, DynamicState(seen.values, None, y[:0]))[0]

    probs, _ = own_token_probabilities(second_pass, tokens(31), 16, V)
    assert sum(probs) > 1.01


# ----------------------------------------------------------------------------- state carry


@pytest.mark.parametrize("cuts", [[37], [5, 6, 50], [1, 20, 40]])
def test_pieces_equal_one_call(cuts):
    model = tiny_model()
    x = tokens(90)
    ev = DynamicEvaluator(model, rule="rms-global-prior", lr=3e-3, decay=0.02, segment_len=9, context=30,
                          grad_stats=fake_stats(model))
    whole, st_whole = ev.evaluate(x)
    losses, state = [], None
    bounds = [0, *cuts, x.numel()]
    for a, b in zip(bounds[:-1], bounds[1:]):
        r, state = ev.evaluate(x[a:b], state, final=(b == x.numel()))
        losses += r.token_losses
    assert losses == whole.token_losses
    assert state.scored == whole.tokens
    for a, b in zip(state.values, st_whole.values):
        assert torch.equal(a, b)


def test_reset_per_document_and_never():
    model = tiny_model()
    docs = [tokens(40, seed=s) for s in (1, 2)]
    ev = DynamicEvaluator(model, rule="sgd", lr=0.3, segment_len=8, context=24)
    per_doc = ev.evaluate_documents(docs, reset="per_document")
    separate = sum(ev.evaluate(d)[0].nll for d in docs)
    assert per_doc.nll == pytest.approx(separate, rel=1e-12)
    never = ev.evaluate_documents(docs, reset="never")
    first, st = ev.evaluate(docs[0])
    second, _ = ev.evaluate(docs[1], DynamicState(st.values, None, docs[1][:0]))
    assert never.nll == pytest.approx(first.nll + second.nll, rel=1e-12)
    assert never.nll != pytest.approx(per_doc.nll, rel=1e-6)
    with pytest.raises(UserError):
        ev.evaluate_documents(docs, reset="sometimes")


# ----------------------------------------------------------------------------- batched documents


@pytest.mark.parametrize("rule", ["sgd-global-prior", "rms-global-prior"])
def test_batched_documents_equal_sequential(rule):
    model = tiny_model(torch.float64)  # tied embedding: the head's weight must follow the delta too
    docs = [tokens(n, seed=n) for n in (40, 23, 57)]
    ev = DynamicEvaluator(model, rule=rule, lr=0.2 if rule.startswith("sgd") else 3e-3, decay=0.05, segment_len=7,
                          context=20, grad_stats=fake_stats(model))
    batched = ev.evaluate_batch(docs, keep_token_losses=True)
    for d, r in zip(docs, batched):
        ref, _ = ev.evaluate(d)
        assert r.tokens == ref.tokens == d.numel() - 1
        torch.testing.assert_close(torch.tensor(r.token_losses), torch.tensor(ref.token_losses), rtol=1e-10, atol=1e-10)


def test_batched_documents_of_a_gdn_model_are_refused_in_one_clear_error():
    """Batched documents run the model under torch.func.vmap, where the chunked delta rule's Function cannot run:
    the evaluator says so and what to do (a limit of the delta rule's Function, not of the model)."""
    model = tiny_model(torch.float64, mixer="gdn")
    ev = DynamicEvaluator(model, rule="sgd", lr=0.2, segment_len=7, context=20)
    with pytest.raises(RuntimeError, match="evaluate documents one at a time"):
        ev.evaluate_batch([tokens(20, seed=1), tokens(20, seed=2)])


def test_parameter_filter():
    model = tiny_model()
    sel = select_parameters(model, "blocks.1.*", "blocks.1.mlp.*")
    assert sel and all(n.startswith("blocks.1.") and ".mlp." not in n for n in sel)
    ev = DynamicEvaluator(model, rule="sgd", lr=0.5, segment_len=6, exclude="embed.*")
    assert "embed.weight" not in ev.names
    _, st = ev.evaluate(tokens(30))
    assert all(d.abs().max() > 0 for n, d in zip(ev.names, st.values) if n.startswith("blocks."))
    with pytest.raises(UserError):
        select_parameters(model, "nothing.*")


# ----------------------------------------------------------------------------- statistics


def test_collecting_statistics_shows_its_progress_only_when_asked(capsys):
    """Mutation caught (issue 49, seed 8): the progress bar of the statistics switched off whatever was asked."""
    for progress in (True, False):
        collect_grad_stats(tiny_model(), tokens(4 * 25 + 3), batch_size=4, seq_len=6, max_batches=3, progress=progress)
        err = capsys.readouterr().err
        assert ("gradient statistics (MS_g)" in err and "3/3 batches" in err) == progress, err


def test_collect_grad_stats_is_mean_squared_batch_gradient(tmp_path):
    model = tiny_model(torch.float64)
    x = tokens(4 * 25 + 3)
    stats = collect_grad_stats(model, x, batch_size=4, seq_len=6, max_batches=3, context=18)
    assert (stats.batches, stats.batch_size, stats.seq_len) == (3, 4, 6)
    streams = x[: 4 * 25].view(4, 25)
    sq = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    state = None
    for i in range(3):
        out = model(streams[:, i * 6 : i * 6 + 6], state)
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), streams[:, i * 6 + 1 : i * 6 + 7].flatten())
        for (n, _), g in zip(model.named_parameters(), torch.autograd.grad(loss, list(model.parameters()))):
            sq[n] += g**2
        state = model.trim_state(detach_state(out.state), 12)
    for n in sq:
        torch.testing.assert_close(stats.ms[n].double(), sq[n] / 3, rtol=1e-5, atol=1e-12)
    path = stats.save(tmp_path / "s.safetensors")
    loaded = GradStats.load(path)
    assert loaded.batches == 3 and loaded.context == 18 and set(loaded.ms) == set(stats.ms)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # the file says what it holds, to anyone who opens it
        meta = f.metadata()
    assert meta["format"] == "fastweights-grad-stats" and meta["units"].startswith("MS_g (mean squared gradient")
    (tmp_path / "bad.safetensors").write_text("nope")
    with pytest.raises(UserError):
        GradStats.load(tmp_path / "bad.safetensors")


def test_rms_rules_need_matching_stats():
    model = tiny_model()
    with pytest.raises(UserError, match="gradient statistics"):
        DynamicEvaluator(model, rule="rms-global-prior")
    other = fake_stats(tiny_model(d_model=32))
    with pytest.raises(UserError):
        DynamicEvaluator(model, rule="rms", grad_stats=other)
    with pytest.raises(UserError):
        DynamicEvaluator(model, rule="adam")


# ----------------------------------------------------------------------------- sparse


def test_sparse_hook_transforms_the_chosen_units():
    model = tiny_model(torch.float64)
    x = tokens(12)[None]
    captured = {}
    h = model.blocks[0].register_forward_hook(lambda m, i, o: captured.__setitem__("h", o[0].clone()))
    model(x)
    h.remove()
    units = [3, 0, 7]
    adaptation = SparseAdaptation(model, 0, units)
    M = torch.randn(3, 3, dtype=torch.float64)
    captured_after = {}
    with adaptation.attached(M):
        h = model.blocks[1].register_forward_pre_hook(lambda m, i: captured_after.__setitem__("h", i[0].clone()))
        model(x)
        h.remove()
    expected = captured["h"].clone()
    idx = torch.tensor(units)
    expected[..., idx] = expected[..., idx] + expected[..., idx] @ M.T  # h' = h + M h on the subset
    torch.testing.assert_close(captured_after["h"], expected)


def test_sparse_lr_zero_static_and_batched():
    model = tiny_model(torch.float64)
    x = tokens(50)
    stats = collect_sparse_grad_stats(model, tokens(300, seed=5), layer=0, units=6, batch_size=4, seq_len=7, context=21)
    assert stats.ms["sparse.0.M"].shape == (6, 6)
    ev0 = SparseDynamicEvaluator(model, lr=0.0, segment_len=7, context=21, layer=0, units=6, grad_stats=stats)
    r0, _ = ev0.evaluate(x)
    static, _ = score_tokens(model, x, 21, 7)
    assert r0.nll == pytest.approx(static.nll, rel=1e-7)  # score_tokens takes log_softmax in fp32
    ev = SparseDynamicEvaluator(model, lr=1e-3, decay=0.02, segment_len=7, context=21, layer=0, units=6, grad_stats=stats)
    r, st = ev.evaluate(x)
    assert st.values[0].shape == (6, 6) and st.values[0].abs().max() > 0
    assert ev.num_adapted == 36
    docs = [x, tokens(33, seed=4)]
    for d, rb in zip(docs, ev.evaluate_batch(docs, keep_token_losses=True)):
        ref, _ = ev.evaluate(d)
        torch.testing.assert_close(torch.tensor(rb.token_losses), torch.tensor(ref.token_losses), rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- generation, time scales, tuning


def test_generation_with_lr_zero_equals_static_generation():
    model = tiny_model()
    prompt = tokens(15)
    ev = DynamicEvaluator(model, rule="sgd", lr=0.0, segment_len=6)
    out, st = ev.generate(prompt, 20, temperature=0.0)
    ref = list(generate_tokens(model, prompt.tolist(), 20, temperature=0.0))
    assert out == ref
    ev = DynamicEvaluator(model, rule="sgd", lr=0.5, segment_len=6)
    out, st = ev.generate(prompt, 20, temperature=1.0, seed=0)
    assert len(out) == 20 and st.scored == 14 + 20  # the prompt and the generated text were read
    assert any(d.abs().max() > 0 for d in st.values)


def test_loss_by_position_and_timescale(tmp_path):
    res = loss_by_position([[1.0, 2.0, 3.0, 4.0, 5.0], [3.0, 4.0, 5.0]], window=2)
    assert res == {"position": [2, 4, 5], "loss": [2.5, 4.0, 5.0], "docs": [2, 1, 1]}
    model = tiny_model()
    ev = DynamicEvaluator(model, rule="sgd", lr=0.3, segment_len=5, context=15)
    ts = timescale_analysis(ev, [tokens(41, s) for s in (1, 2)], window=10)
    assert ts["position"] == [10, 20, 30, 40] and len(ts["dynamic_bits"]) == 4
    from fastweights.adapt.timescale import plot_timescale

    assert plot_timescale(ts, tmp_path / "t.png").stat().st_size > 1000


def test_tuner_grid_and_search():
    model = tiny_model(n_layers=1)
    docs = [tokens(31)]

    def make(lr, decay):
        return DynamicEvaluator(model, rule="sgd-global-prior", lr=lr, decay=decay, segment_len=10, context=30)

    res = tune_dynamic(make, docs, lrs=[0.0, 0.1, 0.3], decays=[0.0, 0.1])
    assert len(res["grid"]) == 6
    assert res["best"]["loss_nats"] == min(g["loss_nats"] for g in res["grid"])
    zero = [g for g in res["grid"] if g["lr"] == 0.0 and g["decay"] == 0.0][0]
    assert zero["relative_improvement"] == 0.0
    assert "best:" in format_table(res)
    auto = tune_dynamic(make, docs)
    stages = [g["stage"] for g in auto["grid"]]
    assert stages[0] == "coarse lr" and "fine lr" in stages and "decay" in stages


def test_a_search_cut_short_continues_from_its_finished_points(tmp_path, capsys):
    """Issue 49: a tune killed at point 12 of 15 kept nothing. Each finished point is written at once; the same
    search run again scores only the rest and gives the result of an uninterrupted one; the file goes at the end,
    and points of another search (another grid or text) are never taken."""
    from fastweights.adapt.tune import points_file_of

    model = tiny_model(n_layers=1)
    docs = [tokens(31)]
    scored = []

    def make(lr, decay):
        scored.append(lr)
        if lr == 0.3 and stop:
            raise KeyboardInterrupt
        return DynamicEvaluator(model, rule="sgd", lr=lr, decay=decay, segment_len=10, context=30)

    points = points_file_of(tmp_path / "tuned.json")
    assert points == tmp_path / "tuned.points.json"
    stop = True
    with pytest.raises(KeyboardInterrupt):
        tune_dynamic(make, docs, lrs=[0.05, 0.1, 0.3], points_file=points)
    assert [g["lr"] for g in json.loads(points.read_text())["points"]] == [0.05, 0.1]
    # what the finished points were scored on, under the names the file keeps (mutations caught, issue 49 seed 9:
    # a key renamed, so that no file of an earlier version would match)
    search = json.loads(points.read_text())["search"]
    assert set(search) == {"settings", "documents_sha256", "reset", "lrs", "decays", "static"}
    assert search["lrs"] == [0.05, 0.1, 0.3] and search["decays"] == [0.0] and len(search["documents_sha256"]) == 64
    stop, scored[:] = False, []
    res = tune_dynamic(make, docs, lrs=[0.05, 0.1, 0.3], points_file=points)
    assert scored == [0.05, 0.3]  # the probe evaluator (static's pass), then the one point not scored before
    assert "2 setting(s) it scored are taken" in capsys.readouterr().err and not points.exists()
    scored[:] = []
    whole = tune_dynamic(make, docs, lrs=[0.05, 0.1, 0.3])
    assert [(g["lr"], g["loss_nats"], g["status"]) for g in res["grid"]] == \
        [(g["lr"], g["loss_nats"], g["status"]) for g in whole["grid"]] and res["best"] == whole["best"]
    stop = True
    with pytest.raises(KeyboardInterrupt):
        tune_dynamic(make, docs, lrs=[0.05, 0.1, 0.3], points_file=points)
    stop, scored[:] = False, []
    tune_dynamic(make, [tokens(31, 7)], lrs=[0.05, 0.1, 0.3], points_file=points)  # other text: all scored again
    assert scored == [0.05, 0.05, 0.1, 0.3]


def test_the_tuner_never_chooses_a_point_that_does_not_beat_static():
    """A diverged point (a non-finite loss, or more than DIVERGED_MARGIN above static) is marked and never best;
    a grid where no point beats static is refused in one line (issue 49: a setting 377% worse than static was
    saved as the checkpoint's default)."""
    from fastweights.adapt.tune import DIVERGED_MARGIN, point_status

    assert point_status(float("nan"), 2.0) == point_status(float("inf"), 2.0) == "diverged"
    assert point_status(2.0 * (1 + DIVERGED_MARGIN) * 1.001, 2.0) == "diverged"
    assert point_status(2.01, 2.0) == "worse than static" and point_status(1.99, 2.0) == "ok"
    model = tiny_model(n_layers=1)
    docs = [tokens(31)]

    def make(lr, decay):
        return DynamicEvaluator(model, rule="sgd", lr=lr, decay=decay, segment_len=10, context=30)

    res = tune_dynamic(make, docs, lrs=[0.1, 1e6])
    by_lr = {g["lr"]: g for g in res["grid"]}
    assert by_lr[1e6]["status"] == "diverged" and by_lr[0.1]["status"] == "ok"
    assert res["best"]["lr"] == 0.1 and "!" in format_table(res)
    with pytest.raises(UserError, match="beats static") as e:
        tune_dynamic(make, docs, lrs=[1e6, 3e6])
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="worse than static"):  # lr 0 scores as static: not below it
        tune_dynamic(make, docs, lrs=[0.0])


# ----------------------------------------------------------------------------- command line


def test_cli_dynamic_eval_tune_stats_timescale(char_checkpoint, capsys):
    from fastweights.cli import main

    ck, doc = str(char_checkpoint), str(char_checkpoint / "doc.txt")
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--rule", "sgd", "--lr", "0", "--json", "--quiet"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert_json_shape(m, "dynamic_eval")
    assert m["static"]["bits_per_char"] == m["dynamic"]["bits_per_char"]
    assert m["static"]["tokens"] == len((char_checkpoint / "doc.txt").read_text()) - 1
    # rms rule without statistics: collected from the checkpoint's training split and saved next to it
    # (lr 1e-4: at 1e-3 rms-global-prior diverges to nan on this untrained model, which is refused)
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--lr", "1e-4", "--json", "--quiet",
                 "--cache"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert (char_checkpoint / "grad_stats.safetensors").is_file() and m["settings"]["rule"] == "rms-global-prior"
    assert "cache" in m and m["settings"]["grad_stats"]["batch_size"] == 100
    tuned = char_checkpoint / "dynamic_tuned.json"
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--json", "--quiet"]) == 0
    s = json.loads(capsys.readouterr().out)["settings"]  # no tuned file yet: the untuned defaults
    assert (s["lr"], s["decay"]) == (DEFAULT_LR, DEFAULT_DECAY) and s["lr_source"].startswith("untuned default")
    assert s["decay_source"].startswith("untuned default")  # a prior rule: where its decay came from, too
    assert main(["dynamic", "tune", "--checkpoint", ck, "--data", doc, "--lrs", "1e-4,1e-3", "--decays", "0.01",
                 "--quiet"]) == 0  # without --save: into the checkpoint, with the fingerprint of its weights
    assert "dynamic eval --checkpoint" in capsys.readouterr().out and tuned.is_file()
    assert_json_shape(json.loads(tuned.read_text()), "dynamic_tune")
    best = json.loads(tuned.read_text())["best"]
    assert json.loads(tuned.read_text())["weights_sha256"]
    # the checkpoint's own tuned file, made for these weights and this setting, is used and named on the first line
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--quiet"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert f"tuned file {tuned}, made for this checkpoint" in first and f"lr {best['lr']:.3g}" in first
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--json", "--quiet"]) == 0
    s = json.loads(capsys.readouterr().out)["settings"]
    assert (s["lr"], s["decay"]) == (best["lr"], best["decay"])
    # --no-tuned refuses it; another setting (segment length) does not use it, and says why on stderr
    for extra in (["--no-tuned"], ["--segment-len", "10"]):
        assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--json", "--quiet", *extra]) == 0
        out = capsys.readouterr()
        s = json.loads(out.out)["settings"]
        assert (s["lr"], s["decay"]) == (DEFAULT_LR, DEFAULT_DECAY) and s["lr_source"].startswith("untuned")
        assert ("another setting" in out.err) == (extra[0] == "--segment-len")
    named = char_checkpoint / "named_tuned.json"
    assert main(["dynamic", "tune", "--checkpoint", ck, "--data", doc, "--lrs", "1e-4,1e-3", "--decays", "0.01",
                 "--quiet", "--save", str(named)]) == 0
    assert "best:" in capsys.readouterr().out and named.is_file()
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--tuned", str(named), "--quiet"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert f"tuned file {named}" in first  # the first line names the file used
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--tuned", str(named), "--segment-len", "10",
                 "--quiet"]) == 2  # named but tuned for another segment length: refused, not silently replaced
    assert "another setting" in capsys.readouterr().err
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--tuned", str(named), "--no-tuned"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    out = char_checkpoint / "ts"
    assert main(["dynamic", "timescale", "--checkpoint", ck, "--data", doc, "--doc-len", "60", "--window", "20",
                 "--lr", "1e-3", "--out", str(out), "--quiet"]) == 0
    assert (out / "timescale.png").is_file() and json.loads((out / "timescale.json").read_text())["documents"] == 2
    assert_json_shape(json.loads((out / "timescale.json").read_text()), "dynamic_timescale")
    assert "static" in capsys.readouterr().out
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--sparse-units", "4", "--lr", "1e-3",
                 "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["adapted_parameters"] == 16


def test_cli_user_errors(char_checkpoint, capsys):
    from fastweights.cli import main

    ck, doc = str(char_checkpoint), str(char_checkpoint / "doc.txt")
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--rule", "adam"]) == 2
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--rule", "rms", "--stats", "missing.st"]) == 2
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--rule", "sgd", "--segment-len", "64"]) == 2
    assert main(["dynamic", "tune", "--checkpoint", ck, "--data", doc, "--lrs", "a,b"]) == 2
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--rule", "sgd", "--sinks", "2"]) == 2
    assert main(["dynamic", "eval", "--checkpoint", ck, "--data", doc, "--rule", "sgd", "--tuned", "missing.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 6 and "Traceback" not in err


def test_demo_helper_and_eval_arguments(char_checkpoint, capsys):
    import argparse

    from fastweights.adapt.evaluate import demo_dynamic, evaluate_static_and_dynamic
    from fastweights.cli.dynamic import add_dynamic_arguments, dynamic_settings

    res = demo_dynamic(char_checkpoint, tune_chars=300, test_chars=300, stats_batches=2)
    assert 0 < res["static"]["tokens"] <= 299 and res["search"]["grid"] and "% lower" in capsys.readouterr().out
    # what `fastweights eval --dynamic RULE` would parse, mapped to the settings the library takes
    p = argparse.ArgumentParser()
    p.add_argument("--context", dest="seq_len", type=int, default=0)
    add_dynamic_arguments(p)
    args = p.parse_args(["--dynamic", "sgd", "--lr", "0", "--segment-len", "10"])
    from fastweights.models.loading import load_checkpoint

    model, tok, cfg = load_checkpoint(char_checkpoint)
    out = evaluate_static_and_dynamic(dynamic_settings(args), model, tok, cfg, ["the cat sat on the mat. " * 4])
    assert out["static"]["loss_nats"] == out["dynamic"]["loss_nats"] and out["settings"]["segment_len"] == 10


def test_cli_dynamic_tune_where_every_point_diverges_exits_2_and_saves_nothing(char_checkpoint, tmp_path, capsys):
    from fastweights.cli import main

    ck, doc = str(char_checkpoint), str(char_checkpoint / "doc.txt")
    out = tmp_path / "tuned.json"
    assert main(["dynamic", "tune", "--checkpoint", ck, "--data", doc, "--rule", "sgd", "--lrs", "1e6,3e6",
                 "--save", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "beats static" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_the_tuning_table_stars_the_best_and_marks_the_diverged_points():
    g = lambda lr, decay, bits, status: {"lr": lr, "decay": decay, "bits_per_token": bits,  # noqa: E731
                                         "relative_improvement": 1 - bits / 2.0, "status": status}
    best = g(0.1, 0.0, 1.0, "ok")
    grid = [best, g(1.0, 0.0, 2.05, "worse than static"), g(10.0, 0.0, 9.0, "diverged"), g(0.1, 0.5, 1.5, "ok")]
    lines = format_table({"static": {"bits_per_token": 2.0}, "tokens": 30, "grid": grid, "best": best}).splitlines()
    assert lines[1].split() == ["decay", "\\", "lr", "0.1", "1", "10"]
    assert lines[2] == f"{0.0:<11.3g}" + "    1.0000*    2.0500     9.0000!"
    assert lines[3] == f"{0.5:<11.3g}" + "    1.5000 " + f"{'-':>10} " * 2
    assert lines[4] == "! diverged: a loss not finite or more than 5% above static's"
    assert lines[5] == "best: lr 0.1, decay 0: 1.0000 bits/token (50.00% lower than static)"
    no_diverged = format_table({"static": {"bits_per_token": 2.0}, "tokens": 30, "grid": grid[:2], "best": best})
    assert "! diverged" not in no_diverged and "!" not in no_diverged.splitlines()[2]


def test_output_flags_refuse_inputs_and_files_they_did_not_write(char_checkpoint, tmp_path, capsys):
    """Issue 52: dynamic stats --save CK/model.safetensors destroyed the checkpoint's weights, dynamic eval
    --per-token T.txt overwrote the text it scored, dynamic tune --save notes.txt replaced an unrelated file. Each
    is refused in one line before any work; a file of the command's own kind is replaced as a re-run should."""
    import shutil

    from fastweights.cli import main

    ck = tmp_path / "ck"
    shutil.copytree(char_checkpoint, ck)
    doc = ck / "doc.txt"
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    weights, text = (ck / "model.safetensors").read_bytes(), doc.read_text()
    for argv in (["dynamic", "stats", "--checkpoint", str(ck), "--max-batches", "2", "--save",
                  str(ck / "model.safetensors")],
                 ["dynamic", "eval", "--checkpoint", str(ck), "--data", str(doc), "--rule", "sgd", "--lr", "0.1",
                  "--quiet", "--per-token", str(doc)],
                 ["dynamic", "tune", "--checkpoint", str(ck), "--data", str(doc), "--rule", "sgd", "--lrs", "0.1",
                  "--quiet", "--save", str(notes)],
                 ["dynamic", "tune", "--checkpoint", str(ck), "--data", str(doc), "--rule", "sgd", "--lrs", "0.1",
                  "--quiet", "--save", str(tmp_path)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert (ck / "model.safetensors").read_bytes() == weights and doc.read_text() == text
    assert notes.read_text() == "mine"
    per_token = tmp_path / "per_token.json"
    for _ in range(2):  # written, then replaced by the same command
        assert main(["dynamic", "eval", "--checkpoint", str(ck), "--data", str(doc), "--rule", "sgd", "--lr", "0.1",
                     "--quiet", "--per-token", str(per_token)]) == 0
    assert json.loads(per_token.read_text())["unit"] == "nats"
    capsys.readouterr()


def test_a_statistics_segment_longer_than_its_streams_is_the_stream_and_recorded_so():
    """Issue 52: dynamic stats --segment-len 1e18 recorded a segment it never had (and sized the carried state
    by it)."""
    model = tiny_model(n_layers=1)
    long = collect_grad_stats(model, tokens(41), batch_size=2, seq_len=10**18)
    assert (long.seq_len, long.batches) == (19, 1)
    same = collect_grad_stats(model, tokens(41), batch_size=2, seq_len=19)
    assert all(torch.equal(long.ms[k], same.ms[k]) for k in same.ms)
    with pytest.raises(UserError, match="longer than the attention context"):
        collect_grad_stats(model, tokens(41), batch_size=2, seq_len=10**18, context=30)


def test_dynamic_tune_keeps_its_finished_points_beside_the_file_it_saves(tiny_run, tmp_path, monkeypatch):
    """The command hands the search a points file beside --save: an interrupted tune leaves its finished points
    there, and the same command run again ends with the result saved and the points file gone."""
    from fastweights import cli
    from fastweights.adapt.dynamic import DynamicEvaluator as Evaluator

    doc = tmp_path / "doc.txt"
    doc.write_text("To be, or not to be, that is the question. " * 20)
    argv = ["dynamic", "tune", "--checkpoint", str(tiny_run), "--data", str(doc), "--rule", "sgd", "--tune-chars",
            "300", "--lrs", "1e-3,1e-2,1e-1", "--save", str(tmp_path / "tuned.json"), "--quiet"]
    real, calls = Evaluator.evaluate_documents, []

    def cut_at_the_third(self, *a, **k):
        calls.append(self.update_rule.lr)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(Evaluator, "evaluate_documents", cut_at_the_third)
        assert cli.main(argv) != 0
    points = tmp_path / "tuned.points.json"
    assert len(json.loads(points.read_text())["points"]) == 2 and not (tmp_path / "tuned.json").exists()
    assert cli.main(argv) == 0
    assert not points.exists() and len(json.loads((tmp_path / "tuned.json").read_text())["grid"]) == 3


def test_the_default_segment_follows_the_tokenizer_kind():
    from types import SimpleNamespace

    from fastweights.adapt import update_rules as ur
    from fastweights.adapt.setup import default_segment_len

    kinds = {"char": ur.DEFAULT_SEGMENT_LEN, "byte": ur.DEFAULT_SEGMENT_LEN, "word": ur.WORD_SEGMENT_LEN,
             "gpt2": ur.SUBWORD_SEGMENT_LEN}
    assert {k: default_segment_len(SimpleNamespace(name=k)) for k in kinds} == kinds
    assert default_segment_len(object()) == ur.SUBWORD_SEGMENT_LEN  # a Hugging Face tokenizer has no name
    assert len(set(kinds.values())) == 3  # three different lengths, or this test could not tell them apart


def test_the_reason_for_a_non_finite_score_names_the_rule_and_lr_and_never_fails_itself():
    """scores_not_finite_because explains a NaN score: the rule and lr of the adapting evaluator, the flag to lower;
    an evaluator whose metadata has no lr (a continual run's) still gets its sentence, not a TypeError."""
    from types import SimpleNamespace

    from fastweights.adapt.evaluate import scores_not_finite_because

    assert scores_not_finite_because() == "the model's scores overflow on this text"
    sgd = SimpleNamespace(metadata=lambda: {"rule": "sgd", "lr": 1e30})
    assert scores_not_finite_because(sgd, "lr=") == ("dynamic evaluation diverged with rule sgd, learning rate 1e+30 "
                                                     "(try a smaller lr=)")
    no_lr = SimpleNamespace(metadata=lambda: {"rule": "memories"})
    assert scores_not_finite_because(no_lr).startswith("dynamic evaluation diverged with rule memories, learning rate nan")


def test_tune_collects_its_statistics_quietly_only_under_quiet(char_checkpoint, tmp_path, capsys):
    """``dynamic tune`` of an RMS rule collects the gradient statistics first: with ``--quiet`` without a progress
    line, without it with one. Mutation caught (issue 49, seed 8): the progress flag inverted."""
    import shutil

    from fastweights.cli import main

    ck = tmp_path / "ckpt"
    shutil.copytree(char_checkpoint, ck)
    for quiet in (True, False):
        (ck / "grad_stats.safetensors").unlink(missing_ok=True)
        argv = ["dynamic", "tune", "--checkpoint", str(ck), "--data", str(ck / "doc.txt"), "--lrs", "1e-4",
                "--decays", "0.01", "--save", str(tmp_path / f"tuned_{quiet}.json")]
        assert main(argv + (["--quiet"] if quiet else [])) == 0
        assert ("gradient statistics (MS_g)" in capsys.readouterr().err) != quiet


def test_a_callable_filter_sees_each_parameter():
    """``include`` as a callable gets ``(name, parameter)``: a filter on the tensor (the matrices only) selects by
    it. Mutation caught (issue 49, seed 9): the parameter not handed to the filter."""
    model = tiny_model()
    got = select_parameters(model, lambda name, p: p.dim() >= 2)
    want = {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert set(got) == want and want != {n for n, _ in model.named_parameters()}
