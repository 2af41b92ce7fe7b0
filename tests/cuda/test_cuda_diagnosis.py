"""find_overflow, keep_float32 and OverflowDiagnosis on a GPU under torch.autocast("cuda", float16): the planted kinds
are named as on the CPU (checkpointing included: the recomputation runs on the autograd engine's device thread), the
model is left as found, and the add-on's hooks add no synchronisation and no host read on healthy steps (counted
with torch.cuda.set_sync_debug_mode("warn") and HostReadCounter); a persistent fault still fires, acted on one step
after the trigger as on the CPU (the flags' copy to pinned memory is waited on at the next step)."""

from __future__ import annotations

import warnings

import pytest
import torch

from lossscale import presets
from lossscale.addons.base import FrontEnd, StepOutcome
from lossscale.diagnosis import OverflowDiagnosis, OverflowWarning, find_overflow, keep_float32
from lossscale.state import LossScale
from lossscale.testing import HostReadCounter
from test_diagnosis import Amplifier, hook_count, make_net, plant_gate_overflow

SYNC_WARNING = "called a synchronizing CUDA operation"


def cuda_closure(model, x, loss=lambda y: y.float().mean()):
    def closure():
        with torch.autocast("cuda", dtype=torch.float16):
            return loss(model(x))

    return closure


def net(**kwargs):
    return make_net(**kwargs).cuda()


def cuda_batch(n: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.parametrize("ckpt", [None, False, True], ids=["plain", "checkpoint", "checkpoint-reentrant"])
def test_forward_overflow_named_and_fixed_on_cuda(ckpt):
    model, x = net(ckpt=ckpt), cuda_batch()
    plant_gate_overflow(model)
    report = find_overflow(model, cuda_closure(model, x))
    assert (report.kind, report.module, report.call) == ("forward", "blocks.1.ff", None)
    assert sum(1 for r in report.records if r.module == "blocks.1.ff") == 1
    with keep_float32(model.blocks[1].ff):
        assert find_overflow(model, cuda_closure(model, x), scale=2.0**10).kind == "none"
    assert find_overflow(model, cuda_closure(model, x)).module == "blocks.1.ff"
    assert hook_count(model) == 0


def test_backward_overflow_and_input_on_cuda():
    torch.manual_seed(0)
    model, x = Amplifier().cuda(), cuda_batch()
    report = find_overflow(model, cuda_closure(model, x))
    assert (report.kind, report.module) == ("backward", "amp") and report.max_safe_scale < 2.0**16
    assert find_overflow(model, cuda_closure(model, x), scale=report.max_safe_scale).kind == "none"
    x[0, 0] = float("nan")
    report = find_overflow(model, cuda_closure(model, x))
    assert (report.kind, report.nan) == ("input", True)


def test_the_model_is_left_as_found_on_cuda():
    model, x = net(), cuda_batch()
    model.inp.weight.grad = torch.ones_like(model.inp.weight)
    grad = model.inp.weight.grad
    params = [p.detach().clone() for p in model.parameters()]
    rng = torch.cuda.get_rng_state()
    find_overflow(model, cuda_closure(model, x))
    assert model.inp.weight.grad is grad and torch.equal(grad, torch.ones_like(grad))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "inp.weight")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert torch.equal(torch.cuda.get_rng_state(), rng) and hook_count(model) == 0


class CudaFrontEnd:
    """The hooks' order as a front end calls them, every value on the GPU (no host read of its own)."""

    def __init__(self, model, policy, addon):
        self.model, self.policy, self.addon = model, policy, addon
        self.params = list(model.parameters())
        self.state = policy.init("cuda")
        self.steps = 0
        addon.attach(FrontEnd("CudaFrontEnd", LossScale(policy, "cuda"), tuple(self.params)))

    def step(self, x, counted: list | None = None):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(x).float().pow(2).mean()
        scale = self.state.scale
        scaled = loss * scale
        self._hook(counted, self.addon.on_loss, loss, True)
        scaled.backward()
        grads = [p.grad for p in self.params]
        found = torch.zeros(1, device="cuda")
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, scale.reciprocal().reshape(1))
        found_inf = found.reshape(()) > 0
        with torch.no_grad():
            for p, g in zip(self.params, grads):
                p.sub_(torch.where(found_inf, torch.zeros_like(g), g * 1e-3))
                p.grad = None
        self.state = self.policy.update(self.state, found_inf.float())
        outcome = StepOutcome(~found_inf, found_inf, scale, self.state.scale, self.steps)
        self.steps += 1
        self._hook(counted, self.addon.after_step, outcome)

    @staticmethod
    def _hook(counted, fn, *args):
        if counted is None:
            fn(*args)
            return
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught, HostReadCounter() as reads:
                warnings.simplefilter("always")
                fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = sum(SYNC_WARNING in str(w.message) for w in caught)
        counted.append((syncs, reads.count))


def test_healthy_steps_add_no_sync_and_no_host_read_on_cuda():
    model = net()
    addon = OverflowDiagnosis(model)
    front = CudaFrontEnd(model, presets.megatron(), addon)
    g = torch.Generator().manual_seed(0)
    counted: list = []
    for i in range(80):
        front.step(torch.randn(16, 8, generator=g).cuda(), counted if i >= 2 else None)
        assert not addon.tracing
    assert counted and all(c == (0, 0) for c in counted), counted
    assert addon.last_report is None


def test_a_persistent_fault_fires_on_cuda_one_step_later():
    model = net()
    addon = OverflowDiagnosis(model, patience=4)
    front = CudaFrontEnd(model, presets.torch_amp(init_scale=2.0**10, growth_interval=50), addon)
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        front.step(torch.randn(16, 8, generator=g).cuda())
    with torch.no_grad():
        model.blocks[1].ff.wi_1.weight.mul_(1e5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = 0
        while not any(issubclass(w.category, OverflowWarning) for w in caught) and steps < 30:
            front.step(torch.randn(16, 8, generator=g).cuda())
            steps += 1
    found = [w for w in caught if issubclass(w.category, OverflowWarning)]
    # the second non-finite loss fires the trigger, the next step acts on it, the one after is traced
    assert len(found) == 1 and steps <= 4 + 4
    report = found[0].message.report
    assert (report.kind, report.module) == ("forward", "blocks.1.ff.wi_1")
    assert hook_count(model) == 0 or addon.tracing
