"""PredictiveScale's update replayed from a CUDA graph (lossscale.state.ReplayedUpdate): the same states as its ops
run one by one, bit for bit, over a stream with overflows, NaN and non-finite losses; no host sync from the first
update on, and a handful of host ops per update where the rule is about 80; a step of the caller's captured in a
graph of its own (the state advanced in place by each replay) is read as it is at the next eager update."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import torch

from lossscale import LossScale, LossScaleOptimizer, PredictiveScale

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _host_ops import dispatched_ops

SYNC_WARNING = "called a synchronizing CUDA operation"


def _stream(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(found_inf, amax, loss_finite) per step, on the GPU: amax near 2**14 with a spread, overflows, NaN, a
    non-finite loss now and then."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for step in range(steps):
        amax = torch.exp2(14 + 3 * torch.randn((), generator=g, device="cuda"))
        found = amax >= 65504.0
        if step % 23 == 7:
            amax, found = torch.full((), math.nan, device="cuda"), torch.ones((), dtype=torch.bool, device="cuda")
        out.append((found, amax, torch.rand((), generator=g, device="cuda") > 0.03))
    return out


def test_the_replayed_update_follows_the_rule_run_op_by_op_bit_for_bit():
    replayed = LossScale(PredictiveScale(init_scale=2.0**16), "cuda")
    eager = LossScale(PredictiveScale(init_scale=2.0**16, cuda_graph=False), "cuda")
    scales = []
    for found, amax, loss_finite in _stream(300):
        for owner in (replayed, eager):
            owner.update(found, amax, loss_finite)
        scales.append((replayed.scale, float(replayed.scale)))
        assert replayed.state_dict() == eager.state_dict()
    assert replayed._replay is not None and replayed._replay._graph is not None and eager._replay is None
    assert len({value for _, value in scales}) > 3  # the stream moved the scale
    assert all(float(tensor) == value for tensor, value in scales)  # a scale read earlier keeps its value


def test_an_update_makes_no_host_sync_from_the_first_and_a_handful_of_ops_where_the_rule_makes_eighty():
    found, amax, loss_finite = _stream(1)[0]
    owner, eager = LossScale(PredictiveScale(), "cuda"), LossScale(PredictiveScale(cuda_graph=False), "cuda")
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(5):  # the first captures the graph
                owner.update(found, amax, loss_finite)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert [str(w.message) for w in caught if SYNC_WARNING in str(w.message)] == []
    replayed_ops = sum(dispatched_ops(lambda: owner.update(found, amax, loss_finite)).values())
    eager_ops = sum(dispatched_ops(lambda: eager.update(found, amax, loss_finite)).values())
    assert replayed_ops <= 10 and eager_ops >= 60, (replayed_ops, eager_ops)


def test_a_loss_scale_optimizer_with_predictive_scale_makes_no_host_sync_per_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
    opt = LossScaleOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        policy=PredictiveScale(init_scale=2.0**10),
        clip_grad_norm=1.0,
    )
    x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for step in range(6):
                with torch.autocast("cuda", dtype=torch.float16):
                    out = model(x)
                opt.backward(torch.nn.functional.mse_loss(out.float(), y))
                if step == 3:
                    model[2].weight.grad[0, 0].fill_(math.inf)
                opt.step()
                opt.zero_grad(set_to_none=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert [str(w.message) for w in caught if SYNC_WARNING in str(w.message)] == []
    assert opt._loss_scale._replay is not None and opt._loss_scale._replay._graph is not None


def test_a_state_advanced_by_the_callers_own_graph_is_read_at_the_next_eager_update():
    stream = _stream(12, seed=1)
    reference = LossScale(PredictiveScale(init_scale=2.0**16, cuda_graph=False), "cuda")
    for found, amax, loss_finite in stream:
        reference.update(found, amax, loss_finite)
    owner = LossScale(PredictiveScale(init_scale=2.0**16), "cuda")
    for found, amax, loss_finite in stream[:4]:  # replayed from the owner's graph
        owner.update(found, amax, loss_finite)
    static = [t.clone() for t in stream[4]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        user_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(user_graph):  # under the caller's capture: the ops themselves, in place
            owner.update(*static)
    torch.cuda.current_stream().wait_stream(side)
    for found, amax, loss_finite in stream[4:8]:
        for target, value in zip(static, (found, amax, loss_finite)):
            target.copy_(value)
        user_graph.replay()
    for found, amax, loss_finite in stream[8:]:  # the owner's graph again, from the state the replays left
        owner.update(found, amax, loss_finite)
    assert owner.state_dict() == reference.state_dict()
