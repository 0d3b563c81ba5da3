"""Feature maps phi for fast weight programmers / linear attention, and sum normalisation.

A fast weight programmer reads and writes its fast weight through a feature map
phi: R^{d_k} -> R^{d_dot}; the sum rule can store at most d_dot orthogonal associations, so the
choice of phi sets the memory capacity (Schlag, Irie, Schmidhuber 2021, "Linear Transformers Are
Secretly Fast Weight Programmers", arXiv 2102.11174, sections 4-5).

    ELU+1 (Katharopoulos et al. 2020, arXiv 2006.16236):
        phi(x) = elu(x) + 1 > 0,                                         d_dot = d_k
    DPFP-nu (Schlag et al. 2021, eq. 37 and Listing 1 of appendix C), r = ReLU:
        x~ = [r(x), r(-x)] in R^{2 d_k}
        phi(x)_{(j-1) 2 d_k + i} = x~_i * x~_{(i - j) mod 2 d_k},  j = 1..nu,  d_dot = 2 d_k nu
    FAVOR+ (Choromanski et al. 2021, "Performers", arXiv 2009.14794), omega_1..omega_m orthogonal
    random features with Gaussian-like norms:
        phi(x) = exp(-|x|^2 / 2) / sqrt(2m) * [exp(omega_i^T x)]_i ++ [exp(-omega_i^T x)]_i,  d_dot = 2m
        so that E[phi(x)^T phi(y)] = exp(x^T y).
    Sum normalisation (Schlag et al. 2021, section 4.2 and appendix A.2):
        phi(x) <- phi(x) / sum_l phi(x)_l
      balances the positive and negative terms of a delta-rule write; for phi >= 0 it gives
      |phi|_2 <= 1, so the delta recurrence (I - beta phi phi^T) cannot blow up.

Project deviations, each documented where it happens:
  * sum_normalize divides by max(sum, eps) (default eps = 1e-12); the reference code has no eps and
    DPFP sums to exactly 0 at x = 0.
  * FAVOR+ is evaluated in log space (as ischlag/fast-weight-transformers does) and adds no 1e-4
    (lmtool-fwp's performer_helper does); the random matrix is an argument, so redraw policy
    belongs to the caller (the layer keeps it as a buffer, frozen at evaluation).

flash-linear-attention's ``DPFPFeatureMap`` concatenates [relu(x), -relu(x)] and can be negative; it
is not this map and must not be used as a reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fastweights.core.errors import UserError

FEATURE_MAPS = ("elu1", "dpfp", "favor", "identity")


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """ELU+1 feature map, ``[..., d] -> [..., d]``, strictly positive."""
    return F.elu(x, alpha=1.0) + 1.0


def dpfp(x: torch.Tensor, nu: int = 1) -> torch.Tensor:
    """Deterministic parameter-free projection DPFP-nu, ``[..., d] -> [..., 2 * d * nu]``.

    Exactly the paper's Listing 1 (element order included, so checkpoints stay compatible):
    element ``(j-1) * 2d + i`` is ``x~_i * x~_{(i-j) mod 2d}`` with ``x~ = [relu(x), relu(-x)]``.
    The result is non-negative. ``nu`` is 1, 2 or 3 in the paper (lmtool's default is 2).
    """
    if nu < 1:
        raise UserError(f"dpfp: nu must be >= 1, got {nu}")
    x = torch.cat([F.relu(x), F.relu(-x)], dim=-1)  # [..., 2d]
    # roll(shifts=j) moves element i to i + j, so rolled[i] = x[(i - j) mod 2d], as in Listing 1.
    x_rolled = torch.cat([x.roll(shifts=j, dims=-1) for j in range(1, nu + 1)], dim=-1)  # [..., 2d*nu]
    x_repeat = torch.cat([x] * nu, dim=-1)  # [..., 2d*nu]
    return x_repeat * x_rolled


def orthogonal_random_features(
    d: int, m: int, *, generator: torch.Generator | None = None, device=None, dtype=torch.float32
) -> torch.Tensor:
    """Random projection ``Omega [d, m]`` for FAVOR+.

    Columns come in blocks of ``d`` that are mutually orthogonal (QR of a Gaussian ``d x d`` matrix);
    each column is rescaled to the norm of an independent ``N(0, I_d)`` vector, so that marginally
    every column is distributed like a Gaussian vector (Performers, section 2.4).
    """
    if d < 1 or m < 1:
        raise UserError(f"orthogonal_random_features: need d >= 1 and m >= 1, got d={d}, m={m}")
    n_blocks = -(-m // d)
    gaussian = torch.randn(n_blocks, d, d, generator=generator, dtype=torch.float64)
    q, _ = torch.linalg.qr(gaussian)  # [n_blocks, d, d], orthonormal columns in each block
    norms = torch.randn(n_blocks, d, d, generator=generator, dtype=torch.float64).norm(dim=1)  # chi_d, [n_blocks, d]
    omega = (q * norms[:, None, :]).transpose(0, 1).reshape(d, n_blocks * d)[:, :m]  # [d, m], block after block
    return omega.to(device=device, dtype=dtype)


def favor_plus(x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """FAVOR+ positive random features, ``x [..., d]``, ``omega [d, m]`` -> ``[..., 2m]``.

    ``phi(x) = exp(-|x|^2/2) / sqrt(2m) * [exp(omega^T x), exp(-omega^T x)]``, computed in log space
    (the offset ``|x|^2/2 + log(m)/2 + log(2)/2`` is subtracted inside the exponential).
    """
    if x.shape[-1] != omega.shape[0]:
        raise UserError(f"favor_plus: x has last dim {x.shape[-1]} but omega has {omega.shape[0]} rows")
    m = omega.shape[1]
    u = x @ omega.to(x.dtype)  # [..., m]
    offset = 0.5 * x.pow(2).sum(-1, keepdim=True) + 0.5 * math.log(m) + 0.5 * math.log(2.0)  # [..., 1]
    return torch.cat([torch.exp(u - offset), torch.exp(-u - offset)], dim=-1)  # [..., 2m]


def sum_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Sum normalisation ``x / max(sum(x), eps)`` over the last dim (for non-negative ``x``).

    The eps is a project deviation from the paper's code (which has none): DPFP gives an all-zero
    vector at x = 0, which would otherwise divide 0 by 0.
    """
    return x / x.sum(dim=-1, keepdim=True).clamp_min(eps)


def feature_dim(name: str, d: int, *, nu: int = 1, n_features: int = 16) -> int:
    """Width ``d_dot`` of feature map ``name`` applied to ``d``-dimensional inputs."""
    if name in ("elu1", "identity"):
        return d
    if name == "dpfp":
        if not 1 <= nu <= 2 * d - 1:  # the rolls of the 2d-wide vector repeat past 2d - 1 (issue 52: nu 1e9)
            raise UserError(f"dpfp: nu must be in 1..{2 * d - 1} (2 x {d} - 1) for {d}-dimensional inputs, got {nu}")
        return 2 * d * nu
    if name == "favor":
        return 2 * n_features
    raise UserError(f"unknown feature map {name!r}; choose one of {', '.join(FEATURE_MAPS)}")


def apply_feature_map(
    name: str, x: torch.Tensor, *, nu: int = 1, omega: torch.Tensor | None = None
) -> torch.Tensor:
    """Apply feature map ``name`` ("elu1" | "dpfp" | "favor" | "identity") to ``x [..., d]``.

    ``nu`` is DPFP's order; ``omega [d, m]`` is FAVOR+'s projection (required for "favor").
    """
    if name == "elu1":
        return elu_plus_one(x)
    if name == "dpfp":
        return dpfp(x, nu)
    if name == "favor":
        if omega is None:
            raise UserError("feature map 'favor' needs a random projection omega")
        return favor_plus(x, omega)
    if name == "identity":
        return x
    raise UserError(f"unknown feature map {name!r}; choose one of {', '.join(FEATURE_MAPS)}")
