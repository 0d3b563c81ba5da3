"""A registered component as an accelerator runs it: built in fp32, called twice (the second call reading the
state the first returned), three Adam steps with or without bf16 autocast. ``tests/contracts/test_device_contract.py``
runs these on the CPU (and the meta device), ``benchmarks/gpu/cuda_check.py`` on a GPU against the CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

from fastweights import components as registry
from fastweights.testing.registry_cases import B, D, T, V, build_component


def compute_dtype_state(kind: str, name: str) -> tuple[str, ...]:
    """State fields that may be kept in the compute dtype under autocast: caches of activations, not fast
    weights ("" = the whole state), as the component declares them."""
    return registry.declared(registry.lookup(registry.KINDS[kind], kind, name), "compute_dtype_state")


def build(kind, name, raw):
    """The registry contracts' construction (same options handling and seed), with fp32 parameters."""
    return build_component(kind, name, raw).float()


def call(layer, kind, x, tokens, state=None):
    return layer(x, tokens, state) if kind == "head" else layer(x, state)


def state_leaves(state):
    """(top-level field, tensor) pairs of a state: a dict's keys name its fields, other states are one field."""
    parts = state.items() if isinstance(state, dict) else [("", state)]
    return [(k, t) for k, part in parts for t in tree_leaves(part) if isinstance(t, torch.Tensor)]


def train(kind, name, raw, bf16: bool, device: torch.device = torch.device("cpu")):
    """Three Adam steps of one component on ``device``: (the losses, the last state, the layer)."""
    layer = build(kind, name, raw).to(device)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, D, generator=g).to(device)
    tokens = torch.randint(0, V, (B, T), generator=g).to(device)
    losses = []
    for _ in range(3):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            y, state = call(layer, kind, x, tokens)
            if kind == "head":
                loss = F.cross_entropy(y.float().flatten(0, 1), tokens.flatten())
            else:
                loss = (y.float() - x).pow(2).mean()
            aux = getattr(layer, "aux_loss", None)
            if aux is not None:
                loss = loss + aux
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, state, layer
