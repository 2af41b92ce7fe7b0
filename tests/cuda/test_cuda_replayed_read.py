"""PredictiveScale's read of amax replayed from a CUDA graph keyed by the gradients' memory
(lossscale.ops.replay.ReplayedRead): the eager read's value bit for bit as the values change in place, inf and NaN
included, and earlier results kept; a replay dispatches no op per tensor; and in a training loop that frees its
gradients at every zero_grad() the gradients come back at the same addresses, so the read is replayed, with the
same parameters and scales, bit for bit, as PredictiveScale(cuda_graph=False)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lossscale import LossScaleOptimizer, PredictiveScale
from lossscale.ops.overflow import REPLAYED_LARGEST, _largest_by_norm
from lossscale.ops.replay import ReplayedRead

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _host_ops import dispatched_ops  # noqa: E402


def _grads(n: int = 300) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(1 + (i * 37) % 4000, device="cuda", generator=g) for i in range(n)]


def test_a_replayed_read_equals_the_eager_read_bit_for_bit_as_the_values_change_in_place():
    read, grads = ReplayedRead(_largest_by_norm), _grads()
    results = []
    for step in range(8):
        torch._foreach_mul_(grads, 1.5)
        if step == 5:
            grads[17][3] = float("inf")
        if step == 6:
            grads[17][3] = 0.0
            grads[200][0] = float("nan")
        results.append((read(grads), _largest_by_norm(grads).clone()))
    assert read.counts == {"eager": 1, "captured": 1, "replayed": 6}
    for got, want in results:  # each result keeps the value it was returned with
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert float(results[5][0]) == float("inf") and torch.isnan(results[6][0])
    assert len({float(got) for got, _ in results[:5]}) == 5


def test_a_replay_dispatches_no_op_per_tensor():
    read, grads = ReplayedRead(_largest_by_norm), _grads()
    read(grads), read(grads)
    ops = dispatched_ops(lambda: read(grads))
    assert read.counts["replayed"] == 1
    assert sum(ops.values()) <= 3, ops  # the copy of the output; the eager read hands 300 tensors to its kernels


def _train(cuda_graph: bool, steps: int = 10) -> tuple[list[torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(12)]).cuda()
    opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
                             policy=PredictiveScale(cuda_graph=cuda_graph))
    x = torch.randn(64, 128, device="cuda")
    scales = []
    for step in range(steps):
        opt.zero_grad()  # set_to_none: the gradients are freed and made again by the backward
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        opt.backward(loss * (float("inf") if step == 6 else 1.0))
        scales.append(opt.step().scale)
    return [p.detach().clone() for p in model.parameters()], [float(s) for s in scales]


def test_a_training_loop_replays_the_read_with_the_eager_read_s_trajectory_bit_for_bit():
    before = dict(REPLAYED_LARGEST.counts)
    params, scales = _train(cuda_graph=True)
    counts = {name: REPLAYED_LARGEST.counts[name] - before[name] for name in before}
    eager_params, eager_scales = _train(cuda_graph=False)
    assert {name: REPLAYED_LARGEST.counts[name] - before[name] for name in before} == counts  # False: not used
    assert counts["replayed"] >= 5, counts  # the gradients came back at the same addresses
    assert scales == eager_scales and len(set(scales)) > 1, scales  # the inf at step 6 backed the scale off
    assert all(torch.equal(p, q) for p, q in zip(params, eager_params))
