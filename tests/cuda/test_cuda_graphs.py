"""CUDA graphs: a whole training step (float16 autocast forward, backward, unscale + clip, step, scale update)
captured once and replayed, for lossscale.GradScaler and LossScaleOptimizer over capturable optimizers. Overflows are
made inside replays (an inf in the static input): the replay skips the step (parameters and optimizer state bit for
bit as before), halves the scale, and the StepResult captured with the graph reads that replay's decision. Replays
follow the same trajectory as the same steps run eagerly. A step skipped on the host cannot be captured: it is refused
with an error that names the call. docs/cuda.md describes the recipe."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from lossscale import DynamicScale, GradScaler, LossScaleOptimizer

GROWTH_INTERVAL = 2
WARM_UP = 3
SEQUENCE = [False, True, True, False, False, False, False, True, False]  # True: an inf in the replay's input
FRONTS = ["GradScaler", "LossScaleOptimizer fused", "LossScaleOptimizer fused flat", "LossScaleOptimizer masked"]


@dataclass
class Setup:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer  # the torch optimizer whose state a skipped step must leave alone
    x: torch.Tensor  # static input, written before each step or replay
    step: Callable[[], dict[str, torch.Tensor]]  # one whole step; returns its decision as device tensors
    scale: Callable[[], float]  # the current scale (a host read, between replays)


def _build(front: str) -> Setup:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).cuda()
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda")

    def loss() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):  # no autocast cache in a graph
            out = model(x)
        return torch.nn.functional.mse_loss(out.float(), y)

    if front == "GradScaler":
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
        scaler = GradScaler("cuda", growth_interval=GROWTH_INTERVAL)

        def step() -> dict[str, torch.Tensor]:
            inner.zero_grad(set_to_none=True)  # backward makes the gradients (in a capture: in the graph's pool)
            scaler.scale(loss()).backward()
            scaler.unscale_(inner)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            decision = scaler.step(inner)
            scaler.update()
            return {"found_inf": decision.found_inf}

        return Setup(model, inner, x, step, lambda: float(scaler.get_scale_tensor()))

    if front.startswith("LossScaleOptimizer fused"):
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
        skip_mode = "fused"
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True, capturable=True)
        skip_mode = "masked"
    opt = LossScaleOptimizer(
        inner,
        policy=DynamicScale(growth_interval=GROWTH_INTERVAL),
        clip_grad_norm=1.0,
        skip_mode=skip_mode,
        flat_grads=front.endswith("flat"),
    )

    def step() -> dict[str, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        opt.backward(loss())
        result = opt.step()
        return {
            "found_inf": result.found_inf,
            "stepped": result.stepped,
            "scale": result.scale,
            "next_scale": result.next_scale,
            "grad_norm": result.grad_norm,
        }

    return Setup(model, inner, x, step, lambda: float(opt.scale))


def _snapshot(setup: Setup) -> list[torch.Tensor]:
    state = [t for s in setup.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [t.detach().clone() for t in list(setup.model.parameters()) + state]


def _inputs(setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    good = setup.x.clone()
    bad = good.clone()
    bad[0, 0] = math.inf
    return good, bad


def _record(setup: Setup, outputs: dict[str, torch.Tensor], before: list[torch.Tensor], scale_before: float) -> dict:
    torch.cuda.synchronize()
    record = {name: (float(t) if t.is_floating_point() else bool(t)) for name, t in outputs.items() if t is not None}
    record["scale_before"], record["scale_after"] = scale_before, setup.scale()
    record["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _snapshot(setup)))
    return record


def replayed(front: str) -> tuple[list[dict], Setup]:
    """WARM_UP clean steps on a side stream (torch's recipe), one capture, then a replay per entry of SEQUENCE."""
    setup = _build(front)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARM_UP):
            setup.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = setup.step()
    good, bad = _inputs(setup)
    records = []
    for overflow in SEQUENCE:
        setup.x.copy_(bad if overflow else good)
        before, scale_before = _snapshot(setup), setup.scale()
        graph.replay()
        records.append(_record(setup, outputs, before, scale_before))
    return records, setup


def eager(front: str) -> tuple[list[dict], Setup]:
    """The same steps run eagerly: the trajectory a replay must follow."""
    setup = _build(front)
    for _ in range(WARM_UP):
        setup.step()
    good, bad = _inputs(setup)
    records = []
    for overflow in SEQUENCE:
        setup.x.copy_(bad if overflow else good)
        before, scale_before = _snapshot(setup), setup.scale()
        records.append(_record(setup, setup.step(), before, scale_before))
    return records, setup


@pytest.mark.parametrize("front", FRONTS)
def test_overflows_inside_replays_skip_the_step_and_back_off_the_scale(front):
    records, _ = replayed(front)
    clean_run = WARM_UP  # clean steps since the last overflow: the scale grows at every GROWTH_INTERVAL-th
    for overflow, record in zip(SEQUENCE, records):
        assert record["found_inf"] == overflow
        assert record["unchanged"] == overflow  # skipped: parameters and state bit for bit; applied: moved
        if overflow:
            clean_run = 0
            assert record["scale_after"] == record["scale_before"] / 2
        else:
            clean_run += 1
            grows = clean_run % GROWTH_INTERVAL == 0
            assert record["scale_after"] == record["scale_before"] * (2 if grows else 1)
        if front != "GradScaler":  # the StepResult captured with the graph holds this replay's decision
            assert record["stepped"] == (not overflow)
            assert (record["scale"], record["next_scale"]) == (record["scale_before"], record["scale_after"])
            assert math.isfinite(record["grad_norm"]) != overflow
    assert records[2]["scale_after"] == records[0]["scale_after"] / 4  # two overflows in a row: the state advanced


@pytest.mark.parametrize("front", FRONTS)
def test_replays_follow_the_eager_trajectory(front):
    graph_records, graph_setup = replayed(front)
    eager_records, eager_setup = eager(front)
    keys = ("found_inf", "scale_before", "scale_after", "unchanged")
    assert [{k: r[k] for k in keys} for r in graph_records] == [{k: r[k] for k in keys} for r in eager_records]
    for p, q in zip(graph_setup.model.parameters(), eager_setup.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("front", ["GradScaler", "LossScaleOptimizer"])
def test_a_step_skipped_on_the_host_is_refused_under_capture_naming_the_call(front):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).cuda()
    x = torch.randn(8, 16, device="cuda")
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True, capturable=True)  # not fused: host skip
    if front == "GradScaler":
        scaler = GradScaler("cuda")
        call = "GradScaler.step(optimizer)"

        def step() -> None:
            inner.zero_grad(set_to_none=True)
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(inner)
            scaler.update()
    else:
        opt = LossScaleOptimizer(inner, skip_mode="host")
        call = "LossScaleOptimizer.step() with skip_mode='host'"

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            opt.backward(model(x).square().mean())
            opt.step()

    for _ in range(WARM_UP):
        step()
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError) as err:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            step()
    assert str(err.value).startswith(f"{call} under CUDA graph capture: ")
    assert "fused=True, capturable=True" in str(err.value)
