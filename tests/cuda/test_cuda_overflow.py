"""The gradients' maximum on a GPU (torch's multi-tensor inf-norm, the path the CPU never takes): exact, inf and NaN
propagated into the flag in both modes, and no synchronisation (the CPU path: tests/test_ops_overflow.py); with many
tensors the per-tensor results gathered by one copy (ops.clip.norms), for the maximum and the clip's norms."""

from __future__ import annotations

import pytest
import torch

from lossscale.ops.clip import MIN_COUNT, squared_norms
from lossscale.ops.overflow import check_with_amax_


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["inf_nan", "saturation"])
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan"), 65504.0, -70000.0])
def test_the_largest_magnitude_on_cuda_is_exact_and_is_the_check(dtype, mode, bad):
    torch.manual_seed(0)
    grads = [torch.randn(n, device="cuda", dtype=dtype) for n in (7, 1, 70_001, 128, 0)]
    if bad is not None:
        grads[2][12_345] = bad
    found = torch.zeros((), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    amax = check_with_amax_(grads, found, mode)
    torch.cuda.set_sync_debug_mode("default")
    expected = max(float(g.float().abs().max()) for g in grads if g.numel())
    if bad is not None and bad != bad:
        assert amax.isnan() and float(found) == 1.0
        return
    assert float(amax) == expected
    overflow = bad is not None and (abs(float(torch.tensor(bad, dtype=dtype))) == float("inf") or mode == "saturation")
    assert float(found) == float(overflow)


@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_with_many_tensors_the_gathered_maximum_and_norms_are_exact(bad):
    torch.manual_seed(0)
    grads = [torch.randn(n, device="cuda") for n in range(1, 4 * MIN_COUNT)]
    if bad is not None:
        grads[-3][1] = bad
    found = torch.zeros((), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    amax, norms = check_with_amax_(grads, found, "inf_nan"), squared_norms(grads)
    torch.cuda.set_sync_debug_mode("default")
    expected = torch.stack([g.abs().max() for g in grads]).max()
    assert torch.equal(amax.nan_to_num(), expected.nan_to_num()) and bool(amax.isnan()) == (bad != bad)
    assert float(found) == float(bad is not None)
    assert torch.equal(norms.nan_to_num(), torch.stack(torch._foreach_norm(grads)).square().nan_to_num())


def test_gathering_2000_norms_launches_a_few_multi_tensor_kernels_not_one_per_value():
    from torch.profiler import ProfilerActivity, profile

    from lossscale.ops.clip import norms

    tensors = [torch.randn(8, device="cuda") for _ in range(2000)]
    expected = torch.stack(torch._foreach_norm(tensors))
    assert torch.equal(norms(tensors), expected)  # the first call of this size makes the kept buffer
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        got = norms(tensors)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert torch.equal(got, expected)
    assert 1 <= len(kernels) <= 200, len(kernels)  # torch's multi-tensor norm and copy pack dozens of tensors a launch
