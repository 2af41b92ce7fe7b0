"""The gradients' maximum on a GPU (torch's multi-tensor inf-norm, the path the CPU never takes): exact, inf and NaN
propagated into the flag in both modes, and no synchronisation (the CPU path: tests/test_ops_overflow.py)."""

from __future__ import annotations

import pytest
import torch

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
