"""The "fwp" (fast weight programmer) and "gdn" (Gated DeltaNet) mixers on the state protocol. Causality and
streamed pieces == one call, for every rule x feature map and both gdn forms: contracts/test_registry_causality.py."""

import pytest
import torch

from fastweights.core.errors import UserError
from fastweights.layers.fwp import FastWeightProgrammer, FWPOptions
from fastweights.layers.gdn import GatedDeltaNet, GDNOptions
from fastweights.components import MIXERS, build_options, lookup

D_MODEL, HEADS = 16, 2

FWP_CONFIGS = [
    {"rule": "sum", "feature_map": "elu1"},
    {"rule": "sum", "feature_map": "dpfp", "nu": 2, "normalize": True},
    {"rule": "gated", "feature_map": "favor", "n_features": 6},
    {"rule": "delta", "feature_map": "dpfp"},
    {"rule": "delta", "feature_map": "identity", "sum_norm": False, "l2_norm": True},
    {"rule": "gated_delta", "feature_map": "elu1"},
]


def build(name, raw, dtype=torch.float64):
    torch.manual_seed(0)
    entry = lookup(MIXERS, "mixer", name)
    layer = entry.cls(d_model=D_MODEL, n_heads=HEADS, options=build_options(entry, raw))
    return layer.to(dtype)


@pytest.mark.parametrize("name,raw", [("fwp", c) for c in FWP_CONFIGS] + [("gdn", {})])
def test_gradients_reach_every_parameter(name, raw):
    layer = build(name, raw, dtype=torch.float32)
    x = torch.randn(2, 12, D_MODEL, requires_grad=True)
    y, state = layer(x)
    (y.pow(2).mean() + state["S"].pow(2).mean()).backward()
    for pname, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname
    assert torch.isfinite(x.grad).all()


def test_favor_matrix_is_a_buffer_redrawn_only_in_training():
    layer = build("fwp", {"rule": "delta", "feature_map": "favor", "n_features": 8, "redraw": True},
                  dtype=torch.float32)
    assert "omega" in layer.state_dict()
    before = layer.omega.clone()
    layer.eval()
    layer(torch.randn(1, 5, D_MODEL))
    assert torch.equal(layer.omega, before)
    layer.train()
    layer(torch.randn(1, 5, D_MODEL))
    assert not torch.equal(layer.omega, before)
    fixed = build("fwp", {"rule": "delta", "feature_map": "favor", "n_features": 8}, dtype=torch.float32)
    kept = fixed.omega.clone()
    fixed(torch.randn(1, 5, D_MODEL))
    assert torch.equal(fixed.omega, kept)


def test_sum_rule_has_no_beta_and_delta_does():
    sum_layer = build("fwp", {"rule": "sum"})
    delta_layer = build("fwp", {"rule": "delta"})
    gated_delta = build("fwp", {"rule": "gated_delta"})
    h, d = HEADS, D_MODEL // HEADS
    assert sum_layer.qkv.out_features == h * 3 * d
    assert delta_layer.qkv.out_features == h * (3 * d + 1)
    assert gated_delta.qkv.out_features == h * (3 * d + 2)
    assert delta_layer.d_dot == 2 * d  # default DPFP nu = 1


def test_long_sequences_stay_finite_fp32():
    x = torch.randn(1, 4096, D_MODEL) * 20
    for name, raw in (("fwp", {}), ("fwp", {"rule": "gated_delta", "feature_map": "elu1"}),
                      ("fwp", {"rule": "sum", "normalize": True}), ("gdn", {})):
        layer = build(name, raw, dtype=torch.float32)
        with torch.no_grad():
            y, state = layer(x)
        assert torch.isfinite(y).all() and torch.isfinite(state["S"]).all(), (name, raw)


def test_default_options_and_bad_options():
    opts = FWPOptions()
    assert (opts.rule, opts.feature_map, opts.nu, opts.sum_norm) == ("delta", "dpfp", 1, True)
    assert GDNOptions().use_short_conv
    entry = lookup(MIXERS, "mixer", "fwp")
    with pytest.raises(UserError):
        build_options(entry, {"rulez": "sum"})
    with pytest.raises(UserError):
        build_options(entry, {"nu": "two"})
    for bad in ({"rule": "hebb"}, {"feature_map": "softmax"}, {"feature_map": "identity"},
                {"rule": "delta", "sum_norm": False}, {"rule": "delta", "normalize": True},
                {"sum_norm": True, "l2_norm": True}):
        with pytest.raises(UserError):
            FastWeightProgrammer(d_model=D_MODEL, n_heads=HEADS, options=FWPOptions(**bad))
    with pytest.raises(UserError):
        GatedDeltaNet(d_model=D_MODEL, n_heads=HEADS, options=GDNOptions(expand_v=0.3))
    with pytest.raises(UserError, match="unknown backend 'triton'"):
        FastWeightProgrammer(d_model=D_MODEL, n_heads=HEADS, options=FWPOptions(backend="triton"))
    with pytest.raises(UserError, match="unknown backend 'cuda'"):
        GatedDeltaNet(d_model=D_MODEL, n_heads=HEADS, options=GDNOptions(backend="cuda"))
