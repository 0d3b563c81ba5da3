"""The chunk-major delta rule (``backend="torch"``) against the per-step reference and the functional form, in fp64."""

import importlib

import pytest
import torch

from fastweights.ops.delta_rule import delta_rule, delta_rule_recurrent
from fastweights.core.compare import relative_error
from helpers import op_inputs

dr = importlib.import_module("fastweights.ops.delta_rule")
dc = importlib.import_module("fastweights.ops.delta_rule_chunked")


def make(b=2, t=37, h=3, dk=6, dv=4, dtype=torch.float64, seed=0):
    return op_inputs(b, t, h, dk, dv, dtype, seed, unit_keys=True)


def run(fn, leaves, gated, with_s0, w_o=1.0, w_s=1.0, **kw):
    """Outputs, final state and the gradients of sum(o * w_o) + sum(s * w_s) w.r.t. the leaves that take part."""
    q, k, v, beta, g, s0 = leaves
    o, s = fn(q, k, v, beta, initial_state=s0 if with_s0 else None, output_final_state=True,
              log_decay=g if gated else None, **kw)
    used = [x for i, x in enumerate(leaves) if x.requires_grad and (gated or i != 4) and (with_s0 or i != 5)]
    loss = sum((x * w).sum() for x, w in ((o, w_o), (s, w_s)) if w is not None)
    return o, s, torch.autograd.grad(loss, used, allow_unused=True)


def weights(t, h, dv, dk, b=2):
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(b, t, h, dv, generator=gen, dtype=torch.float64),
            torch.randn(b, h, dk, dv, generator=gen, dtype=torch.float64))


@pytest.mark.parametrize("t, chunk", [(1, 64), (37, 1), (37, 7), (37, 16), (64, 64), (70, 64), (130, 32)])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_s0", [False, True])
def test_chunk_major_equals_recurrent_outputs_and_gradients(t, chunk, gated, with_s0):
    inputs = make(t=t)
    w_o, w_s = weights(t, 3, 4, 6)
    ours = run(delta_rule, [x.clone().requires_grad_() for x in inputs], gated, with_s0, w_o, w_s,
               chunk_size=chunk, backend="torch")
    ref = run(delta_rule_recurrent, [x.clone().requires_grad_() for x in inputs], gated, with_s0, w_o, w_s)
    assert relative_error(ours[0], ref[0]) < 1e-12 and relative_error(ours[1], ref[1]) < 1e-12
    assert len(ours[2]) == len(ref[2])
    for i, (a, b) in enumerate(zip(ours[2], ref[2])):
        assert relative_error(a, b) < 1e-10, i


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("which", ["output", "state"])
def test_one_output_used_equals_recurrent(gated, which):
    """Only o or only the final state reaches the loss: the backward gets None for the other (its branches)."""
    inputs = make(t=45)
    w_o, w_s = weights(45, 3, 4, 6)
    w_o, w_s = (w_o, None) if which == "output" else (None, w_s)
    ours = run(delta_rule, [x.clone().requires_grad_() for x in inputs], gated, True, w_o, w_s, chunk_size=16)
    ref = run(delta_rule_recurrent, [x.clone().requires_grad_() for x in inputs], gated, True, w_o, w_s)
    for i, (a, b) in enumerate(zip(ours[2], ref[2])):
        if b is None or not b.abs().max() > 0:  # q does not reach the final state
            assert a is None or a.abs().max() < 1e-12, i
        else:
            assert relative_error(a, b) < 1e-10, i


@pytest.mark.parametrize("gated", [False, True])
def test_chunk_major_equals_functional_form(gated):
    """The two chunkwise forms (backend "torch" and the one "compiled" traces, here run eagerly) agree in fp64."""
    inputs = make(t=77)
    w_o, w_s = weights(77, 3, 4, 6)
    ours = run(delta_rule, [x.clone().requires_grad_() for x in inputs], gated, True, w_o, w_s, chunk_size=16)

    def functional(q, k, v, beta, *, initial_state, output_final_state, log_decay, chunk_size):
        return _functional(q, k, v, beta, q.shape[-1] ** -0.5, initial_state, log_decay, chunk_size)

    other = run(functional, [x.clone().requires_grad_() for x in inputs], gated, True, w_o, w_s, chunk_size=16)
    assert relative_error(ours[0], other[0]) < 1e-13 and relative_error(ours[1], other[1]) < 1e-13
    for i, (a, b) in enumerate(zip(ours[2], other[2])):
        assert relative_error(a, b) < 1e-11, i


def _functional(q, k, v, beta, scale, initial_state, log_decay, chunk):
    """delta_rule.py's functional form, called the way its ``_delta_rule_torch`` calls it with compiled=True,
    but eager."""
    from fastweights.ops.linear_attention import chunk_inputs, compute_dtype, from_chunks, scalars_to_chunks

    cd = compute_dtype(q)
    qc, kc, vc = chunk_inputs(q, k, v, scale, chunk)
    gc = None if log_decay is None else scalars_to_chunks(log_decay.to(cd), chunk)
    o, final = dr._ChunkedDeltaRule.apply(qc, kc, vc, scalars_to_chunks(beta.to(cd), chunk), gc, initial_state, False)
    return from_chunks(o, q.shape[1]), final


@pytest.mark.parametrize("t, chunk", [(5, 2), (64, 16), (70, 16), (3, 8)])
def test_chunk_major_layout_round_trip(t, chunk):
    x = torch.randn(2, t, 3, 5, dtype=torch.float64)
    cm = dc._to_chunk_major(x, chunk, torch.float64)
    n = -(-t // chunk)
    assert cm.shape == (n, 6, chunk, 5) and cm.is_contiguous()
    # chunk i of (batch b, head h) holds rows i*C .. i*C + C - 1 of x[b, :, h]; the padded tail is zero
    padded = torch.cat([x, x.new_zeros(2, n * chunk - t, 3, 5)], dim=1)
    torch.testing.assert_close(cm.view(n, 2, 3, chunk, 5), padded.view(2, n, chunk, 3, 5).permute(1, 0, 3, 2, 4),
                               rtol=0, atol=0)
    back = dc._from_chunk_major(cm, 2, 3, t, torch.float32)
    assert back.dtype == torch.float32 and back.is_contiguous()
    torch.testing.assert_close(back, x.float(), rtol=0, atol=0)
    torch.testing.assert_close(dc._to_chunk_major(x, chunk, torch.float64, scale=0.5), cm * 0.5, rtol=0, atol=0)
    s = torch.randn(2, t, 3, dtype=torch.float64)
    torch.testing.assert_close(dc._scalars_from(dc._scalars_to(s, chunk, torch.float64), 2, 3, t, torch.float64), s)


def test_final_state_changed_in_place_leaves_the_gradients_alone():
    """The returned final state is the op's own tensor: changing it must not change what backward reads."""
    inputs = make(t=40)
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, s = delta_rule(*leaves[:4], initial_state=leaves[5], output_final_state=True, chunk_size=16)
    s.detach().mul_(100.0)
    grads = torch.autograd.grad(o.sum(), leaves[:4])
    ref_leaves = [x.clone().requires_grad_() for x in inputs]
    o2, _ = delta_rule_recurrent(*ref_leaves[:4], initial_state=ref_leaves[5])
    for a, b in zip(grads, torch.autograd.grad(o2.sum(), ref_leaves[:4])):
        assert relative_error(a, b) < 1e-10


def test_gradients_come_back_in_the_inputs_dtypes():
    q, k, v, beta, g, s0 = make(t=20, dtype=torch.float32)
    leaves = [x.bfloat16().requires_grad_() for x in (q, k, v, beta)] + [g.requires_grad_(), s0.double().requires_grad_()]
    o, s = delta_rule(*leaves[:4], log_decay=leaves[4], initial_state=leaves[5], output_final_state=True,
                      chunk_size=8, backend="torch")
    (o.float().sum() + s.sum()).backward()
    assert [x.grad.dtype for x in leaves] == [torch.bfloat16] * 4 + [torch.float32, torch.float64]


@pytest.mark.parametrize("only", [1, 3, 4, 5])
def test_a_single_input_requiring_grad(only):
    """k, beta, log decay or the initial state alone requires grad (the others get no gradient work)."""
    inputs = make(t=33)
    out = []
    for fn in (delta_rule, delta_rule_recurrent):
        leaves = [x.clone().requires_grad_(i == only) for i, x in enumerate(inputs)]
        o, s = fn(*leaves[:4], log_decay=leaves[4], initial_state=leaves[5], output_final_state=True,
                  **({"chunk_size": 8} if fn is delta_rule else {}))
        out.append(torch.autograd.grad(o.sum() + s.sum(), leaves[only])[0])
    assert relative_error(*out) < 1e-10


def test_saved_for_backward_is_below_the_functional_forms():
    """Saved: q, k, v, W, U~ (5 D), L^{-1} (C), beta per token and N + 1 states; the functional form keeps
    6 D + C + 1 per token."""
    d, t, chunk = 64, 512, 32
    q, k, v, beta, _, _ = make(b=1, t=t, h=1, dk=d, dv=d, dtype=torch.float32)
    xs = [x.requires_grad_() for x in (q, k, v, beta)]
    seen = {}

    def pack(x):
        seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        o, _ = delta_rule(*xs, chunk_size=chunk, backend="torch")
    o.sum().backward()
    assert sum(seen.values()) <= t * (5 * d + chunk + 1) * 4 + (t // chunk + 1) * d * d * 4


def test_every_causal_mask_is_built_on_the_inputs_device(monkeypatch):
    """On the CPU a mask built on the default device works by accident; on CUDA it would be a CPU tensor multiplied
    into GPU ones. The chunked forward and backward ask for each mask, and the identity L^{-1} is solved against, on
    the inputs' device (stand-ins record; the meta device does not check this op's devices)."""
    from fastweights.ops import delta_rule_chunked as drc

    asked, eyes = [], []
    real, real_eye = drc.causal_mask, torch.eye
    monkeypatch.setattr(drc, "causal_mask", lambda c, device, dtype, strict=False: asked.append((device, dtype, strict))
                        or real(c, device, dtype, strict))
    monkeypatch.setattr(torch, "eye", lambda c, **kw: eyes.append(kw) or real_eye(c, **kw))  # L's identity too
    q, k, v, beta, log_decay, s0 = op_inputs(1, 40, 2, 8, 8, dtype=torch.float64, unit_keys=True)
    for gated in (True, False):  # the diagonal-kept mask serves the ungated rule only
        leaves = [x.detach().requires_grad_() for x in (q, k, v, beta, log_decay)]
        o, _ = delta_rule(*leaves[:4], log_decay=leaves[4] if gated else None, backend="torch")
        o.sum().backward()
    # ... and in the compute dtype (fp64 here; a mask of the default dtype is fp32: mutations caught)
    assert {s for *_, s in asked} == {False, True}, asked
    assert all(d == torch.device("cpu") and dt == torch.float64 for d, dt, _ in asked), asked
    assert eyes and all(kw == {"dtype": torch.float64, "device": torch.device("cpu")} for kw in eyes), eyes


@pytest.mark.parametrize("gated", [False, True])
def test_forward_and_backward_stay_on_the_inputs_device(gated):
    """The meta device stands in for CUDA: a tensor made on the default device (an identity or mask without
    ``device=``) meets the inputs in an op and fails there, as a CPU tensor would among GPU ones. Outputs and
    gradients keep the inputs' device and the compute dtype."""
    from fastweights.ops.delta_rule_chunked import delta_rule_chunk_major

    def leaf(*shape):
        return torch.empty(*shape, device="meta", dtype=torch.float64, requires_grad=True)

    q, k, v, beta, g, s0 = leaf(1, 40, 2, 8), leaf(1, 40, 2, 8), leaf(1, 40, 2, 8), leaf(1, 40, 2), leaf(1, 40, 2), \
        leaf(1, 2, 8, 8)
    o, s = delta_rule_chunk_major(q, k, v, beta, 0.5, s0, g if gated else None, 16)
    (o.sum() + s.sum()).backward()
    for t in (o, s, q.grad, k.grad, v.grad, beta.grad, s0.grad, *([g.grad] if gated else [])):
        assert t.device.type == "meta" and t.dtype == torch.float64


def test_the_gate_gradient_is_computed_only_when_asked_for(monkeypatch):
    """need_dg: a gated call whose log decays need no gradient skips the gate's backward work (its d_g is None)."""
    from fastweights.ops import delta_rule_chunked as drc

    got = []
    real = drc._backward

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        got.append(out[4])
        return out

    monkeypatch.setattr(drc, "_backward", spy)
    q, k, v, beta, log_decay, _ = op_inputs(1, 40, 2, 8, 8, dtype=torch.float32, unit_keys=True)
    for wants in (False, True):
        leaves = [x.detach().requires_grad_() for x in (q, k, v, beta)]
        g = log_decay.detach().requires_grad_(wants)
        o, _ = delta_rule(*leaves, log_decay=g, backend="torch")
        o.sum().backward()
        assert (got[-1] is None) is (not wants) and (g.grad is not None) is wants
