"""No leak, for every method that learns from what it scores (issue 22, scope 1).

One check for all: the probability a method gives token x_j is computed with x_j replaced by every
symbol of the vocabulary in turn. If the method never saw x_j before scoring it, the V probabilities
sum to 1 and every score before j is unchanged (the future varies, the past must not). A method that
learns from x_j before scoring it (a cache updated before the segment is scored, an inclusive mask
in FWL, a fast memory read after its own write) raises its own probability: the sum moves off 1.

Every check has a positive control that injects exactly such a leak and shows the check catches it.
Dynamic evaluation's own test (tests/adapt/test_dynamic_eval.py, the model this file follows) stays there.
"""

import math

import pytest
import torch

from fastweights.adapt import cache as cache_mod
from fastweights.adapt.cache import NeuralCache
from fastweights.ops import fwl as fwl_mod
from helpers import tiny_lm

V = 7
T = 19


def leak_check(nll_fn, x: torch.Tensor, j: int):
    """(sum over c of p(x_j = c | x_<j), largest change of any earlier score) for nll_fn(tokens) ->
    per-position NLLs, where nll[i] scores tokens[i + 1]."""
    probs, before = [], []
    for c in range(V):
        y = x.clone()
        y[j] = c
        nll = nll_fn(y)
        probs.append(math.exp(-float(nll[j - 1])))
        before.append(torch.as_tensor(nll[: j - 1], dtype=torch.float64))
    past = max(float((b - before[0]).abs().max()) if b.numel() else 0.0 for b in before)
    return sum(probs), past


def assert_no_leak(nll_fn, x, j, tol=1e-9):
    total, past = leak_check(nll_fn, x, j)
    assert abs(total - 1) < tol, f"p(x_{j}) over the vocabulary sums to {total}"
    assert past == 0.0, f"a score before position {j} changed by {past} when x_{j} did"


def assert_leak_detected(nll_fn, x, j):
    total, past = leak_check(nll_fn, x, j)
    assert abs(total - 1) > 1e-4 or past > 1e-6, (total, past)


def tokens(n=T, seed=0):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


def model_nll(model):
    def nll(y):
        with torch.no_grad():
            logits = model(y[None]).logits[0]
        return -torch.log_softmax(logits[:-1], -1).gather(1, y[1:, None])[:, 0]

    return nll


def tiny_model(**kw):
    return tiny_lm(V, d_model=12, n_layers=1, dtype=torch.float64, **kw)


# ----------------------------------------------------------------------------- neural cache


def cache_nll(model, **kw):
    def nll(y):
        r, _ = NeuralCache(model, window=50, flatness=5.0, mix=0.5, segment_len=5, **kw).evaluate(y)
        return torch.tensor(r.token_losses, dtype=torch.float64)

    return nll


def leaky_cache_mix(p_model, hidden, next_tokens, mem_hidden, mem_tokens, seen, *args):
    """The cache updated with the segment's own pairs before the segment is scored."""
    mem_h = torch.cat([mem_hidden, hidden])
    mem_y = torch.cat([mem_tokens, next_tokens])
    return _ORIGINAL_CACHE_MIX(p_model, hidden, next_tokens, mem_h, mem_y, seen + hidden.shape[0], *args)


_ORIGINAL_CACHE_MIX = cache_mod.cache_mix


@pytest.mark.parametrize("j", [3, 5, 6, 13])  # inside the first segment, its last target, the next one's first
@pytest.mark.parametrize("similarity", ["dot", "cosine"])
def test_neural_cache_never_sees_the_token_it_scores(j, similarity):
    # the cache computes in fp32 (NeuralCache.evaluate casts the hidden states): 1e-6, not fp64's 1e-9
    assert_no_leak(cache_nll(tiny_model(), similarity=similarity), tokens(), j, tol=1e-6)


def test_neural_cache_mixture_sums_to_one_over_the_vocabulary():
    """The mixed distribution itself is a distribution at every position (not only at the scored token)."""
    x = tokens()
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(T, V, generator=g, dtype=torch.float64), -1)
    h = torch.randn(T, 5, generator=g, dtype=torch.float64)
    out = cache_mod.cache_mix(p, h, x, h[:4], x[:4], 4, 50, 3.0, 0.5)
    torch.testing.assert_close(out.sum(-1), torch.ones(T, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("j", [3, 13])
def test_leak_control_cache_updated_before_scoring_is_caught(j, monkeypatch):
    monkeypatch.setattr(cache_mod, "cache_mix", leaky_cache_mix)
    total, _ = leak_check(cache_nll(tiny_model()), tokens(), j)
    assert total > 1.01  # the scored token was in the cache: its probability rose


# ----------------------------------------------------------------------------- FWL (both paths)


def fwl_model(chunk_size):
    return tiny_model(head="fwl", options={"fwl": {"segment_len": 6, "chunk_size": chunk_size, "step_size_init": 0.5,
                                                   "init_std": 0.5}})


def fwl_pieces_nll(model, cut):
    """The same scores from two calls that carry the state (the generation / streaming form)."""
    def nll(y):
        with torch.no_grad():
            a = model(y[None, :cut])
            b = model(y[None, cut:], a.state)
        logits = torch.cat([a.logits, b.logits], 1)[0]
        return -torch.log_softmax(logits[:-1], -1).gather(1, y[1:, None])[:, 0]

    return nll


FWL_PATHS = {"default path (chunk_size >= T)": 64, "chunked path (chunk_size < T)": 4}


@pytest.mark.parametrize("path", list(FWL_PATHS))
@pytest.mark.parametrize("j", [1, 4, 7, 12, 18])
def test_fwl_never_sees_the_token_it_scores(path, j):
    assert_no_leak(model_nll(fwl_model(FWL_PATHS[path])), tokens(), j)


@pytest.mark.parametrize("path", list(FWL_PATHS))
def test_fwl_streamed_never_sees_the_token_it_scores(path):
    model = fwl_model(FWL_PATHS[path])
    for j in (9, 10, 11):  # the cut at 10: j-1 is the last position of the first call, then the first of the next
        assert_no_leak(fwl_pieces_nll(model, 10), tokens(), j)


def _with_diagonal(fn):
    """The masked sums made inclusive: position t also adds its own write (q_t . k_t) v_t."""
    def leaky(q, k, v, *args):
        out = fn(q, k, v, *args)
        diag = (q * k).sum(-1, keepdim=True) * v
        return (out[0] + diag, *out[1:]) if isinstance(out, tuple) else out + diag

    return leaky


@pytest.mark.parametrize("path,target", [("default path (chunk_size >= T)", "_matrix_block"),
                                         ("chunked path (chunk_size < T)", "_strict_attention")])
def test_leak_control_fwl_inclusive_mask_is_caught(path, target, monkeypatch):
    monkeypatch.setattr(fwl_mod, target, _with_diagonal(getattr(fwl_mod, target)))
    assert_leak_detected(model_nll(fwl_model(FWL_PATHS[path])), tokens(), 12)


# ----------------------------------------------------------------------------- FwPKM and FwMLP writes


MEMORY_OPTIONS = {
    "fwpkm": {"n_subkeys": 3, "d_key": 4, "d_value": 6, "topk": 2, "chunk_size": 4, "lr": 1.0},
    "fwmlp": {"d_key": 4, "d_value": 6, "hidden": 5, "chunk_size": 4, "lr": 1.0},
}


def memory_model(name, **extra):
    return tiny_model(memory=name, memory_layers=[0], options={name: {**MEMORY_OPTIONS[name], **extra}})


@pytest.mark.parametrize("name", list(MEMORY_OPTIONS))
@pytest.mark.parametrize("lookahead", [0, 1, 2])
@pytest.mark.parametrize("j", [2, 4, 5, 9, 16])  # inside chunk 0, its last token, chunk 1's first, later
def test_fast_memory_writes_never_reach_the_token_they_score(name, lookahead, j):
    model = memory_model(name, lookahead=lookahead)
    assert_no_leak(model_nll(model), tokens(), j)
    assert model.blocks[0].memory(torch.randn(1, T, 12, dtype=torch.float64))[1].writes == T // 4  # it did write


@pytest.mark.parametrize("name", list(MEMORY_OPTIONS))
def test_leak_control_read_after_own_write_is_caught(name):
    """A memory that keeps its tables across calls (persistence="official") and scores the text a second
    time reads what it wrote from that same text: the check sees it."""
    model = memory_model(name, persistence="official")
    memory = model.blocks[0].memory
    initial = {k: b.clone() for k, b in memory.named_buffers()}
    score = model_nll(model)

    def second_pass(y):
        memory.load_state_dict({**memory.state_dict(), **initial}, strict=False)
        score(y)  # writes y into the tables
        return score(y)

    assert_leak_detected(second_pass, tokens(), 9)
