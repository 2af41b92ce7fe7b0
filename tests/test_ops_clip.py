"""lossscale.ops.clip in one process: the per-tensor norms as one vector without a host op per tensor (values against
torch.stack, the CPU made to take the kept-buffer path; results later calls never overwrite; the ops dispatched per
call counted on the meta device, where it runs as on a GPU), squared norms against float64, the global norm and
Keras's per-tensor clip. The clip coefficient: test_stages.py. Across ranks (FSDP2 shards): test_distributed.py. On
CUDA: tests/cuda/test_cuda_overflow.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from lossscale.ops import clip
from lossscale.ops.clip import clip_per_tensor_, global_norm_squared, norms, squared_norms

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _host_ops import dispatched_ops


@pytest.fixture
def kept_on_cpu(monkeypatch):
    monkeypatch.setattr(clip, "STACK_ON", frozenset())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ord", [2.0, math.inf])
def test_norms_equal_the_stack_value_for_value_and_are_never_overwritten(kept_on_cpu, dtype, ord):
    tensors = [torch.full((3,), float(v), dtype=dtype) for v in [*range(40), math.inf, math.nan, -3.5]]
    expected = torch.stack(torch._foreach_norm(tensors, ord))
    first = norms(tensors, ord)
    assert first.dtype == dtype and torch.equal(first.isnan(), expected.isnan())
    assert torch.equal(first.nan_to_num(), expected.nan_to_num())
    second = norms([t * 2 for t in tensors], ord)  # rewrites the kept buffer
    assert torch.equal(first.nan_to_num(), expected.nan_to_num())  # the first result kept its values
    assert torch.equal(
        second.nan_to_num(), torch.stack(torch._foreach_norm([t * 2 for t in tensors], ord)).nan_to_num()
    )
    assert norms(tensors, ord, torch.float32).dtype == torch.float32


@pytest.mark.parametrize("device, count", [("cpu", 100), ("meta", clip.MIN_COUNT - 1)])
def test_the_cpu_and_few_tensors_take_torch_stack(device, count):
    tensors = [torch.zeros(3, device=device) for _ in range(count)]
    ops = dispatched_ops(lambda: norms(tensors))
    assert ops.get("aten.stack") == 1 and "aten._foreach_copy_" not in ops


@pytest.mark.parametrize("count", [100, 2000])
def test_ops_per_call_do_not_grow_with_the_number_of_tensors(count):
    tensors = [torch.empty(7, device="meta") for _ in range(count)]
    norms(tensors)  # the first call of a size makes its buffer
    # the norm kernel, one multi-tensor copy, one clone
    assert dict(dispatched_ops(lambda: norms(tensors))) == {
        "aten._foreach_norm": 1,
        "aten._foreach_copy_": 1,
        "aten.clone": 1,
    }


def test_squared_norms_are_each_tensors_in_order_as_float64_gives_them():
    gen = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(70000, generator=gen),
        torch.randn(9, generator=gen),
        torch.randn(300, 400, generator=gen).t(),
        torch.randn(66000, generator=gen) * 1e3,
        torch.randn(5, generator=gen),
        torch.randn(300, 250, generator=gen),
    ]
    expected = [float(g.double().square().sum()) for g in grads]
    got = squared_norms(grads)
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx(expected, rel=2e-6)
    assert squared_norms([]).shape == (0,)


def test_global_norm_squared_is_torchs_norm_squared():
    gen = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(5, 3, generator=gen),
        torch.randn(7, generator=gen).double(),
        torch.randn(4, 4, generator=gen).t(),
    ]
    expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1).double() for g in grads])) ** 2
    for sharded in (None, False, True):  # outside torch.distributed a "shard" is the whole tensor
        got = global_norm_squared(grads, sharded=sharded)
        assert got.dtype == torch.float32 and got.shape == ()
        assert float(got) == pytest.approx(float(expected), rel=1e-6)
    assert float(global_norm_squared([])) == 0.0
    assert math.isinf(float(global_norm_squared([torch.tensor([1.0, math.inf])])))


def test_clip_per_tensor_clips_each_tensor_to_the_norm_and_keeps_the_order_over_mixed_dtypes():
    grads = [torch.full((4,), 3.0), torch.full((2,), 0.1, dtype=torch.float64), torch.full((9,), 1.0)]
    clip_per_tensor_(grads, 1.0)
    assert [float(g.norm()) for g in grads] == pytest.approx([1.0, 0.1 * math.sqrt(2), 1.0])
    assert grads[1].dtype == torch.float64 and torch.equal(grads[1], torch.full((2,), 0.1, dtype=torch.float64))
    same = [torch.full((4,), 3.0)]
    clip_per_tensor_(same, 1.0)
    assert torch.equal(same[0], torch.full((4,), 0.5))
