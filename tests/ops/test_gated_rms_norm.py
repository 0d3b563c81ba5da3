"""ops.gated_rms_norm: the gated delta rule's output norm and gate, keeping only o and g for its backward, equals
the plain form (values, gradients, second derivatives) in fp64 and fp32, keeps three [.., V] tensors less, and is
what the gdn layer computes with."""

import pytest
import torch

from fastweights.ops.gated_rms_norm import gated_rms_norm, gated_rms_norm_reference

EPS = 1e-6


def inputs(shape=(2, 5, 3, 8), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(shape, generator=g, dtype=dtype).requires_grad_()
    gate = (2 * torch.randn(shape, generator=g, dtype=dtype)).requires_grad_()
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g, dtype=dtype)).requires_grad_()
    return o, gate, w


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_values_and_gradients_equal_the_plain_form(dtype, tol):
    """Mutation caught: the norm's gradient without its projection term (``- n mean(dn n)``), dL/dw not summed
    over every leading axis, the gate's gradient without w."""
    o, g, w = inputs(dtype=dtype)
    up = torch.randn(o.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    fast, ref = gated_rms_norm(o, g, w, EPS), gated_rms_norm_reference(o, g, w, EPS)
    torch.testing.assert_close(fast, ref, rtol=tol, atol=tol)
    for a, b in zip(torch.autograd.grad((fast * up).sum(), (o, g, w)), torch.autograd.grad((ref * up).sum(), (o, g, w))):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_gradcheck_and_second_derivatives():
    o, g, w = inputs(shape=(2, 3, 4))
    fn = lambda o, g, w: gated_rms_norm(o, g, w, EPS)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (o, g, w))
    assert torch.autograd.gradgradcheck(fn, (o, g, w))


def saved_bytes(fn):
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_keeps_o_and_g_only():
    """Mutation caught: n or silu(g) saved beside o and g."""
    o, g, w = inputs(shape=(4, 16, 2, 32), dtype=torch.float32)
    wide = o.numel() * 4
    assert saved_bytes(lambda: gated_rms_norm(o, g, w, EPS)) == 2 * wide + w.numel() * 4
    assert saved_bytes(lambda: gated_rms_norm_reference(o, g, w, EPS)) >= 5 * wide


def test_the_gdn_layer_norms_and_gates_through_it(monkeypatch):
    """The gdn layer's output equals with the plain form, and it calls this op. Mutation caught: the layer on the
    plain form (its saved bytes unchanged)."""
    import fastweights.layers.gdn as gdn

    torch.manual_seed(0)
    layer = gdn.GatedDeltaNet(32, 2).double()
    x = torch.randn(2, 16, 32, dtype=torch.float64, requires_grad=True)
    calls = []
    real = gdn.gated_rms_norm
    monkeypatch.setattr(gdn, "gated_rms_norm", lambda *a: calls.append(1) or real(*a))
    y, _ = layer(x)
    assert calls
    monkeypatch.setattr(gdn, "gated_rms_norm", gated_rms_norm_reference)
    torch.testing.assert_close(y, layer(x)[0], rtol=1e-12, atol=1e-12)


def test_under_vmap_it_is_the_plain_form():
    """vmap (whose batched tensors do not require grad, so the route is the plain form) gives its values."""
    o, g, w = inputs(shape=(3, 4, 8))
    fn = lambda o, g: gated_rms_norm(o, g, w, EPS)  # noqa: E731
    torch.testing.assert_close(torch.func.vmap(fn)(o, g), gated_rms_norm_reference(o, g, w, EPS), rtol=1e-12,
                               atol=1e-12)
