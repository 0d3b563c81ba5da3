import pytest
import torch

from fastweights.core.compare import relative_error


def test_relative_error_is_the_norm_of_the_difference_over_the_references_in_fp64():
    ref = torch.tensor([3.0, 4.0])
    assert relative_error(ref, ref) == 0.0
    assert abs(relative_error(torch.tensor([3.0, 4.5]), ref) - 0.1) < 1e-12
    assert relative_error(torch.tensor([4.0, 4.0]), ref) == relative_error(torch.tensor([3.0, 5.0]), ref)  # a norm
    assert relative_error(ref, torch.tensor([3.0, 4.5])) != 0.1  # divided by the reference's norm, not a's
    # fp64 inside: a difference fp32 would round away is seen
    big = torch.tensor([1e8], dtype=torch.float64)
    assert relative_error(big + 1, big) == 1e-8
    assert relative_error(torch.ones(2), torch.zeros(2)) > 1e20  # a zero reference: huge, not a division by zero
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    x = torch.ones(2, requires_grad=True)
    assert relative_error(x * 2, x) == 1.0  # tensors that need grad are detached, not an error


def test_the_relative_difference_is_relative_for_small_tensors_too():
    """A check on values of norm far below 1 (a small problem's gradients) must compare them to their own norm,
    not to 1: 2e-3 against 1e-3 is 100% off."""
    assert relative_error(torch.tensor([2e-3]), torch.tensor([1e-3])) == pytest.approx(1.0)
    assert relative_error(torch.tensor([1.0]), torch.tensor([0.0])) > 1e20  # against zero: far off, not a division error
