"""Every registered component as an accelerator would run it, checked on a CPU-only machine (issue 20, scope 1).

No GPU is lent to this project, so two stand-ins:

* forward and backward on the ``meta`` device (shapes and dtypes only, no data): a tensor created without
  the input's device, an autocast context opened for a fixed device type, or a host sync (``.item()``, an
  op whose output size depends on the data, such as ``torch.unique``) fails there as it would fail or
  stall on CUDA;
* three training steps under CPU bf16 autocast with fp32 parameters: finite, the loss within 5% of the
  same steps in fp32, and the fast-weight state (what the component learns while it reads) kept in fp32.
  Caches of activations (a KV cache, a convolution's last inputs) may follow the compute dtype.

The components and their variants are those of ``fastweights.testing.registry_cases.VARIANTS``, the variants
every registered component declares, so a new component is covered here without an edit; the state fields that
may follow the compute dtype are what it declares as ``compute_dtype_state``. The construction, the calls and the
training steps are ``fastweights.testing.device_contract``'s, which ``benchmarks/gpu/cuda_check.py`` runs on a GPU.
"""

import pytest
import torch

from fastweights.testing.device_contract import build, call, compute_dtype_state, state_leaves, train
from fastweights.testing.registry_cases import B, D, T
from helpers import variant_cases

# components whose meta run is known to fail, with the reason; strict, so a fix turns the test red until
# the entry is removed (FwPKM's write left this list with issue 34: its shapes no longer depend on the data)
META_KNOWN: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize("kind,name,raw", list(variant_cases(META_KNOWN)))
def test_forward_backward_on_the_meta_device(kind, name, raw):
    with torch.device("meta"):
        layer = build(kind, name, raw)
    x = torch.empty(B, T, D, device="meta", requires_grad=True)
    tokens = torch.empty(B, T, dtype=torch.long, device="meta")
    y, state = call(layer, kind, x, tokens)
    y2, _ = call(layer, kind, x, tokens, state)  # a second piece, reading the carried state
    assert y.device.type == "meta" and y.shape[:2] == (B, T)
    (y.float().sum() + y2.float().sum()).backward()
    assert x.grad is not None and x.grad.shape == x.shape
    for where, leaf in state_leaves(state):
        assert leaf.device.type == "meta", f"state {where} was created on {leaf.device}"


@pytest.mark.parametrize("kind,name,raw", list(variant_cases()))
def test_bf16_autocast_trains_with_fp32_fast_weights(kind, name, raw):
    fp32, _, _ = train(kind, name, raw, bf16=False)
    bf16, state, layer = train(kind, name, raw, bf16=True)
    assert all(torch.isfinite(torch.tensor(bf16))), bf16
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in layer.parameters())
    for a, b in zip(fp32, bf16):  # bf16 keeps 8 bits of mantissa: a few 1e-3 relative per step here
        assert abs(a - b) <= 0.05 * abs(a), (fp32, bf16)
    allowed = compute_dtype_state(kind, name)
    for where, leaf in state_leaves(state):
        if leaf.is_floating_point() and not ("" in allowed or where in allowed):
            assert leaf.dtype == torch.float32, f"{kind} {name}: state {where!r} is {leaf.dtype} under bf16 autocast"


def test_the_contracts_build_each_variant_with_its_own_options():
    """``build`` makes the component with the variant's options (not its defaults): two variants of one
    component whose options differ build layers whose options differ the same way, in fp32."""
    from fastweights import components as registry
    from fastweights.testing.registry_cases import VARIANTS

    checked = 0
    for (kind, name), variants in VARIANTS.items():
        entry = registry.lookup(registry.KINDS[kind], kind, name)
        for raw in variants.values():
            want = registry.build_options(entry, raw)
            if not raw or want == registry.build_options(entry, {}):
                continue  # the defaults: nothing to tell apart
            layer = build(kind, name, raw)
            if getattr(layer, "options", None) is not None:
                assert layer.options == want, (kind, name, raw)
                checked += 1
            assert all(p.dtype == torch.float32 for p in layer.parameters())
    assert checked >= 5
