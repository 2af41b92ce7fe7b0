"""The core's forward-fault verdict, on both front ends: off unless an add-on asks for it (``finds_forward_faults``);
where it is on, a step one of whose losses is non-finite is skipped even where its gradients are finite, and the
policy's whole state stays exactly as it was; a healthy run is the same run, bit for bit, with no host read added.
Under two gloo ranks (one rank's loss non-finite): test_distributed.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lossscale import DynamicScale, GradScaler, LossScaleOptimizer, PredictiveScale, presets
from lossscale.addons import AddOn, StepOutcome
from lossscale.testing import HostReadCounter

INF = math.inf
FAULT = 3  # the step whose loss is non-finite


class FindsFaults(AddOn):
    """An add-on that asks for the verdict and records what each step's outcome said."""

    finds_forward_faults = True

    def __init__(self) -> None:
        self.outcomes: list[StepOutcome] = []

    def after_step(self, outcome: StepOutcome) -> None:
        self.outcomes.append(outcome)


def model_and_data(seed: int = 0) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))
    gen = torch.Generator().manual_seed(seed)
    return model, [(torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)) for _ in range(8)]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, bad: bool) -> torch.Tensor:
    loss = torch.nn.functional.mse_loss(model(x), y)
    return loss + torch.tensor(INF) if bad else loss  # a constant inf: the loss is inf, its gradients finite


OPTIMIZERS = {
    "fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "host": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "masked": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
}


def run_optimizer(kind: str, faults: bool, policy=None, bad_step: int | None = FAULT, **options):
    model, data = model_and_data()
    add_on = FindsFaults()
    opt = LossScaleOptimizer(
        OPTIMIZERS[kind](model.parameters()),
        policy=policy or DynamicScale(init_scale=2.0**10, growth_interval=2),
        add_ons=[add_on] if faults else [],
        skip_mode="masked" if kind == "masked" else "auto",
        **options,
    )
    results, states, params = [], [], []
    for i, (x, y) in enumerate(data):
        opt.backward(loss_of(model, x, y, i == bad_step))
        results.append(opt.step())
        opt.zero_grad()
        states.append(opt.loss_scale.state_dict())
        params.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return opt, add_on, results, states, params


@pytest.mark.parametrize("kind", ["fused", "host", "masked"])
def test_a_non_finite_loss_skips_the_step_and_the_policy_does_not_see_it(kind):
    _, add_on, results, states, params = run_optimizer(kind, faults=True)
    assert [bool(r.stepped) for r in results] == [i != FAULT for i in range(8)]
    assert [bool(r.forward_fault) for r in results] == [i == FAULT for i in range(8)]
    assert not any(bool(r.found_inf) for r in results)  # found_inf keeps meaning a gradient overflow
    assert states[FAULT] == states[FAULT - 1]  # every field: scale, growth tracker, hysteresis, floor hits
    assert float(results[FAULT].next_scale) == float(results[FAULT].scale)
    assert torch.equal(params[FAULT], params[FAULT - 1])  # the parameters did not move
    assert [bool(o.forward_fault) for o in add_on.outcomes] == [i == FAULT for i in range(8)]
    # the same run without the verdict applies that step: its gradients were finite
    _, _, plain, plain_states, _ = run_optimizer(kind, faults=False)
    assert all(r.forward_fault is None for r in plain) and bool(plain[FAULT].stepped)
    assert plain_states[FAULT] != plain_states[FAULT - 1]  # the policy counted a clean step


def test_one_bad_loss_in_an_accumulation_window_skips_the_window():
    model, data = model_and_data()
    opt = LossScaleOptimizer(
        OPTIMIZERS["fused"](model.parameters()),
        policy=DynamicScale(init_scale=2.0**10, growth_interval=2),
        add_ons=[FindsFaults()],
        accumulation_steps=2,
    )
    boundaries = []
    for i, (x, y) in enumerate(data):
        opt.backward(loss_of(model, x, y, i == 2))  # the first micro-batch of the second window
        result = opt.step()
        if not result.accumulating:
            boundaries.append(result)
            opt.zero_grad()
    assert [bool(r.forward_fault) for r in boundaries] == [False, True, False, False]
    assert [bool(r.stepped) for r in boundaries] == [True, False, True, True]


@pytest.mark.parametrize(
    "policy",
    [PredictiveScale(init_scale=2.0**10), presets.deepspeed(init_scale=2.0**10, scale_window=2), presets.megatron()],
    ids=["predictive", "deepspeed", "megatron"],
)
def test_every_policy_keeps_its_whole_state_through_a_forward_fault(policy):
    _, _, results, states, _ = run_optimizer("host", faults=True, policy=policy)
    assert bool(results[FAULT].forward_fault) and not bool(results[FAULT].stepped)
    assert states[FAULT] == states[FAULT - 1]


@pytest.mark.parametrize("kind", ["fused", "host", "masked"])
def test_a_healthy_run_is_the_same_run_bit_for_bit_with_the_verdict_on(kind):
    _, _, with_results, with_states, with_params = run_optimizer(kind, faults=True, bad_step=None, clip_grad_norm=1.0)
    _, _, results, states, params = run_optimizer(kind, faults=False, bad_step=None, clip_grad_norm=1.0)
    assert with_states == states
    assert all(torch.equal(a, b) for a, b in zip(with_params, params))
    for a, b in zip(with_results, results):
        assert not bool(a.forward_fault) and b.forward_fault is None
        assert {k: v for k, v in a.as_dict().items() if k != "forward_fault"} == {
            k: v for k, v in b.as_dict().items() if k != "forward_fault"
        }


def test_the_verdict_adds_no_host_read_to_a_fused_step():
    for faults in (False, True):
        model, data = model_and_data()
        opt = LossScaleOptimizer(
            OPTIMIZERS["fused"](model.parameters()), add_ons=[FindsFaults()] if faults else [], clip_grad_norm=1.0
        )
        x, y = data[0]
        opt.backward(loss_of(model, x, y, False))
        opt.step()
        with HostReadCounter() as reads:
            opt.backward(loss_of(model, x, y, False))
            opt.step()
        assert reads.count == 0, faults


def run_scaler(kind: str, faults: bool, bad_step: int | None = FAULT):
    model, data = model_and_data()
    inner = OPTIMIZERS[kind](model.parameters())
    scaler = GradScaler("cpu", policy=DynamicScale(init_scale=2.0**10, growth_interval=2))
    add_on = FindsFaults()
    if faults:
        scaler.attach_add_ons([add_on])
    decisions, states, params = [], [], []
    for i, (x, y) in enumerate(data):
        scaler.scale(loss_of(model, x, y, i == bad_step)).backward()
        decisions.append(scaler.step(inner))
        scaler.update()
        inner.zero_grad()
        states.append(scaler.loss_scale.state_dict())
        params.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return add_on, decisions, states, params


@pytest.mark.parametrize("kind", ["fused", "host"])
def test_the_scaler_skips_a_forward_fault_and_its_policy_does_not_see_it(kind):
    add_on, decisions, states, params = run_scaler(kind, faults=True)
    assert [bool(d.stepped) for d in decisions] == [i != FAULT for i in range(8)]
    assert [bool(d.forward_fault) for d in decisions] == [i == FAULT for i in range(8)]
    assert not any(bool(d.found_inf) for d in decisions)
    assert states[FAULT] == states[FAULT - 1]
    assert torch.equal(params[FAULT], params[FAULT - 1])
    assert [bool(o.forward_fault) for o in add_on.outcomes] == [i == FAULT for i in range(8)]
    assert [bool(o.stepped) for o in add_on.outcomes] == [i != FAULT for i in range(8)]
    _, plain, _, _ = run_scaler(kind, faults=False)
    assert all(d.forward_fault is None for d in plain) and bool(plain[FAULT].stepped)
    _, _, healthy_states, healthy_params = run_scaler(kind, faults=True, bad_step=None)
    _, _, off_states, off_params = run_scaler(kind, faults=False, bad_step=None)
    assert healthy_states == off_states and all(torch.equal(a, b) for a, b in zip(healthy_params, off_params))


def test_a_forward_fault_is_one_more_reason_to_skip_on_the_result_types():
    f, t = torch.tensor(False), torch.tensor(True)
    outcome = StepOutcome(
        stepped=f, found_inf=f, scale=torch.tensor(8.0), next_scale=torch.tensor(8.0), forward_fault=t
    )
    assert bool(outcome.skipped)
    assert dataclasses.replace(outcome, forward_fault=None).forward_fault is None
