"""The FWL head's options for a pretrained backbone (issue 41): log-parameterised step sizes and the initial
LayerNorm gain of the residual branch."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fastweights.core.errors import UserError
from fastweights.layers.fwl import FastWeightLayer, FWLOptions

DT = torch.float64


def _head(opts: FWLOptions, d=6, v=9, seed=0):
    torch.manual_seed(seed)
    out_layer = torch.nn.Linear(d, v, bias=True).double()
    return FastWeightLayer(d, v, opts, unembedding=out_layer).double(), out_layer


def _data(d=6, v=9, t=12):
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, t, d, generator=g, dtype=DT), torch.randint(0, v, (2, t), generator=g)


def test_log_step_sizes_give_the_same_head_as_linear_ones():
    base = FWLOptions(residual=True, segment_len=4, step_size_init=0.02, ln_gain_init=0.5)
    lin, _ = _head(base)
    log, _ = _head(dataclasses.replace(base, step_size_log=True))
    assert all(abs(p.exp().item() - 0.02) < 1e-8 for p in log.step_sizes.values())  # built in fp32, then fp64
    with torch.no_grad():  # the same alphas to the last bit
        for n, p in lin.step_sizes.items():
            p.copy_(log.step_sizes[n].exp())
    h, tokens = _data()
    a, _ = lin(h, tokens)
    b, _ = log(h, tokens)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)  # exp(log alpha) = alpha
    # chain rule: d loss / d log(alpha) = alpha * d loss / d alpha
    for head, logits in ((lin, a), (log, b)):
        F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for n in lin.step_sizes:
        torch.testing.assert_close(log.step_sizes[n].grad, lin.step_sizes[n].detach() * lin.step_sizes[n].grad, rtol=1e-9, atol=1e-15)


def test_log_step_sizes_need_a_positive_initial_step():
    with pytest.raises(UserError, match="step_size_init must be > 0"):
        FastWeightLayer(6, 9, FWLOptions(step_size_log=True, step_size_init=0.0))
    FastWeightLayer(6, 9, FWLOptions(step_size_log=True, step_size_init=0.0, test_time_only=True))  # no learned steps


def test_initial_gain_defaults_and_override():
    assert FastWeightLayer(6, 9, FWLOptions()).ln_weight.detach().eq(1).all()
    assert FastWeightLayer(6, 9, FWLOptions(residual=True)).ln_weight.detach().eq(0).all()
    assert FastWeightLayer(6, 9, FWLOptions(residual=True, ln_gain_init=0.05)).ln_weight.detach().eq(0.05).all()


@pytest.mark.parametrize("gain,trapped", [(0.0, True), (0.05, False)])
def test_zero_gain_is_the_trap_a_small_gain_escapes(gain, trapped):
    """With the residual branch's gain at 0 the inner gradients of U, a, W, b are zero, so their step sizes get
    exactly zero gradient (the trap of issue 41); a small non-zero gain gives them a gradient."""
    head, _ = _head(FWLOptions(residual=True, segment_len=4, step_size_init=0.02, ln_gain_init=gain))
    h, tokens = _data()
    logits, _ = head(h, tokens)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    inner = [head.step_sizes[n].grad.abs().item() for n in ("U", "a", "W", "b")]
    assert (max(inner) == 0.0) if trapped else (min(inner) > 0.0)
    assert head.step_sizes["ln_bias"].grad.abs().item() > 0.0  # the LN bias moves at any gain
