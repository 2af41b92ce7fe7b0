"""What changes while a CUDA graph is being captured, with the capture simulated on the CPU (the check that a stream
is capturing answers True): the state is advanced in place, so each replay reads and writes the same memory; a
StepResult keeps the scale its step used; a step skipped on the host, and a floor rule that reads the host, are
refused with an error that names the call.
The real capture and replay, with an overflow inside the graph: tests/cuda/test_graphs.py."""

from __future__ import annotations

import pytest
import torch

import lossscale.stages
import lossscale.state
from lossscale import DynamicScale, GradScaler, LossScale, LossScaleOptimizer, PredictiveScale


@pytest.fixture
def capture(monkeypatch):
    """Every tensor counts as being on a stream that is capturing a CUDA graph."""
    for module in (lossscale.state, lossscale.stages):
        monkeypatch.setattr(module, "capturing", lambda tensor: True)


@pytest.mark.parametrize(
    "policy",
    [
        DynamicScale(init_scale=1024.0, growth_interval=2),
        DynamicScale(init_scale=1024.0, growth_interval=2, hysteresis=2),
        PredictiveScale(init_scale=1024.0),
    ],
)
def test_under_capture_the_state_advances_in_its_own_tensors_as_it_would_replaced(capture, policy):
    flags = [True, False, False, True, True, False, False, False]
    reference = LossScale(policy)
    for flag in flags:
        reference.update(torch.tensor(flag))
    loss_scale = LossScale(policy)

    def tensors():
        return [getattr(loss_scale.state, name) for name in loss_scale.state.__dataclass_fields__]

    first = tensors()
    for flag in flags:
        loss_scale.update(torch.tensor(flag))
    assert all(a is b for a, b in zip(first, tensors()))
    assert loss_scale.state_dict() == reference.state_dict()


def test_outside_capture_the_tensors_read_before_an_update_keep_their_values():
    loss_scale = LossScale(DynamicScale(init_scale=1024.0))
    before = loss_scale.scale
    loss_scale.update(torch.tensor(True))
    assert float(before) == 1024.0 and float(loss_scale.scale) == 512.0


def test_under_capture_a_step_result_holds_the_scale_its_step_used(capture):
    params = [torch.nn.Parameter(torch.ones(4))]
    opt = LossScaleOptimizer(
        torch.optim.AdamW(params, lr=1e-3, fused=True), policy=DynamicScale(init_scale=1024.0), clip_grad_norm=1.0
    )
    params[0].grad = torch.full((4,), float("inf"))
    result = opt.step()
    assert (bool(result.stepped), float(result.scale), float(result.next_scale)) == (False, 1024.0, 512.0)
    assert result.next_scale is opt.scale  # the state's own tensor: a replay writes its next value there


@pytest.mark.parametrize("front", ["GradScaler", "LossScaleOptimizer"])
def test_under_capture_a_step_skipped_on_the_host_is_refused_naming_the_call(capture, front):
    params = [torch.nn.Parameter(torch.ones(4))]
    inner = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    params[0].grad = torch.ones(4)
    with pytest.raises(RuntimeError) as err:
        if front == "GradScaler":
            scaler = GradScaler("cpu")
            scaler.scale(torch.ones(()))
            scaler.step(inner)
        else:
            LossScaleOptimizer(inner).step()
    call = "GradScaler.step(optimizer)" if front == "GradScaler" else "LossScaleOptimizer.step() with skip_mode='host'"
    assert str(err.value).startswith(f"{call} under CUDA graph capture: ")
    assert "fused=True, capturable=True" in str(err.value)


def test_under_capture_a_floor_rule_that_reads_the_host_is_refused_before_it_reads(capture):
    loss_scale = LossScale(DynamicScale(init_scale=1024.0, at_floor="raise"))
    with pytest.raises(RuntimeError) as err:
        loss_scale.update(torch.tensor(True))
    assert str(err.value).startswith("LossScale.update under CUDA graph capture: the floor rule of DynamicScale(")
    assert "at_floor='skip'" in str(err.value)
    assert float(loss_scale.scale) == 1024.0  # nothing was written
