"""Healing on a GPU under torch.autocast("cuda", float16): a planted forward overflow is healed at the same step as on
the CPU (the trigger's flags go through pinned memory and are acted on one step later), the scale is kept, and a
healthy run with heal=True adds no synchronisation and no host read to a step (torch.cuda.set_sync_debug_mode("warn"),
HostReadCounter). heal=torch.bfloat16 is taken from compute capability 8.0 and refused, naming the GPU, below it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lossscale import DynamicScale, HealWarning, LossScaleOptimizer
from lossscale.testing import HostReadCounter

SYNC_WARNING = "called a synchronizing CUDA operation"


def chain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 1)).cuda()


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(1000 + step)).cuda()


def step(model, opt, x):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    opt.backward(loss)
    result = opt.step()
    opt.zero_grad()
    return result


def optimizer(model, heal=True):
    policy = DynamicScale(init_scale=2.0**10, growth_interval=1000)
    return LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), policy=policy, diagnose=model, heal=heal)


def test_a_forward_fault_heals_on_cuda_at_the_cpus_step_and_keeps_the_scale():
    model = chain()
    opt = optimizer(model)
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(14):
            if i == 4:
                with torch.no_grad():
                    model[1].weight.mul_(3e5)
            results.append(step(model, opt, batch(i)))
    heals = [str(w.message).split(":")[0] for w in caught if issubclass(w.category, HealWarning)]
    assert heals == ["healed at step 7"]  # faults at 4 and 5 fire, 6 acts, 7 is traced and healed
    assert opt.add_ons[0].healed == {"1": torch.float32}
    assert {float(r.scale) for r in results} == {2.0**10}
    assert all(bool(r.stepped) for r in results[8:])


def test_a_healthy_step_with_heal_adds_no_sync_and_no_host_read_on_cuda():
    model = chain()
    opt = optimizer(model)
    counted = []
    for i in range(30):
        x = batch(i)
        if i < 3:
            step(model, opt, x)
            continue
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught, HostReadCounter() as reads:
                warnings.simplefilter("always")
                opt.backward(loss)
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
        counted.append((sum(SYNC_WARNING in str(w.message) for w in caught), reads.count))
    assert all(c == (0, 0) for c in counted), counted


def test_heal_in_bfloat16_where_the_gpu_runs_it_natively():
    model = chain()
    if torch.cuda.get_device_capability() >= (8, 0):
        assert optimizer(model, heal=torch.bfloat16).add_ons[0].heal_precision == torch.bfloat16
    else:
        with pytest.raises(ValueError, match=r"heal=torch.bfloat16 needs a device that runs bfloat16 natively"):
            optimizer(model, heal=torch.bfloat16)
