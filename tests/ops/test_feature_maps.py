"""Feature maps of fastweights.ops.feature_maps against their definitions (Schlag et al. 2021, App. C)."""

import math

import pytest
import torch

from fastweights.core.errors import UserError
from fastweights.ops.feature_maps import (
    apply_feature_map,
    dpfp,
    elu_plus_one,
    favor_plus,
    feature_dim,
    orthogonal_random_features,
    sum_normalize,
)


def test_elu_plus_one_positive_and_matches_definition():
    x = torch.linspace(-20, 5, 101, dtype=torch.float64)
    y = elu_plus_one(x)
    assert (y > 0).all()
    expected = torch.where(x > 0, x + 1, torch.exp(x))
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("nu", [1, 2, 3])
def test_dpfp_width_sign_and_listing1_order(nu):
    d = 5
    x = torch.randn(3, d, dtype=torch.float64)
    y = dpfp(x, nu)
    assert y.shape == (3, 2 * d * nu)
    assert (y >= 0).all()
    # Element (j-1)*2d + i equals x~_i * x~_{(i-j) mod 2d}, x~ = [relu(x), relu(-x)] (Listing 1).
    xt = torch.cat([x.clamp_min(0), (-x).clamp_min(0)], dim=-1)
    for j in range(1, nu + 1):
        for i in range(2 * d):
            torch.testing.assert_close(y[:, (j - 1) * 2 * d + i], xt[:, i] * xt[:, (i - j) % (2 * d)])


def test_dpfp_is_not_flas_signed_variant():
    # fla's DPFPFeatureMap uses [relu(x), -relu(x)] and can be negative; ours never is.
    x = -torch.ones(1, 4)
    assert (dpfp(x, 1) >= 0).all() and dpfp(x, 1).sum() > 0


def test_dpfp_rejects_bad_nu():
    with pytest.raises(UserError):
        dpfp(torch.randn(2, 3), 0)


def test_sum_normalize_sums_to_one_and_survives_zero():
    x = dpfp(torch.randn(4, 6), 2)
    torch.testing.assert_close(sum_normalize(x).sum(-1), torch.ones(4))
    zero = sum_normalize(dpfp(torch.zeros(1, 6), 1))
    assert torch.isfinite(zero).all() and (zero == 0).all()
    # |phi|_2 <= 1 after sum normalisation of a non-negative map (keeps the delta rule stable).
    assert (sum_normalize(x).norm(dim=-1) <= 1 + 1e-6).all()


def test_orthogonal_random_features_blocks_are_orthogonal():
    g = torch.Generator().manual_seed(0)
    omega = orthogonal_random_features(8, 20, generator=g, dtype=torch.float64)
    assert omega.shape == (8, 20)
    for start in (0, 8):  # full blocks of 8 columns are mutually orthogonal
        block = omega[:, start : start + 8]
        gram = block.T @ block
        off = gram - torch.diag(torch.diag(gram))
        assert off.abs().max() < 1e-10
    # column norms are chi_d distributed, not all equal to 1
    assert omega.norm(dim=0).std() > 0.05


def test_favor_plus_estimates_exp_dot_product():
    g = torch.Generator().manual_seed(1)
    d, m = 4, 4096
    x = torch.randn(6, d, generator=g, dtype=torch.float64) * 0.4
    y = torch.randn(6, d, generator=g, dtype=torch.float64) * 0.4
    estimates = []
    for _ in range(4):  # average a few independent draws: E[phi(x)^T phi(y)] = exp(x^T y)
        omega = orthogonal_random_features(d, m, generator=g, dtype=torch.float64)
        estimates.append((favor_plus(x, omega) * favor_plus(y, omega)).sum(-1))
    est = torch.stack(estimates).mean(0)
    exact = torch.exp((x * y).sum(-1))
    assert ((est - exact).abs() / exact).max() < 0.05
    assert (favor_plus(x, omega) > 0).all()


def test_favor_plus_log_space_matches_direct_formula():
    omega = orthogonal_random_features(3, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64)
    u = x @ omega
    direct = torch.exp(-(x * x).sum(-1, keepdim=True) / 2) / math.sqrt(2 * 5) * torch.cat([u.exp(), (-u).exp()], -1)
    torch.testing.assert_close(favor_plus(x, omega), direct)


def test_feature_dim_and_dispatch():
    x = torch.randn(2, 8)
    omega = orthogonal_random_features(8, 16)
    for name, kwargs in (("elu1", {}), ("dpfp", {"nu": 3}), ("favor", {"omega": omega}), ("identity", {})):
        y = apply_feature_map(name, x, **kwargs)
        assert y.shape[-1] == feature_dim(name, 8, nu=kwargs.get("nu", 1), n_features=16)
    with pytest.raises(UserError):
        apply_feature_map("favor", x)
    with pytest.raises(UserError):
        feature_dim("softmax", 8)
