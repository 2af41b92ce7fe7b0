"""lossscale.ops.clip in one process: squared norms against float64, the global norm, torch's clip coefficient and
Keras's per-tensor clip. Across ranks (FSDP2 shards): test_distributed.py."""

from __future__ import annotations

import math

import pytest
import torch

from lossscale.ops.clip import (
    clip_per_tensor_,
    global_clip_coefficient,
    global_norm_squared,
    squared_norms,
)


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


@pytest.mark.parametrize("norm", [0.0, 0.5, 1.0, 3.0, 1e30, math.inf])
def test_the_clip_coefficient_is_torchs_rule(norm):
    got = global_clip_coefficient(torch.tensor(norm), 1.0)
    assert got.shape == () and float(got) == pytest.approx(min(1.0, 1.0 / (norm + 1e-6)), rel=1e-6, abs=0)


def test_clip_per_tensor_clips_each_tensor_to_the_norm_and_keeps_the_order_over_mixed_dtypes():
    grads = [torch.full((4,), 3.0), torch.full((2,), 0.1, dtype=torch.float64), torch.full((9,), 1.0)]
    clip_per_tensor_(grads, 1.0)
    assert [float(g.norm()) for g in grads] == pytest.approx([1.0, 0.1 * math.sqrt(2), 1.0])
    assert grads[1].dtype == torch.float64 and torch.equal(grads[1], torch.full((2,), 0.1, dtype=torch.float64))
    same = [torch.full((4,), 3.0)]
    clip_per_tensor_(same, 1.0)
    assert torch.equal(same[0], torch.full((4,), 0.5))
