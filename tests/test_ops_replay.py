"""lossscale.ops.replay.ReplayedRead's rule, on the CPU with a stand-in for the CUDA graph that, like a graph, reads
the tensors it was captured with: eager at a first sighting, captured at the next, replayed after that;
a tensor moved or resized, a non-contiguous tensor, an evicted graph or a spent capture budget run eagerly; a result
returned is never written again. The CUDA graph itself is tested in tests/cuda/test_cuda_replayed_read.py."""

from __future__ import annotations

import pytest
import torch

from lossscale.ops.overflow import _largest_by_norm
from lossscale.ops.replay import ReplayedRead


def graph_stand_in(read, tensors):
    """What a CUDA graph of ``read`` does: each replay reads the memory of the tensors captured, into one output."""
    captured = list(tensors)
    output = read(captured)

    def replay():
        output.copy_(read(captured))

    return replay, output


def replayed(**kwargs) -> ReplayedRead:
    return ReplayedRead(_largest_by_norm, capture=graph_stand_in, devices=("cpu",), **kwargs)


def oracle(tensors) -> float:
    return max(float(t.abs().max()) for t in tensors)


def tensors(n: int = 20, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1 + i % 5, 3, generator=g) for i in range(n)]


def test_eager_then_captured_then_replayed_following_the_values_in_place():
    read, ts = replayed(), tensors()
    results = []
    for step in range(6):
        for t in ts:
            t.normal_(std=1.0 + step)
        results.append((read(ts), oracle(ts)))
    assert read.counts == {"eager": 1, "captured": 1, "replayed": 4}
    assert all(float(result) == value for result, value in results)  # each result keeps its value
    assert len({value for _, value in results}) == 6


def test_inf_and_nan_come_through_a_replay():
    read, ts = replayed(), tensors()
    read(ts), read(ts)
    ts[3][0, 0] = float("inf")
    assert float(read(ts)) == float("inf")
    ts[7][0, 1] = float("nan")
    assert torch.isnan(read(ts))
    assert read.counts["replayed"] == 2


def test_a_tensor_moved_or_resized_is_read_eagerly_then_captured_again():
    read, ts = replayed(), tensors()
    read(ts), read(ts)
    moved = ts[:5] + [ts[5].clone() * 100] + ts[6:]  # new memory: the graph would read the old tensor
    assert float(read(moved)) == oracle(moved)
    ts[-1][-1, 0] = 1000.0
    resized = ts[:-1] + [ts[-1][:1]]  # same address, fewer values: not the 1000 the graph would read
    assert float(read(resized)) == oracle(resized) < 1000.0
    assert read.counts == {"eager": 3, "captured": 1, "replayed": 0}
    assert float(read(resized)) == oracle(resized) and read.counts["captured"] == 2


def test_non_contiguous_tensors_and_other_devices_are_always_read_eagerly():
    read, ts = replayed(), tensors()
    strided = ts[:-1] + [torch.randn(4, 6)[:, ::2]]
    for _ in range(4):
        assert float(read(strided)) == oracle(strided)
    cuda_only = ReplayedRead(_largest_by_norm, capture=graph_stand_in)  # devices=("cuda",), these are on the CPU
    for _ in range(4):
        cuda_only(ts)
    assert read.counts == cuda_only.counts == {"eager": 4, "captured": 0, "replayed": 0}


def test_the_least_recently_used_graph_is_dropped_beyond_max_graphs():
    read = replayed(max_graphs=2)
    a, b, c = tensors(seed=0), tensors(seed=1), tensors(seed=2)
    for ts in (a, a, b, b, c, c):
        read(ts)
    assert read.counts["captured"] == 3
    assert float(read(b)) == oracle(b) and read.counts["replayed"] == 1
    assert float(read(a)) == oracle(a) and read.counts["replayed"] == 1  # a's graph went first


def test_sets_of_tensors_read_in_turn_are_each_replayed():
    read = replayed()
    a, b = tensors(seed=0), tensors(seed=1)
    for ts in (a, b, a, b, a, b, a, b):
        assert float(read(ts)) == oracle(ts)
    assert read.counts == {"eager": 2, "captured": 2, "replayed": 4}


def test_after_max_captures_in_a_row_new_sets_stay_eager_until_a_replay():
    read = replayed(max_captures=1)
    a, b = tensors(seed=0), tensors(seed=1)
    for ts in (a, a, b, b, b):
        assert float(read(ts)) == oracle(ts)
    assert read.counts == {"eager": 4, "captured": 1, "replayed": 0}
    for ts in (a, b, b):  # a's replay allows a capture again
        assert float(read(ts)) == oracle(ts)
    assert read.counts == {"eager": 4, "captured": 2, "replayed": 2}


@pytest.mark.parametrize("name,value", [("max_graphs", 0), ("max_graphs", 2.0), ("max_captures", -1),
                                        ("max_captures", True)])
def test_bad_limits_are_refused_with_the_parameter_named(name, value):
    with pytest.raises(ValueError, match=f"ReplayedRead\\({name}={value!r}\\): {name} must be an int"):
        ReplayedRead(_largest_by_norm, **{name: value})
