"""Chunkwise (gated) delta rule against the per-step reference; update-rule properties; dispatch."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from fastweights.core.errors import UserError
from fastweights.ops.delta_rule import delta_rule, delta_rule_recurrent, select_backend
from fastweights.ops.feature_maps import dpfp, sum_normalize
from fastweights.ops.linear_attention import gated_rule_recurrent
from fastweights.core.compare import relative_error
from helpers import op_inputs

# The module, not the function of the same name that fastweights.ops re-exports.
dr = importlib.import_module("fastweights.ops.delta_rule")

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def make(b=2, t=37, h=2, dk=6, dv=4, dtype=torch.float64, seed=0):
    return op_inputs(b, t, h, dk, dv, dtype, seed, unit_keys=True)  # the delta rule wants unit-norm keys


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 16, 64])
@pytest.mark.parametrize("t", [5, 37, 130])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_s0", [False, True])
def test_chunked_equals_recurrent(dtype, chunk, t, gated, with_s0):
    q, k, v, beta, g, s0 = make(t=t, dtype=dtype)
    kw = dict(initial_state=s0 if with_s0 else None, output_final_state=True, log_decay=g if gated else None)
    o1, s1 = delta_rule(q, k, v, beta, chunk_size=chunk, **kw)
    o2, s2 = delta_rule_recurrent(q, k, v, beta, **kw)
    assert o1.dtype == dtype and s1.dtype == dtype
    assert relative_error(o1, o2) < TOL[dtype] and relative_error(s1, s2) < TOL[dtype]


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("chunk", [1, 8, 64])
def test_gradients_equal_recurrent(gated, chunk):
    q, k, v, beta, g, s0 = make(t=37)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, g, s0)]

    def grads(fn, **kw):
        q_, k_, v_, b_, g_, s_ = leaves
        o, s = fn(q_, k_, v_, b_, initial_state=s_, output_final_state=True, log_decay=g_ if gated else None, **kw)
        w_o = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=o.dtype)
        w_s = torch.randn(s.shape, generator=torch.Generator().manual_seed(2), dtype=s.dtype)
        wanted = [x for i, x in enumerate(leaves) if gated or i != 4]
        return torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), wanted)

    for a, b in zip(grads(delta_rule, chunk_size=chunk), grads(delta_rule_recurrent)):
        assert relative_error(a, b) < 1e-10


def test_gradcheck_tiny():
    q, k, v, beta, g, s0 = make(b=1, t=5, h=1, dk=3, dv=2)
    args = [x.requires_grad_() for x in (q, k, v, beta, g, s0)]

    def fn(q, k, v, b, g, s):
        return delta_rule(q, k, v, b, log_decay=g, initial_state=s, output_final_state=True, chunk_size=2)

    assert torch.autograd.gradcheck(fn, args)
    # a subset of inputs requiring grad exercises the "unused leaf" branches of the custom backward
    assert torch.autograd.gradcheck(lambda b_: delta_rule(q.detach(), k.detach(), v.detach(), b_, chunk_size=2)[0],
                                    (beta.detach().clone().requires_grad_(),))


@pytest.mark.parametrize("gated", [False, True])
def test_one_call_equals_pieces(gated):
    q, k, v, beta, g, s0 = make(t=70)
    full, s_full = delta_rule(q, k, v, beta, initial_state=s0, output_final_state=True,
                              log_decay=g if gated else None, chunk_size=16)
    state, outs = s0, []
    for lo, hi in ((0, 1), (1, 20), (20, 33), (33, 70)):
        o, state = delta_rule(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], beta[:, lo:hi], initial_state=state,
                              output_final_state=True, log_decay=g[:, lo:hi] if gated else None, chunk_size=16)
        outs.append(o)
    assert relative_error(torch.cat(outs, 1), full) < 1e-12 and relative_error(state, s_full) < 1e-12


def test_causality():
    q, k, v, beta, g, _ = make(t=40)
    o, _ = delta_rule(q, k, v, beta, log_decay=g, chunk_size=16)
    k2, v2, b2 = k.clone(), v.clone(), beta.clone()
    k2[:, 21:] = F.normalize(k2[:, 21:] + 0.5, dim=-1)
    v2[:, 21:] += 1.0
    b2[:, 21:] = 0.9
    o2, _ = delta_rule(q, k2, v2, b2, log_decay=g, chunk_size=16)
    assert torch.equal(o[:, :21], o2[:, :21])
    assert not torch.allclose(o[:, 21:], o2[:, 21:])


def test_beta_zero_leaves_state_unchanged():
    q, k, v, beta, _, s0 = make(t=19)
    _, s = delta_rule(q, k, v, torch.zeros_like(beta), initial_state=s0, output_final_state=True, chunk_size=8)
    assert relative_error(s, s0) < 1e-14


def test_beta_one_with_orthonormal_keys_overwrites_exactly():
    dk, dv = 6, 3
    keys = torch.linalg.qr(torch.randn(dk, dk, dtype=torch.float64))[0].T  # rows orthonormal
    s0 = torch.randn(1, 1, dk, dv, dtype=torch.float64)
    k = keys[:4].reshape(1, 4, 1, dk)
    v = torch.randn(1, 4, 1, dv, dtype=torch.float64)
    _, s = delta_rule(k, k, v, torch.ones(1, 4, 1, dtype=torch.float64), initial_state=s0,
                      output_final_state=True, chunk_size=2)
    for i in range(4):  # written keys now retrieve exactly their new values
        torch.testing.assert_close(s[0, 0].T @ keys[i], v[0, i, 0], rtol=0, atol=1e-12)
    for i in range(4, dk):  # untouched directions keep the old content
        torch.testing.assert_close(s[0, 0].T @ keys[i], s0[0, 0].T @ keys[i], rtol=0, atol=1e-12)


def test_appendix_b_table_delta_keeps_unrelated_associations():
    """Schlag et al. App. B: rewriting k2 interpolates its value under both rules; only delta keeps v1."""
    dk, dv, b = 5, 3, 0.3
    basis = torch.linalg.qr(torch.randn(dk, dk, dtype=torch.float64))[0].T
    k1, k2 = basis[0], basis[1]
    v1, v2, v3 = torch.randn(3, dv, dtype=torch.float64)
    s = (k1[:, None] * v1[None] + k2[:, None] * v2[None]).reshape(1, 1, dk, dv)  # S = W^T
    k = k2.reshape(1, 1, 1, dk)
    vv = v3.reshape(1, 1, 1, dv)
    beta = torch.full((1, 1, 1), b, dtype=torch.float64)
    _, s_delta = delta_rule(k, k, vv, beta, initial_state=s, output_final_state=True)
    _, s_peng = gated_rule_recurrent(k, k, vv, beta, initial_state=s, output_final_state=True)
    read = lambda st, key: st[0, 0].T @ key  # noqa: E731
    for st in (s_delta, s_peng):  # W' k3 = (1 - beta) v2 + beta v3 under both rules
        torch.testing.assert_close(read(st, k2), (1 - b) * v2 + b * v3)
    torch.testing.assert_close(read(s_delta, k1), v1)  # delta: v1 unchanged
    torch.testing.assert_close(read(s_peng, k1), (1 - b) * v1)  # Peng: v1 decays


def test_zero_log_decay_equals_ungated():
    q, k, v, beta, _, s0 = make(t=45)
    a, sa = delta_rule(q, k, v, beta, initial_state=s0, output_final_state=True, chunk_size=16)
    b, sb = delta_rule(q, k, v, beta, initial_state=s0, output_final_state=True, chunk_size=16,
                       log_decay=torch.zeros_like(beta))
    assert relative_error(a, b) < 1e-13 and relative_error(sa, sb) < 1e-13


def test_backward_does_not_store_a_state_per_step():
    """Bytes saved for backward grow like T*D (+ one state per chunk), not T*K*V as a per-step loop."""
    d = 64

    def saved_bytes(fn, t, **kw):
        q, k, v, beta, _, _ = make(b=1, t=t, h=1, dk=d, dv=d, dtype=torch.float32)
        xs = [x.requires_grad_() for x in (q, k, v, beta)]
        seen = {}

        def pack(x):
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()  # count each storage once
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            o, _ = fn(*xs, **kw)
        o.sum().backward()
        return sum(seen.values())

    t, chunk = 512, 32
    state_bytes = d * d * 4
    chunked = saved_bytes(delta_rule, t, chunk_size=chunk)
    per_step = saved_bytes(delta_rule_recurrent, t)
    assert per_step > t * state_bytes  # the loop keeps every state
    # ours: q, k, v, beta, L^{-1}, [U, W] and U~ (6 d + 1 + C floats per token) and one state per chunk
    assert chunked <= t * (6 * d + 1 + chunk) * 4 + (t // chunk) * state_bytes
    assert chunked < per_step / 5


def test_long_sequences_fp32_are_finite():
    g = torch.Generator().manual_seed(7)
    t = 4096
    # (a) keys not normalised, norms up to ~1.3: the true recurrence is stable (beta |k|^2 < 2) and
    #     the chunked solve must stay finite and accurate.
    k = torch.randn(1, t, 1, 8, generator=g)
    k = F.normalize(k, dim=-1) * (0.5 + 0.8 * torch.rand(1, t, 1, 1, generator=g))
    q = torch.randn(1, t, 1, 8, generator=g)
    v = torch.randn(1, t, 1, 8, generator=g)
    beta = torch.rand(1, t, 1, generator=g)
    o, s = delta_rule(q, k, v, beta, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    o_ref, _ = delta_rule_recurrent(q.double(), k.double(), v.double(), beta.double())
    assert relative_error(o, o_ref) < 1e-4
    # (b) raw Gaussian keys of norm ~ 8, normalised inside the op
    big_q = torch.randn(1, t, 2, 64, generator=g) * 10
    big_k = torch.randn(1, t, 2, 64, generator=g) * 10
    big_v = torch.randn(1, t, 2, 64, generator=g)
    big_b = torch.rand(1, t, 2, generator=g)
    o, s = delta_rule(big_q, big_k, big_v, big_b, qk_l2norm=True, output_final_state=True,
                      log_decay=-torch.rand(1, t, 2, generator=g))
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    # (c) DPFP + sum normalisation, as the fwp layer does
    phi_k = sum_normalize(dpfp(big_k, 1))
    phi_q = sum_normalize(dpfp(big_q, 1))
    o, s = delta_rule(phi_q, phi_k, big_v, big_b, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()


def test_bf16_inputs_and_autocast():
    q, k, v, beta, g, _ = make(t=40, dtype=torch.float32)
    ref, _ = delta_rule(q, k, v, beta, log_decay=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o_auto, s_auto = delta_rule(q, k, v, beta, log_decay=g, output_final_state=True)
    assert o_auto.dtype == torch.float32 and s_auto.dtype == torch.float32
    assert relative_error(o_auto, ref) < 1e-6  # bf16 matmuls would be ~1e-2 off
    o_bf, s_bf = delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16(), log_decay=g,
                            output_final_state=True)
    assert o_bf.dtype == torch.bfloat16 and s_bf.dtype == torch.float32
    assert relative_error(o_bf, ref) < 3e-2


def test_qk_l2norm_equals_prenormalised():
    q, k, v, beta, _, _ = make(t=20)
    a, _ = delta_rule(q * 3, k * 5, v, beta, qk_l2norm=True)
    b, _ = delta_rule(F.normalize(q, dim=-1), k, v, beta)
    assert relative_error(a, b) < 1e-6  # eps inside the normalisation


# ----------------------------------------------------------------------------- backend dispatch


def test_select_backend_truth_table():
    common = dict(gated=False, needs_grad=True)
    assert select_backend("torch", device_type="cuda", dtype=torch.bfloat16, fla_ok=True, **common) == "torch"
    assert select_backend("compiled", device_type="cpu", dtype=torch.float32, fla_ok=False, **common) == "compiled"
    assert select_backend("auto", device_type="cuda", dtype=torch.bfloat16, fla_ok=True, **common) == "fla"
    assert select_backend("auto", device_type="cuda", dtype=torch.float16, fla_ok=True, **common) == "fla"
    assert select_backend("auto", device_type="cuda", dtype=torch.float32, fla_ok=True, **common) == "torch"
    assert select_backend("auto", device_type="cpu", dtype=torch.bfloat16, fla_ok=True, **common) == "torch"
    assert select_backend("auto", device_type="cuda", dtype=torch.bfloat16, fla_ok=False, **common) == "torch"
    # Hopper + old Triton: fla refuses the gated backward, so auto trains through the compiled form
    hopper = dict(device_type="cuda", dtype=torch.bfloat16, fla_ok=True, fla_refuses_gated_backward=True)
    assert select_backend("auto", gated=True, needs_grad=True, **hopper) == "compiled"
    assert select_backend("auto", gated=True, needs_grad=False, **hopper) == "fla"
    assert select_backend("auto", gated=False, needs_grad=True, **hopper) == "fla"
    assert select_backend("fla", device_type="cuda", dtype=torch.float32, fla_ok=True, **common) == "fla"
    with pytest.raises(UserError):
        select_backend("fla", device_type="cuda", dtype=torch.bfloat16, fla_ok=False, **common)
    with pytest.raises(UserError):
        select_backend("fla", device_type="cpu", dtype=torch.bfloat16, fla_ok=True, **common)
    with pytest.raises(UserError, match="unknown backend"):
        select_backend("triton", device_type="cpu", dtype=torch.float32, fla_ok=False, **common)


def test_auto_on_cpu_is_torch_and_fla_is_a_clear_error():
    q, k, v, beta, _, _ = make(t=10, dtype=torch.float32)
    a, _ = delta_rule(q, k, v, beta, backend="auto")
    b, _ = delta_rule(q, k, v, beta, backend="torch")
    assert torch.equal(a, b)
    with pytest.raises(UserError, match="fla"):
        delta_rule(q, k, v, beta, backend="fla")  # not importable here, or not CUDA


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_s0", [False, True])
def test_compiled_form_equals_recurrent(gated, with_s0, monkeypatch):
    """The compiled fallback (the chunkwise form's parallel parts through torch.compile, fullgraph) against
    the per-step reference in fp64, outputs and every gradient. Traced with backend="aot_eager" here (the
    graph capture and autograd are what the CPU can check quickly; the GPU run compiles with inductor)."""
    monkeypatch.setattr(dr, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    monkeypatch.setattr(dr, "_COMPILED", {})
    q, k, v, beta, g, s0 = make(t=37)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, g, s0)]
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, g, s0)]
    w = torch.randn(2, 37, 2, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def run(fn, xs, **kw):
        q_, k_, v_, b_, g_, s_ = xs
        o, s = fn(q_, k_, v_, b_, initial_state=s_ if with_s0 else None, output_final_state=True,
                  log_decay=g_ if gated else None, **kw)
        (o * w).sum().backward(inputs=[x for i, x in enumerate(xs) if (gated or i != 4) and (with_s0 or i != 5)],
                               retain_graph=True)
        s.sum().backward(inputs=[x for i, x in enumerate(xs) if (gated or i != 4) and (with_s0 or i != 5)])
        return o, s

    o1, s1 = run(delta_rule, leaves, chunk_size=16, backend="compiled")
    o2, s2 = run(delta_rule_recurrent, ref_leaves)
    assert len(dr._COMPILED) == 4  # the forward's two parallel parts and the backward's two
    assert relative_error(o1, o2) < 1e-10 and relative_error(s1, s2) < 1e-10
    for i, (a, b) in enumerate(zip(leaves, ref_leaves)):
        if b.grad is not None:
            assert relative_error(a.grad, b.grad) < 1e-9, i


def test_fla_adapter_maps_arguments(monkeypatch):
    calls = []

    def fake_delta(**kw):
        calls.append(("delta", kw))
        return kw["v"], None

    def fake_gated(**kw):
        calls.append(("gated", kw))
        return kw["v"], None

    fla_backend = importlib.import_module("fastweights.ops.fla_backend")
    monkeypatch.setattr(fla_backend, "_fla_functions", lambda: (fake_delta, fake_gated))
    q, k, v, beta, g, s0 = make(t=4, dtype=torch.float32)
    dr._delta_rule_fla(q, k, v, beta, 0.5, s0, True, None, False)
    dr._delta_rule_fla(q, k, v, beta, 0.5, s0, False, g, True)
    (name0, kw0), (name1, kw1) = calls
    assert name0 == "delta" and kw0["scale"] == 0.5 and kw0["initial_state"] is s0 and kw0["output_final_state"]
    assert name1 == "gated" and kw1["g"].dtype == torch.float32 and kw1["use_qk_l2norm_in_kernel"] is True
    torch.testing.assert_close(kw1["g"], g.float())
    assert kw0["beta"] is beta and kw1["beta"] is beta  # fp32 outside autocast: passed as they are


def test_bad_inputs_raise_user_error():
    q, k, v, beta, g, _ = make(t=6)
    with pytest.raises(UserError):
        delta_rule(q, k, v, beta[:, :5])
    with pytest.raises(UserError):
        delta_rule(q, k, v, beta, log_decay=g[..., :1])
    with pytest.raises(UserError):
        delta_rule(q, k, v, beta, chunk_size=-1)
