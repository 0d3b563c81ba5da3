"""The FWL's no-grad scoring path (ops.fwl.scoring_upstream, unembedding_grad_streamed, logits_from): the
inner gradient through the unembedding streamed over vocabulary slices with an online softmax, without the
slow logits, must give the numbers of the differentiable path and of the per-step reference (fp64), carry
state across calls as one call, and keep earlier scores blind to later tokens. Z = 1 unless named."""

import pytest
import torch

from fastweights.layers.fwl import FastWeightLayer, FWLOptions
from fastweights.ops.fwl import (
    BLOCK_FAST,
    fold_deltas,
    fwl_parallel,
    fwl_recurrent_reference,
    segment_pieces,
)
from fastweights.ops.streamed_unembedding import unembedding_grad_streamed, unembedding_no_grad

DT = torch.float64


def random_params(d=6, s=4, v=23, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=DT) * scale

    return {"U": r(d, 4 * s, scale=0.5), "a": r(4 * s, scale=0.2), "W": r(4 * s, s, scale=0.5), "b": r(s, scale=0.2),
            "ln_weight": 1 + r(s, scale=0.2), "ln_bias": r(s, scale=0.2), "E": r(s, v), "c": r(v, scale=0.2)}


def random_inputs(b=2, t=11, d=6, v=23, seed=2):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, d, generator=g, dtype=DT)
    labels = torch.randint(0, v, (b, t), generator=g)
    w = torch.ones(b, t, dtype=DT)
    w[0, 3] = 0  # a position without label: its gradient is zero and the stream skips it
    w[:, -1] = 0
    return h, labels, w


def steps_for(names, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {n: (0.05 + 0.3 * torch.rand((), generator=g)).to(DT) for n in names}


@pytest.mark.parametrize("vocab_chunk", [1, 4, 7, 23, 64])  # one column, slices with a ragged end, one slice
def test_streamed_unembedding_equals_the_direct_formulas(vocab_chunk):
    """scale * E (softmax(y E + c) - onehot) and y E + c computed directly, against the slice loops; the
    logits are large (|logit| ~ 300) so a slice loop that did not carry the running max would overflow."""
    g = torch.Generator().manual_seed(4)
    y = torch.randn(9, 5, generator=g, dtype=DT) * 30
    E = torch.randn(5, 23, generator=g, dtype=DT)
    c = torch.randn(23, generator=g, dtype=DT)
    labels = torch.randint(0, 23, (9,), generator=g)
    scale = torch.rand(9, generator=g, dtype=DT) + 0.5
    probs = torch.softmax(y @ E + c, -1)
    direct = scale[:, None] * ((probs - torch.nn.functional.one_hot(labels, 23).to(DT)) @ E.T)
    streamed = unembedding_grad_streamed(y, E, c, labels, scale, vocab_chunk)
    assert torch.isfinite(streamed).all()
    torch.testing.assert_close(streamed, direct, rtol=0, atol=1e-10)
    torch.testing.assert_close(unembedding_no_grad(y, E, c, vocab_chunk), y @ E + c, rtol=0, atol=1e-12)


CASES = {
    "all fast, segments, state-like start": dict(fast=BLOCK_FAST, segment_len=4, start=2, residual=False),
    "slow biases, no segments": dict(fast=("U", "W", "ln_weight", "ln_bias"), segment_len=0, start=0, residual=False),
    "LayerNorm only": dict(fast=("ln_weight", "ln_bias"), segment_len=3, start=1, residual=False),
    # the first layer slow: the fast pass starts from the slow pass's o (seed 18: SlowPass without o survived)
    "second layer only": dict(fast=("W", "b"), segment_len=3, start=1, residual=False),
    "residual (pretrained), segments": dict(fast=BLOCK_FAST, segment_len=5, start=3, residual=True),
    "block and c fast (c needs the logits)": dict(fast=(*BLOCK_FAST, "c"), segment_len=4, start=0, residual=False),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk_size", [64, 3])  # one exact masked block; the chunked linear-attention op
@pytest.mark.parametrize("logits_from", [0, 2])
def test_scoring_path_equals_autograd_path_and_reference(case, chunk_size, logits_from):
    """Under no_grad the op takes the streamed path; with autograd on it takes the differentiable one (the
    training path): both give the per-step reference's logits in fp64, from position ``logits_from`` on."""
    cfg = CASES[case]
    d = 4 if cfg["residual"] else 6
    params = random_params(d=d)
    h, labels, w = random_inputs(d=d)
    steps = steps_for(cfg["fast"])
    decays = {n: torch.tensor(0.6, dtype=DT) for n in cfg["fast"]}
    kw = dict(z_norm=1.0, chunk_size=chunk_size, segment_len=cfg["segment_len"], start=cfg["start"], decays=decays,
              residual=cfg["residual"], logits_from=logits_from)
    with torch.no_grad():
        scored, writes_scored = fwl_parallel(h, labels, w, params, steps, **kw)
    leaf = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    trained, writes_trained = fwl_parallel(h, labels, w, leaf, steps, **kw)
    assert trained.requires_grad and not scored.requires_grad
    ref = fwl_recurrent_reference(h, labels, w, params, steps, z_norm=1.0, segment_len=cfg["segment_len"],
                                  start=cfg["start"], decays=decays, residual=cfg["residual"])[:, logits_from:]
    assert scored.shape == ref.shape
    torch.testing.assert_close(scored, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(trained.detach(), ref, rtol=0, atol=1e-10)
    assert set(writes_scored) == set(writes_trained)
    for name, (k, v) in writes_scored.items():  # the same gradient factors carried to the next call
        torch.testing.assert_close(v, writes_trained[name][1], rtol=0, atol=1e-12)
        if k is not None:
            torch.testing.assert_close(k, writes_trained[name][0], rtol=0, atol=1e-12)


def test_fold_equals_the_segment_recurrence():
    """fold_deltas (fused k^T v and boundary) against the recurrence written out: Delta <- gamma Delta + S."""
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 10, 3, generator=g, dtype=DT), torch.randn(2, 10, 5, generator=g, dtype=DT)
    base0, carry0 = torch.randn(2, 3, 5, generator=g, dtype=DT), torch.randn(2, 3, 5, generator=g, dtype=DT)
    gamma = torch.tensor(0.7, dtype=DT)
    pieces = segment_pieces(2, 10, 4)  # [0, 2), [2, 6), [6, 10)
    base, carry = fold_deltas(base0, carry0, k, v, pieces, gamma)
    want_base, want_carry = base0.clone(), carry0.clone()
    for i, (lo, hi) in enumerate(pieces):
        if i > 0:
            want_base = gamma * want_base + (want_carry - want_base)
            want_carry = want_base.clone()
        for j in range(lo, hi):
            want_carry = want_carry + k[:, j, :, None] * v[:, j, None, :]
    torch.testing.assert_close(base, want_base, rtol=0, atol=1e-12)
    torch.testing.assert_close(carry, want_carry, rtol=0, atol=1e-12)
    assert torch.equal(base0, base0.clone()) and carry is not carry0  # the inputs are not written in place


def make_head(**kw):
    torch.manual_seed(0)
    head = FastWeightLayer(6, 23, FWLOptions(**{"hidden": 4, "init_std": 0.5, **kw})).to(DT).eval()
    with torch.no_grad():
        head.ln_weight.fill_(0.8)  # a residual head starts at gain 0, which would zero every block update
        for i, a in enumerate(head.step_sizes.values()):
            a.fill_(0.05 + 0.03 * i)
        for i, r in enumerate(head.decay_logits.values()):
            r.fill_(0.2 * i - 0.5)  # gamma != 1
    return head


VARIANTS = {"default": {}, "slow biases": {"fast_biases": False}, "bias only": {"bias_only": True},
            "residual": {"residual": True}}


@pytest.mark.parametrize("split", [[5, 5, 6], [1, 1, 3, 11], [16]])
@pytest.mark.parametrize("segment_len", [0, 5])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_head_scoring_in_pieces_equals_one_call_and_the_training_path(split, segment_len, variant):
    """The head under no_grad, the state carried across calls of any length, equals one call, and equals the
    head with autograd on (the differentiable path); a fast c (bias only) keeps the logits-based path."""
    opts = dict(VARIANTS[variant], hidden=0) if variant == "residual" else VARIANTS[variant]
    head = make_head(segment_len=segment_len, chunk_size=4, **opts)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, sum(split), 6, generator=g, dtype=DT)
    tokens = torch.randint(0, 23, (2, sum(split)), generator=g)
    with torch.no_grad():
        full, _ = head(h, tokens)
        parts, state, lo = [], None, 0
        for n in split:
            out, state = head(h[:, lo:lo + n], tokens[:, lo:lo + n], state)
            parts.append(out)
            lo += n
    trained, _ = head(h, tokens)
    assert trained.requires_grad
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-10)
    torch.testing.assert_close(full, trained.detach(), rtol=0, atol=1e-10)
    assert (full - head.slow_forward(h)).abs().max() > 1e-3  # the update does work


def test_head_scoring_does_not_see_future_tokens():
    """Changing the tokens and hidden states from position j on leaves the scored logits before j unchanged."""
    head = make_head(segment_len=4, chunk_size=64)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(1, 12, 6, generator=g, dtype=DT)
    tokens = torch.randint(0, 23, (1, 12), generator=g)
    for j in (1, 6, 11):
        h2, t2 = h.clone(), tokens.clone()
        h2[:, j:] += 1.0
        t2[:, j:] = (t2[:, j:] + 5) % 23
        with torch.no_grad():
            a, _ = head(h, tokens)
            b, _ = head(h2, t2)
        torch.testing.assert_close(a[:, :j], b[:, :j], rtol=0, atol=1e-12)
        assert (a[:, j:] - b[:, j:]).abs().max() > 1e-3
