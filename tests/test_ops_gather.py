"""ops.gather: torch.stack of 0-d tensors (``gathered``) and its maximum (``largest``) without a host op per tensor.
Values against torch.stack (the CPU made to take the kept-buffer path), results that later calls never overwrite,
and the ops dispatched per call counted on the meta device (where it runs as on a GPU): constant in the number of
values. On CUDA: tests/cuda/test_cuda_overflow.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from lossscale.ops import gather

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _host_ops import dispatched_ops


@pytest.fixture
def kept_on_cpu(monkeypatch):
    monkeypatch.setattr(gather, "STACK_ON", frozenset())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gathered_equals_stack_value_for_value_and_is_never_overwritten(kept_on_cpu, dtype):
    values = [torch.tensor(v, dtype=dtype) for v in [*range(40), math.inf, math.nan, -3.5]]
    first = gather.gathered(values)
    assert torch.equal(first.isnan(), torch.stack(values).isnan())
    assert torch.equal(first.nan_to_num(), torch.stack(values).nan_to_num()) and first.dtype == dtype
    second = gather.gathered([v * 2 for v in values])
    assert torch.equal(first.nan_to_num(), torch.stack(values).nan_to_num())  # the first result kept its values
    assert torch.equal(second.nan_to_num(), torch.stack([v * 2 for v in values]).nan_to_num())


@pytest.mark.parametrize("device, count", [("cpu", 100), ("meta", gather.MIN_COUNT - 1)])
def test_the_cpu_and_few_values_take_torch_stack(device, count):
    values = [torch.zeros((), device=device) for _ in range(count)]
    # aten.stack itself (its per-tensor work runs below the dispatch mode, where the profiler sees it)
    assert sum(dispatched_ops(lambda: gather.gathered(values)).values()) == 1


@pytest.mark.parametrize("count", [100, 2000])
def test_ops_per_call_do_not_grow_with_the_number_of_values(count):
    values = list(torch._foreach_norm([torch.empty(7, device="meta") for _ in range(count)]))
    gather.gathered(values)  # the first call of a size makes its buffer
    assert sum(dispatched_ops(lambda: gather.gathered(values)).values()) == 2  # one multi-tensor copy, one clone


@pytest.mark.parametrize("special, expected", [(None, 20.0), (math.inf, math.inf), (math.nan, math.nan)])
def test_largest_is_the_maximum_of_the_stack_and_keeps_earlier_results(kept_on_cpu, special, expected):
    values = [torch.tensor(float(v)) for v in [5, *range(-20, 21), 7, *([] if special is None else [special])]]
    first = gather.largest(values)
    assert torch.allclose(first, torch.stack(values).max(), rtol=0, atol=0, equal_nan=True)
    gather.largest([v - 100 for v in values])  # rewrites the kept buffer
    assert torch.allclose(first, torch.tensor(expected), rtol=0, atol=0, equal_nan=True)  # kept its value


@pytest.mark.parametrize("count", [100, 2000])
def test_largest_dispatches_a_copy_and_a_max_whatever_the_count(count):
    values = list(torch._foreach_norm([torch.empty(7, device="meta") for _ in range(count)]))
    gather.largest(values)
    assert dict(dispatched_ops(lambda: gather.largest(values))) == {"aten._foreach_copy_": 1, "aten.max": 1}
