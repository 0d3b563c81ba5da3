"""ops.swiglu: the SwiGLU gate that keeps only [g | u] for its backward equals the plain form (values, gradients,
second derivatives) in fp64 and fp32, keeps one [.., F] tensor less, and is the plain form where it must be."""

import pytest
import torch

from fastweights.layers.common import SwiGLU
from fastweights.ops.swiglu import swiglu, swiglu_reference


def gu_of(shape=(2, 5, 12), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(shape, generator=g, dtype=dtype)).requires_grad_()


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_values_and_gradients_equal_the_plain_form(dtype, tol):
    """Mutation caught: a sign or factor of dL/dg wrong (e.g. ``1 + g (1 - s)`` as ``1 + (1 - s)``), the halves'
    gradients swapped."""
    gu = gu_of(dtype=dtype)
    w = torch.randn(2, 5, 6, dtype=dtype, generator=torch.Generator().manual_seed(1))
    fast, ref = swiglu(gu), swiglu_reference(gu)
    torch.testing.assert_close(fast, ref, rtol=tol, atol=tol)
    (g_fast,) = torch.autograd.grad((fast * w).sum(), gu)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), gu)
    torch.testing.assert_close(g_fast, g_ref, rtol=tol, atol=tol)


def test_gradcheck_and_second_derivatives():
    """The backward is differentiable (create_graph through it: second-order training differentiates it)."""
    gu = gu_of(shape=(3, 8))
    assert torch.autograd.gradcheck(swiglu, (gu,))
    assert torch.autograd.gradgradcheck(swiglu, (gu,))


def saved_bytes(fn, gu):
    """Bytes of the distinct storages autograd keeps for the backward of ``fn(gu)``."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(gu)
    return sum(seen.values())


def test_keeps_one_f_wide_tensor_less_than_the_plain_form():
    """Only [.., 2F] is kept where the plain form keeps it and silu(g) [.., F]. Mutation caught: silu(g) saved
    beside gu (``save_for_backward(gu, silu)``)."""
    gu = gu_of(shape=(4, 64, 32), dtype=torch.float32)
    f_wide = 4 * 64 * 16 * 4  # one [.., F] fp32 tensor
    assert saved_bytes(swiglu, gu) == gu.numel() * 4
    assert saved_bytes(swiglu_reference, gu) - saved_bytes(swiglu, gu) == f_wide


def test_the_mlp_module_takes_the_recomputing_gate_and_keeps_its_down_projection_hookable():
    """SwiGLU computes through ops.swiglu (its saved bytes: the weights, x, gu and h only) and still calls ``down`` as a module,
    so a forward hook on it (low-rank dynamic evaluation's) changes the output. Mutation caught: the module on
    the plain form; ``down`` applied as a bare matmul."""
    torch.manual_seed(0)
    mlp = SwiGLU(16, 32)
    x = torch.randn(2, 8, 16, requires_grad=True)
    n = 2 * 8
    weights = 4 * (64 * 16 + 16 * 32)  # the two linears keep their weights
    assert saved_bytes(mlp, x) == weights + 4 * n * (16 + 2 * 32 + 32)  # x, gu, h; not silu(gate)
    plain = mlp(x)
    handle = mlp.down.register_forward_hook(lambda m, i, o: o + 1)
    try:
        torch.testing.assert_close(mlp(x), plain + 1)
    finally:
        handle.remove()


def test_without_gradients_it_is_the_plain_form():
    gu = gu_of().detach()
    with torch.no_grad():
        assert swiglu(gu).grad_fn is None
    torch.testing.assert_close(swiglu(gu), swiglu_reference(gu), rtol=0, atol=0)


def test_the_models_gradients_are_bit_identical_to_the_plain_forms(monkeypatch):
    """The backward makes the plain form's products in the same order: a trained model (the demo's) does not
    change. Mutation caught: dL/dg formed as the product of the formula's factors (another rounding)."""
    import fastweights.layers.common as common
    from fastweights.core.config import ModelConfig
    from fastweights.models.lm import LanguageModel

    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64)
    x = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))

    def grads():
        torch.manual_seed(0)
        model = LanguageModel(cfg).train()
        model(x, targets=x, return_logits=False).loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    ours = grads()
    monkeypatch.setattr(common, "swiglu", swiglu_reference)
    plain = grads()
    for n in ours:
        torch.testing.assert_close(ours[n], plain[n], rtol=0, atol=0)


def test_under_vmap_it_is_the_plain_form():
    """vmap (whose batched tensors do not require grad, so the route is the plain form) gives its values."""
    gu = gu_of(shape=(3, 4, 8))
    torch.testing.assert_close(torch.func.vmap(swiglu)(gu), swiglu_reference(gu), rtol=0, atol=0)
