"""Hand-written backward passes of the shared building blocks hold against autograd / gradcheck."""

import torch

from fastweights.layers.common import RMSNorm, RotaryEmbedding, _RMSNorm


def test_rmsnorm_matches_reference_and_gradcheck():
    torch.manual_seed(0)
    norm = RMSNorm(8).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    torch.testing.assert_close(norm(x), ref)
    w = norm.weight.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: _RMSNorm.apply(a, b, 1e-6)[0], (x, w))


def test_rope_matches_rotation_and_gradcheck():
    torch.manual_seed(0)
    D = 8
    rope = RotaryEmbedding(D)
    x = torch.randn(2, 3, 6, D, dtype=torch.float64, requires_grad=True)
    y = rope(x, start=4)
    # reference: rotate the pair (x_2i, x_2i+1) by angle pos * base^(-2i/D)
    pos = torch.arange(4, 10, dtype=torch.float64)[:, None]
    ang = pos * (1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))  # [T, D/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    ref = torch.stack([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1).flatten(-2)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)  # tables are fp32
    assert torch.autograd.gradcheck(lambda a: rope(a, 4), (x,))
    # rotations preserve norms and relative positions: <R_s q, R_t k> depends on t - s only
    q, k = torch.randn(1, 1, 1, D, dtype=torch.float64), torch.randn(1, 1, 1, D, dtype=torch.float64)
    a = (rope(q, 3) * rope(k, 7)).sum()
    b = (rope(q, 13) * rope(k, 17)).sum()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rope_in_fp64_computes_its_angles_on_the_inputs_device():
    """fp64 inputs get fp64 frequencies made for the call: on the input's device, not the CPU (seed-3 mutation
    draw: the device was dropped, which the CPU cannot see; the meta device stands in for a GPU)."""
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, device="meta")
    assert rope(x, 0).device.type == "meta"
    assert rope(x, torch.zeros(2, 5, dtype=torch.long, device="meta")).shape == x.shape
