"""lossscale.ops.amax_kernel (Triton) on a GPU: the largest magnitude over many tensors equal, bit for bit, to torch's
multi-tensor inf-norm's, inf and NaN anywhere included, in float32, float16 and bfloat16, at chunk edges and past
2**31 values; the path largest_magnitude takes on CUDA, with the same host ops whatever the number of tensors and no
synchronisation; and torch's inf-norm where the kernel does not take the tensors. Skipped where triton is missing
(it comes with torch's CUDA builds)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # as conftest.py's reason, which comes too late for the import below
    pytest.skip(
        f"needs a CUDA device: torch.cuda.is_available() is False on this machine (torch {torch.__version__}); "
        f"run on a machine with an NVIDIA GPU (benchmarks/gpu_check.sh)",
        allow_module_level=True,
    )
pytest.importorskip("triton", reason="lossscale.ops.amax_kernel needs triton, which this CUDA machine lacks")

from lossscale.ops import amax_kernel
from lossscale.ops.gather import largest
from lossscale.ops.overflow import largest_magnitude

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _host_ops import dispatched_ops

C = amax_kernel.CHUNK
SIZES = (1, 7, 1023, 1024, 1025, C - 1, C, C + 1, 3 * C + 17, 0, *range(1, 300, 7))


def inf_norm(tensors):
    """torch's answer: the multi-tensor inf-norm, reduced."""
    return largest(torch._foreach_norm([t for t in tensors if t.numel()], ord=math.inf)).float()


def tensors(dtype, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [(torch.randn(n, device="cuda", generator=g) * scale).to(dtype) for n in SIZES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", ["first value", "last value", "a chunk's first value"])
def test_the_kernel_equals_torch_s_inf_norm_bit_for_bit(dtype, bad, where):
    ts = tensors(dtype, scale=100.0)
    if bad is not None:
        index, position = {"first value": (0, 0), "last value": (8, 3 * C + 16), "a chunk's first value": (7, C)}[where]
        ts[index][position] = bad
    got = amax_kernel.amax(ts)
    torch.testing.assert_close(got, inf_norm(ts), rtol=0, atol=0, equal_nan=True)
    assert got.dtype == torch.float32 and got.shape == ()
    if bad is not None:
        assert math.isnan(float(got)) if bad != bad else float(got) == math.inf


def test_all_zero_tensors_give_zero():
    assert float(amax_kernel.amax([torch.zeros(n, device="cuda") for n in (3, C + 5)])) == 0.0


def test_largest_magnitude_takes_the_kernel_with_the_same_host_ops_for_10_or_300_tensors_and_no_sync():
    few, many = tensors(torch.float32)[:10], tensors(torch.float32) * 6
    largest_magnitude(few), largest_magnitude(many)  # the first call compiles the kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    ops_few, ops_many = dispatched_ops(lambda: largest_magnitude(few)), dispatched_ops(lambda: largest_magnitude(many))
    torch.cuda.set_sync_debug_mode("default")
    assert "_foreach_norm" not in ops_many, ops_many
    assert ops_few == ops_many, (ops_few, ops_many)
    assert torch.equal(largest_magnitude(many), inf_norm(many))


def test_tensors_the_kernel_does_not_take_are_read_by_torch_s_inf_norm():
    ts = tensors(torch.float32)
    transposed = ts[:-1] + [torch.randn(40, 30, device="cuda").t()]
    assert amax_kernel.amax(transposed) is None
    assert torch.equal(largest_magnitude(transposed), inf_norm(transposed))
    doubles = [t.double() for t in ts]
    assert amax_kernel.amax(doubles) is None
    assert float(largest_magnitude(doubles)) == float(inf_norm(doubles))


def test_a_tensor_of_more_than_2_31_values():
    big = torch.zeros(2**31 + 5, dtype=torch.float16, device="cuda")
    big[-1] = -3.0
    assert float(amax_kernel.amax([torch.ones(3, device="cuda", dtype=torch.float16), big])) == 3.0
    del big
    torch.cuda.empty_cache()


def test_a_kernel_that_fails_at_its_first_launch_names_the_switch_and_later_errors_pass_through(monkeypatch):
    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise ValueError("no C compiler")

            return launch

    monkeypatch.setattr(amax_kernel, "_amax_kernel", Broken())
    monkeypatch.setattr(amax_kernel, "_LAUNCHED", set())
    ts = tensors(torch.float16)
    with pytest.raises(
        RuntimeError,
        match=r"kernel for torch.float16 failed at its first launch on cuda.*"
        r"ValueError: no C compiler.*LOSSSCALE_TRITON=0",
    ) as info:
        amax_kernel.amax(ts)
    assert isinstance(info.value.__cause__, ValueError)
    amax_kernel._LAUNCHED.add(torch.float16)  # as after a launch that worked: its later errors are not set-up ones
    with pytest.raises(ValueError, match="no C compiler"):
        amax_kernel.amax(ts)
