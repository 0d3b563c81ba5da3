"""Issue 18 extensions of dynamic evaluation: learning-rate schedules within the stream, low-rank MLP
deltas (adapt.lowrank) and the neural cache on top of dynamic evaluation (adapt.dynamic_cache)."""

import math
import re

import pytest
import torch

from fastweights.adapt.cache import NeuralCache
from fastweights.adapt.dynamic import DynamicEvaluator
from fastweights.adapt.dynamic_cache import DynamicNeuralCache
from fastweights.adapt.lowrank import LowRankAdaptation, LowRankDynamicEvaluator, collect_lowrank_grad_stats
from fastweights.adapt.grad_stats import GradStats
from fastweights.adapt.update_rules import parse_schedule, schedule_factor
from fastweights.core.errors import UserError
from fastweights.loops.evaluate import score_tokens
from helpers import assert_score_ignores_its_own_token, motif_tokens, tiny_lm

V = 13


def tiny_model(dtype=torch.float32, seed=0):
    return tiny_lm(V, seed=seed, dtype=dtype)


def tokens(n, seed=1):
    return motif_tokens(n, V, seed)


def fake_stats(names_shapes, seed=2):
    g = torch.Generator().manual_seed(seed)
    return GradStats({n: (torch.rand(s, generator=g, dtype=torch.float64) * 1e-2 + 1e-4).float()
                      for n, s in names_shapes}, batches=1, batch_size=1, seq_len=1)


# ----------------------------------------------------------------------------- schedules


def test_schedule_factors_and_bad_specs():
    assert parse_schedule(None) == parse_schedule("constant") == ("constant", 0.0)
    w = parse_schedule("warmup:4")
    assert [schedule_factor(w, i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    r = parse_schedule("rsqrt:2")
    assert schedule_factor(r, 0) == 1.0 and schedule_factor(r, 6) == pytest.approx(0.5)
    for bad in ("warmup", "warmup:0", "rsqrt:-1", "cosine:3", "warmup:x"):
        with pytest.raises(UserError):
            parse_schedule(bad)


@pytest.mark.parametrize("rule", ["sgd", "rms-global-prior"])
def test_constant_schedule_is_bit_identical(rule):
    """"constant" (and warmup over 1 update, f = 1 throughout) run exactly the unscheduled update."""
    model = tiny_model()
    x = tokens(120)
    stats = fake_stats([(n, p.shape) for n, p in model.named_parameters()])
    kw = dict(rule=rule, lr=0.3 if rule == "sgd" else 3e-3, decay=0.02, segment_len=9, context=30, grad_stats=stats)
    ref, st_ref = DynamicEvaluator(model, **kw).evaluate(x)
    for sched in ("constant", "warmup:1"):
        r, st = DynamicEvaluator(model, lr_schedule=sched, **kw).evaluate(x)
        assert r.token_losses == ref.token_losses
        assert all(torch.equal(a, b) for a, b in zip(st.values, st_ref.values))
    assert st.updates == math.ceil(119 / 9)


@pytest.mark.parametrize("sched", ["warmup:3", "rsqrt:2"])
def test_schedule_equals_per_segment_learning_rates(sched):
    """Update i of a scheduled run == an unscheduled update at lr * f(i) (segment by segment, state carried)."""
    model = tiny_model(torch.float64)
    x, L, lr = tokens(60), 8, 0.4
    r, _ = DynamicEvaluator(model, rule="sgd", lr=lr, segment_len=L, context=40, lr_schedule=sched).evaluate(x)
    s = parse_schedule(sched)
    losses, state = [], None
    for i, a in enumerate(range(0, 59, L)):
        ev = DynamicEvaluator(model, rule="sgd", lr=lr * schedule_factor(s, i), segment_len=L, context=40)
        piece = x[a + 1 : a + L + 1] if state is not None else x[: L + 1]
        out, state = ev.evaluate(piece, state, final=a + L >= 59)
        losses += out.token_losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(r.token_losses), rtol=1e-12, atol=1e-12)


def test_schedule_pieces_and_batched():
    model = tiny_model(torch.float64)
    x = tokens(70)
    ev = DynamicEvaluator(model, rule="sgd", lr=0.3, segment_len=7, context=30, lr_schedule="warmup:4")
    whole, _ = ev.evaluate(x)
    losses, state = [], None
    for a, b in ((0, 11), (11, 40), (40, 70)):
        r, state = ev.evaluate(x[a:b], state, final=(b == 70))
        losses += r.token_losses
    assert losses == whole.token_losses
    docs = [tokens(n, seed=n) for n in (40, 23)]
    for d, r in zip(docs, ev.evaluate_batch(docs, keep_token_losses=True)):
        torch.testing.assert_close(torch.tensor(r.token_losses), torch.tensor(ev.evaluate(d)[0].token_losses),
                                   rtol=1e-10, atol=1e-10)
    assert ev.metadata()["lr_schedule"] == "warmup:4"


# ----------------------------------------------------------------------------- low-rank MLP deltas


def test_lowrank_selects_mlp_projections_and_adds_AB():
    model = tiny_model(torch.float64)
    ad = LowRankAdaptation(model, rank=3)
    assert ad.names == [f"lowrank.blocks.{i}.mlp.{p}.A" for i in range(2) for p in ("gate_up", "down")]
    mod = model.blocks[0].mlp.down
    x = torch.randn(2, 5, mod.in_features, dtype=torch.float64)
    As = [torch.randn(s, dtype=torch.float64) for s in ad.shapes]
    with ad.attached(As):
        y = mod(x)
    W = mod.weight + As[1] @ ad.B[1]  # W + A B
    torch.testing.assert_close(y, torch.nn.functional.linear(x, W, mod.bias))
    with pytest.raises(UserError, match="module names look like 'embed'"):
        LowRankAdaptation(model, modules="nothing.*")
    with pytest.raises(UserError, match="module names look like '\\?'"):  # a model without submodules: no name
        LowRankAdaptation(torch.nn.Linear(4, 4), modules="nothing.*")


def test_lowrank_zero_delta_is_the_unadapted_model_bit_exactly():
    model = tiny_model()
    x = tokens(80)
    ad = LowRankAdaptation(model, rank=4)
    ref = model(x[None]).logits
    with ad.attached(ad.zeros()):
        assert torch.equal(model(x[None]).logits, ref)
    stats = collect_lowrank_grad_stats(model, tokens(200, seed=5), rank=4, batch_size=2, seq_len=9, max_batches=3)
    assert [tuple(stats.ms[n].shape) for n in ad.names] == [tuple(s) for s in ad.shapes]
    assert all(stats.ms[n].sum() > 0 for n in ad.names)  # A = 0 still has a gradient
    for rule in ("sgd", "rms"):
        ev = LowRankDynamicEvaluator(model, rule=rule, lr=0.0, segment_len=9, context=30, rank=4, grad_stats=stats)
        dyn, _ = ev.evaluate(x)
        static, _ = score_tokens(model, x, seq_len=30, stride=9, keep_token_losses=True)
        assert dyn.token_losses == static.token_losses
    assert ev.num_adapted == sum(a * b for a, b in ad.shapes)


def test_lowrank_adapts_pieces_batched_and_restores():
    model = tiny_model(torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = tokens(90)
    ad = LowRankAdaptation(model, rank=4)
    ev = LowRankDynamicEvaluator(model, rule="rms-global-prior", lr=3e-3, decay=0.02, segment_len=9, context=30, rank=4,
                                 grad_stats=fake_stats(zip(ad.names, ad.shapes)), lr_schedule="rsqrt:3")
    whole, st_whole = ev.evaluate(x)
    static, _ = score_tokens(model, x, seq_len=30, stride=9)
    assert whole.nll < static.nll  # it adapts to the repeated motif
    assert any(a.abs().max() > 0 for a in st_whole.values)
    losses, state = [], None
    for a, b in ((0, 5), (5, 50), (50, 90)):
        r, state = ev.evaluate(x[a:b], state, final=(b == 90))
        losses += r.token_losses
    assert losses == whole.token_losses
    assert all(torch.equal(a, b) for a, b in zip(state.values, st_whole.values))
    docs = [tokens(n, seed=n) for n in (40, 23, 57)]
    for d, r in zip(docs, ev.evaluate_batch(docs, keep_token_losses=True)):
        torch.testing.assert_close(torch.tensor(r.token_losses), torch.tensor(ev.evaluate(d)[0].token_losses),
                                   rtol=1e-10, atol=1e-10)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("j", [13, 16, 20])
def test_lowrank_score_is_unaffected_by_its_own_and_later_tokens(j):
    """The leak test of test_dynamic_eval: p(x_j | x_<j) summed over every value of x_j is 1, and
    earlier scores do not move when x_j changes."""
    model = tiny_model(torch.float64)
    evaluate = lambda y: LowRankDynamicEvaluator(model, rule="sgd", lr=5.0, segment_len=10, context=40,  # noqa: E731
                                                 rank=4).evaluate(y)[0]
    assert_score_ignores_its_own_token(evaluate, tokens(31), j, V)


# ----------------------------------------------------------------------------- the cache on top


@pytest.mark.parametrize("j", [13, 16, 20])
def test_cache_on_dynamic_sums_to_one_and_does_not_look_ahead(j):
    model = tiny_model(torch.float64)

    def evaluate(y):
        ev = DynamicEvaluator(model, rule="sgd", lr=2.0, segment_len=10, context=40)
        return DynamicNeuralCache(ev, window=20, flatness=1.0, mix=0.3).evaluate(y)[0]

    assert_score_ignores_its_own_token(evaluate, tokens(31), j, V)


def test_cache_on_dynamic_limits_and_pieces():
    model = tiny_model(torch.float64)
    x = tokens(80)
    ev = DynamicEvaluator(model, rule="sgd", lr=0.3, segment_len=8, context=40, lr_schedule="warmup:2")
    dyn, st_dyn = ev.evaluate(x)
    r, st = DynamicNeuralCache(ev, window=30, mix=0.0).evaluate(x)  # mix 0: plain dynamic evaluation
    assert r.token_losses == dyn.token_losses
    assert all(torch.equal(a, b) for a, b in zip(st.dynamic.values, st_dyn.values))
    static_ev = DynamicEvaluator(model, rule="sgd", lr=0.0, segment_len=8, context=40)  # lr 0: the static cache
    cached, _ = NeuralCache(model, window=30, flatness=0.5, mix=0.2, segment_len=8, context=40).evaluate(x)
    on_static, _ = DynamicNeuralCache(static_ev, window=30, flatness=0.5, mix=0.2).evaluate(x)
    # (NeuralCache mixes in fp32, the wrapper in the model's fp64)
    torch.testing.assert_close(torch.tensor(on_static.token_losses), torch.tensor(cached.token_losses),
                               rtol=1e-5, atol=1e-5)
    both = DynamicNeuralCache(ev, window=30, flatness=0.5, mix=0.2)
    whole, _ = both.evaluate(x)
    assert whole.nll != dyn.nll
    losses, state = [], None
    for a, b in ((0, 9), (9, 45), (45, 80)):
        out, state = both.evaluate(x[a:b], state, final=(b == 80))
        losses += out.token_losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(whole.token_losses), rtol=0, atol=0)
    docs = [tokens(30, seed=3), x]
    assert both.evaluate_documents(docs).nll == pytest.approx(sum(both.evaluate(d)[0].nll for d in docs), rel=1e-12)
    with pytest.raises(UserError):
        DynamicNeuralCache(ev, mix=1.5)


def test_lowrank_and_cache_on_a_transformers_llama():
    """The SmolLM2 architecture (Llama: mlp.gate_proj/up_proj/down_proj, no biases), tiny and random."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastweights.hf.transformers_as_ours import HFCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True)
    lm = HFCausalLM(LlamaForCausalLM(cfg).eval())
    x = torch.randint(0, 40, (70,), generator=torch.Generator().manual_seed(1))
    ad = LowRankAdaptation(lm, rank=2)
    assert len(ad.names) == 6 and all(n.split(".")[-2] in ("gate_proj", "up_proj", "down_proj") for n in ad.names)
    static, _ = score_tokens(lm, x, 128, 10, keep_token_losses=True)
    ev = LowRankDynamicEvaluator(lm, rule="sgd", lr=0.0, segment_len=10, context=128, rank=2)
    assert ev.evaluate(x)[0].token_losses == static.token_losses
    ev = LowRankDynamicEvaluator(lm, rule="sgd", lr=1.0, segment_len=10, context=128, rank=2)
    r, st = ev.evaluate(x)
    assert any(a.abs().max() > 0 for a in st.values)
    c, _ = DynamicNeuralCache(ev, window=50, mix=0.0).evaluate(x)
    assert c.token_losses == r.token_losses


def test_an_unknown_cache_similarity_is_one_clear_error():
    """The refusal names the similarities there are (mutation caught: the list in its message replaced by None,
    a TypeError instead of the one line)."""
    from fastweights.adapt.cache import SIMILARITIES

    ev = DynamicEvaluator(torch.nn.Linear(2, 2), rule="sgd", lr=0.0, segment_len=4)
    with pytest.raises(UserError) as raised:
        DynamicNeuralCache(ev, similarity="euclid")
    assert str(raised.value) == f"cache similarity must be one of {', '.join(SIMILARITIES)}, got 'euclid'"


def test_a_token_stream_is_one_row_of_ids():
    """``as_token_stream``: [T] and [1, T] are one stream (int64); a batch of several rows, or a scalar, is refused
    with its shape (a [2, T] batch read as one stream would score its rows as if they followed each other)."""
    import torch

    from fastweights.adapt.stream_state import as_token_stream

    ids = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int32)
    for given in (ids, ids[None], ids.tolist()):
        got = as_token_stream(given)
        assert got.dtype == torch.int64 and got.tolist() == [3, 1, 4, 1, 5]
    for bad, shape in ((torch.stack([ids, ids]), "(2, 5)"), (torch.tensor(7), "()"), (ids[None, None], "(1, 1, 5)")):
        with pytest.raises(ValueError, match=rf"expected a 1-D token sequence, got shape {re.escape(shape)}"):
            as_token_stream(bad)


def test_gradient_statistics_of_a_tensor_the_loss_does_not_reach_are_zero():
    """``accumulate_grad_stats``: a selected tensor no token's loss depends on (an unused embedding row's table,
    a gate switched off) gets MS_g 0, not an error; the others their mean squared gradient over the batches."""
    from fastweights.adapt.grad_stats import accumulate_grad_stats

    torch.manual_seed(0)
    emb, out, unused = torch.randn(7, 4, requires_grad=True), torch.randn(7, 4, requires_grad=True), \
        torch.randn(3, requires_grad=True)

    def forward(x, state):
        return emb[x] @ out.T, state

    tokens = torch.randint(0, 7, (41,))
    stats = accumulate_grad_stats(forward, [emb, out, unused], ["emb", "out", "unused"], tokens, batch_size=2,
                                  seq_len=5, context=None, max_batches=3, progress=False)
    assert torch.equal(stats.ms["unused"], torch.zeros(3)) and stats.batches == 3
    assert stats.ms["out"].gt(0).any() and stats.ms["emb"].shape == (7, 4)
