import pytest
import torch

from swarm.core.checks import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_finds_nan_and_infinities_anywhere(dtype):
    x = torch.randn(1000, dtype=torch.float32).to(dtype)
    assert all_finite(x)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 517, 999):
            y = x.clone()
            y[where] = bad
            assert not all_finite(y), (dtype, bad, where)


def test_all_finite_with_inf_and_minus_inf_whose_sum_is_nan():
    assert not all_finite(torch.tensor([float("inf"), float("-inf"), 1.0]))


def test_huge_finite_values_whose_sum_overflows_are_finite():
    x = torch.full((4,), 3e38)
    assert not torch.isfinite(x.sum())
    assert all_finite(x)


def test_integer_and_empty_tensors_are_finite():
    assert all_finite(torch.arange(10))
    assert all_finite(torch.empty(0))
