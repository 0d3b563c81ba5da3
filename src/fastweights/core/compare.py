"""How far one tensor is from another, in one place for the self-checks, the benchmarks and the tests."""

from __future__ import annotations

import torch


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| (Frobenius norms), computed in fp64 on detached copies; ``ref`` of norm 0 counts as
    1e-30, so two zero tensors are 0 apart."""
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))
