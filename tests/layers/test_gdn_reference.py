"""The gdn layer against its module docstring's equations, step by step in fp64, for both of its variants (the
short convolution and output gate, and neither): the projections, the convolution's silu, L2-normalised q and k,
the gated delta rule one step at a time, the per-head RMSNorm and the gate. Mutation caught: the ungated
variant's norm over the wrong axis, without its eps, or scaled the wrong way; the gate's silu dropped."""

import pytest
import torch
import torch.nn.functional as F

from fastweights.layers.gdn import GatedDeltaNet, GDNOptions


def reference(layer: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    o_ = layer.options
    b, t, _ = x.shape
    h, dk, dv = layer.n_heads, layer.head_k, layer.head_v
    qkv = x @ layer.qkv.weight.T  # [B, T, 2HK + HV]
    if o_.use_short_conv:
        w = layer.conv_weight[:, 0, :]  # [D, W]: y_t = sum_i w[:, W-1-i] x_{t-i}
        width = w.shape[1]
        conv = torch.zeros_like(qkv)
        for step in range(t):
            for i in range(width):
                if step - i >= 0:
                    conv[:, step] += w[:, width - 1 - i] * qkv[:, step - i]
        qkv = conv
    qkv = F.silu(qkv)
    q, k, v = qkv.split([h * dk, h * dk, h * dv], dim=-1)
    q, k, v = q.view(b, t, h, dk), k.view(b, t, h, dk), v.view(b, t, h, dv)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    beta = torch.sigmoid(x @ layer.b_proj.weight.T)  # [B, T, H]
    g = -torch.exp(layer.A_log) * F.softplus(x @ layer.a_proj.weight.T + layer.dt_bias)  # [B, T, H]
    S = torch.zeros(b, h, dk, dv, dtype=x.dtype)
    outs = []
    eye = torch.eye(dk, dtype=x.dtype)
    for step in range(t):
        kt, vt, qt, bt = k[:, step], v[:, step], q[:, step], beta[:, step, :, None, None]
        a = torch.exp(g[:, step])[:, :, None, None]
        S = a * ((eye - bt * kt[..., :, None] * kt[..., None, :]) @ S) + bt * kt[..., :, None] * vt[..., None, :]
        outs.append((S.transpose(-1, -2) @ qt[..., None])[..., 0] / dk**0.5)  # [B, H, V]
    o = torch.stack(outs, dim=1)  # [B, T, H, V]
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + o_.norm_eps) * layer.norm_weight
    if o_.use_gate:
        o = o * F.silu((x @ layer.g_proj.weight.T).view(b, t, h, dv))
    return o.reshape(b, t, h * dv) @ layer.out.weight.T


@pytest.mark.parametrize("variant", sorted(GatedDeltaNet.test_variants))
def test_the_layer_equals_its_equations(variant):
    torch.manual_seed(0)
    layer = GatedDeltaNet(16, 2, GDNOptions(**GatedDeltaNet.test_variants[variant])).double()
    with torch.no_grad():
        layer.norm_weight.uniform_(0.5, 1.5)  # not ones: a norm weight applied the wrong way shows
    x = torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y, _ = layer(x)
    torch.testing.assert_close(y, reference(layer, x), rtol=1e-9, atol=1e-10)


def test_under_autocast_the_gate_is_upcast_with_the_rules_output(monkeypatch):
    """Under bf16 autocast the projections run in bf16; the norm and gate take the rule's output and the gate in
    fp32 (the silu in fp32). Mutation caught: the gate's ``.to(o.dtype)`` dropped (``.to(None)``: silu in bf16)."""
    import fastweights.layers.gdn as gdn

    seen = []
    real = gdn.gated_rms_norm
    monkeypatch.setattr(gdn, "gated_rms_norm", lambda o, g, *a: seen.append((o.dtype, g.dtype)) or real(o, g, *a))
    torch.manual_seed(0)
    layer = GatedDeltaNet(16, 2, GDNOptions(**GatedDeltaNet.test_variants["conv-gate"]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(1, 8, 16))
    assert seen == [(torch.float32, torch.float32)]
