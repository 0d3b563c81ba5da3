"""Every registered component and the variants it declares (``test_variants``), built at the dimensions of the
registry-wide contracts (causality, pieces == one call, the device contract, the GPU check)."""

from __future__ import annotations

import torch

from fastweights import components as registry

D, HEADS, V, T, B = 12, 2, 9, 16, 2  # the registry-wide contracts' layer dimensions
# (kind, name) -> {variant id: options}, as the components declare them (``test_variants``)
VARIANTS = {(kind, e.name): registry.declared(e, "test_variants") for kind, e in registry.registered()}


def build_component(kind: str, name: str, raw: dict):
    """Component ``name`` with options ``raw`` at the contracts' dimensions, seed 0, fp64, eval mode; a
    ``persistence="official"`` memory keeps its initial tables as ``initial_tables``."""
    entry = registry.lookup(registry.KINDS[kind], kind, name)
    options = registry.build_options(entry, raw)
    torch.manual_seed(0)
    layer = registry.build(kind, entry, options, d_model=D, n_heads=HEADS, vocab_size=V).double().eval()
    if getattr(options, "persistence", None) == "official":
        layer.initial_tables = {k: t.clone() for k, t in layer.state_dict().items()}
    return layer
