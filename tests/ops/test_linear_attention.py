"""Chunked linear attention (sum rule) and Peng's gated rule against their per-step references."""

import pytest
import torch

from fastweights.core.errors import UserError
from fastweights.ops.linear_attention import (
    gated_rule,
    gated_rule_recurrent,
    linear_attention,
    linear_attention_recurrent,
)
from fastweights.core.compare import relative_error
from helpers import op_inputs

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def make(b=2, t=37, h=2, dk=5, dv=4, dtype=torch.float64, seed=0, positive=False):
    return op_inputs(b, t, h, dk, dv, dtype, seed, positive=positive)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 16, 64])
@pytest.mark.parametrize("t", [5, 37])
@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("with_s0", [False, True])
def test_chunked_equals_recurrent(dtype, chunk, t, decay, with_s0):
    q, k, v, _, g, s0 = make(t=t, dtype=dtype)
    kw = dict(initial_state=s0 if with_s0 else None, output_final_state=True, log_decay=g if decay else None)
    o1, s1 = linear_attention(q, k, v, chunk_size=chunk, **kw)
    o2, s2 = linear_attention_recurrent(q, k, v, **kw)
    assert o1.dtype == dtype
    assert relative_error(o1, o2) < TOL[dtype] and relative_error(s1, s2) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_normalized_equals_recurrent_and_streams(dtype):
    q, k, v, *_ = make(t=41, dtype=dtype, positive=True)
    z0 = torch.rand(2, 2, 5, dtype=dtype)
    o1, _ = linear_attention(q, k, v, normalize=True, chunk_size=16, initial_normalizer=z0)
    o2, _ = linear_attention_recurrent(q, k, v, normalize=True, initial_normalizer=z0)
    assert relative_error(o1, o2) < TOL[dtype]
    # streaming: carry S and the normaliser z = z0 + sum of keys
    oa, sa = linear_attention(q[:, :20], k[:, :20], v[:, :20], normalize=True, output_final_state=True, chunk_size=8)
    za = k[:, :20].sum(1)
    ob, _ = linear_attention(
        q[:, 20:], k[:, 20:], v[:, 20:], normalize=True, initial_state=sa, initial_normalizer=za, chunk_size=8
    )
    full, _ = linear_attention(q, k, v, normalize=True, chunk_size=8)
    assert relative_error(torch.cat([oa, ob], 1), full) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 16])
def test_gated_rule_equals_recurrent(dtype, chunk):
    q, k, v, beta, _, s0 = make(t=29, dtype=dtype)
    o1, s1 = gated_rule(q, k, v, beta, initial_state=s0, output_final_state=True, chunk_size=chunk)
    o2, s2 = gated_rule_recurrent(q, k, v, beta, initial_state=s0, output_final_state=True)
    assert relative_error(o1, o2) < TOL[dtype] and relative_error(s1, s2) < TOL[dtype]


def test_gated_rule_beta_one_overwrites_and_stays_finite():
    q, k, v, beta, _, s0 = make(t=9)
    beta = torch.ones_like(beta)
    beta.requires_grad_()
    o, s = gated_rule(q, k, v, beta, initial_state=s0, output_final_state=True, chunk_size=4)
    # beta = 1 forgets everything: the final state is the last write
    last = k[:, -1].unsqueeze(-1) * v[:, -1].unsqueeze(-2)
    assert relative_error(s, last) < 1e-10
    (o.sum() + s.sum()).backward()
    assert torch.isfinite(beta.grad).all()


@pytest.mark.parametrize("decay", [False, True])
def test_gradients_equal_recurrent(decay):
    q, k, v, _, g, s0 = make(t=23)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, s0)]
    gen = torch.Generator().manual_seed(5)

    def grads(fn, **kw):
        q_, k_, v_, g_, s_ = leaves
        o, s = fn(q_, k_, v_, initial_state=s_, output_final_state=True, log_decay=g_ if decay else None, **kw)
        w_o = torch.randn(o.shape, generator=gen.manual_seed(1), dtype=o.dtype)
        w_s = torch.randn(s.shape, generator=gen.manual_seed(2), dtype=s.dtype)
        wanted = [x for i, x in enumerate(leaves) if decay or i != 3]
        return torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), wanted)

    for a, b in zip(grads(linear_attention, chunk_size=8), grads(linear_attention_recurrent)):
        assert relative_error(a, b) < 1e-10


def test_gradcheck_tiny():
    q, k, v, beta, g, s0 = make(b=1, t=5, h=1, dk=3, dv=2)
    args = [x.requires_grad_() for x in (q, k, v, g, s0)]
    fn = lambda q, k, v, g, s: linear_attention(  # noqa: E731
        q, k, v, log_decay=g, initial_state=s, output_final_state=True, chunk_size=2
    )
    assert torch.autograd.gradcheck(fn, args)
    beta = beta.requires_grad_()
    assert torch.autograd.gradcheck(lambda b_: gated_rule(q, k, v, b_, chunk_size=2)[0], (beta,))


@pytest.mark.parametrize("decay", [False, True])
def test_one_call_equals_pieces(decay):
    q, k, v, _, g, s0 = make(t=50, dtype=torch.float64)
    full, s_full = linear_attention(
        q, k, v, initial_state=s0, output_final_state=True, log_decay=g if decay else None, chunk_size=16
    )
    state, outs = s0, []
    for lo, hi in ((0, 7), (7, 8), (8, 40), (40, 50)):
        o, state = linear_attention(
            q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], initial_state=state, output_final_state=True,
            log_decay=g[:, lo:hi] if decay else None, chunk_size=16,
        )
        outs.append(o)
    assert relative_error(torch.cat(outs, 1), full) < 1e-12 and relative_error(state, s_full) < 1e-12


def test_causality():
    q, k, v, _, g, _ = make(t=40)
    o, _ = linear_attention(q, k, v, log_decay=g, chunk_size=16)
    k2, v2 = k.clone(), v.clone()
    k2[:, 25:] += 1.0
    v2[:, 25:] -= 2.0
    o2, _ = linear_attention(q, k2, v2, log_decay=g, chunk_size=16)
    assert torch.equal(o[:, :25], o2[:, :25])
    assert not torch.allclose(o[:, 25:], o2[:, 25:])


def test_long_unnormalised_fp32_is_finite():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4096, 2, 16, generator=g) * 3
    k = torch.randn(1, 4096, 2, 16, generator=g) * 3
    v = torch.randn(1, 4096, 2, 16, generator=g)
    o, s = linear_attention(q, k, v, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    on, _ = linear_attention(q.abs(), k.abs(), v, normalize=True)
    assert torch.isfinite(on).all()


def test_bf16_and_autocast_compute_in_fp32():
    q, k, v, _, g, _ = make(t=33, dtype=torch.float32)
    ref, _ = linear_attention(q, k, v, log_decay=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o_auto, s_auto = linear_attention(q, k, v, log_decay=g, output_final_state=True)
    assert o_auto.dtype == torch.float32 and s_auto.dtype == torch.float32
    assert relative_error(o_auto, ref) < 1e-6  # bf16 matmuls would be ~1e-2 off
    o_bf, s_bf = linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), log_decay=g, output_final_state=True)
    assert o_bf.dtype == torch.bfloat16 and s_bf.dtype == torch.float32
    assert relative_error(o_bf, ref) < 3e-2


def test_empty_sequence_and_bad_shapes():
    q, k, v, *_ = make(t=0)
    o, s = linear_attention(q, k, v, output_final_state=True)
    assert o.shape == (2, 0, 2, 4) and (s == 0).all()
    q, k, v, *_ = make(t=4)
    with pytest.raises(UserError):
        linear_attention(q, k[:, :3], v)
    with pytest.raises(UserError):
        linear_attention(q, k, v, chunk_size=0)
    with pytest.raises(UserError):
        linear_attention(q, k, v, initial_state=torch.zeros(2, 2, 4, 4))
    with pytest.raises(UserError):
        linear_attention(q, k, v, normalize=True, log_decay=torch.zeros(2, 4, 2))
