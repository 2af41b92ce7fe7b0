"""The Ascend facade end to end: managers, NPULossScaleOptimizer against an fp32 control, both overflow modes."""

import copy
import math

import pytest
import torch

from lossscale.compat import ascend
from lossscale.compat.ascend import ExponentialUpdateLossScaleManager, FixedLossScaleManager, NPULossScaleOptimizer
from lossscale.testing import HostReadCounter
from oracles import f32


def model_and_data(n=10):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    gen = torch.Generator().manual_seed(1)
    return model, [(torch.randn(5, 4, generator=gen), torch.randn(5, 2, generator=gen)) for _ in range(n)]


def test_managers_keep_tf1s_method_names_without_host_reads():
    m = ExponentialUpdateLossScaleManager(init_loss_scale=2.0**10, incr_every_n_steps=2, decr_every_n_nan_or_inf=2)
    assert isinstance(m.get_loss_scale(), torch.Tensor) and m.get_loss_scale().dtype == torch.float32
    with HostReadCounter() as reads:
        for finite in [torch.tensor(False), torch.tensor(True), torch.tensor(False)]:
            m.update_loss_scale(finite)
    assert reads.count == 0
    assert float(m.get_loss_scale()) == f32(2.0**10 * f32(0.8))  # two non-finite steps, not in a row: cumulative
    m.update_loss_scale(True)
    m.update_loss_scale(True)
    assert float(m.get_loss_scale()) == f32(f32(2.0**10 * f32(0.8)) * 2)
    fixed = FixedLossScaleManager(loss_scale=1024)
    fixed.update_loss_scale(False)
    assert float(fixed.get_loss_scale()) == 1024.0
    with pytest.raises(TypeError, match="finite_grads must be a bool, a bool tensor"):
        m.update_loss_scale("yes")


def test_npu_optimizer_steps_and_skips_like_an_fp32_control_and_the_manager_follows():
    model, data = model_and_data()
    control = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(control.parameters(), lr=0.1, momentum=0.9)
    manager = ExponentialUpdateLossScaleManager(
        init_loss_scale=2.0**12, incr_every_n_steps=2, decr_every_n_nan_or_inf=1, decr_ratio=0.5
    )
    opt = NPULossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), manager)
    inject = {2, 3, 7}
    for i, (x, y) in enumerate(data):
        if i not in inject:
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(control(x), y).backward()
            ref_opt.step()
        opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(model(x), y))
        if i in inject:
            model[2].weight.grad[0, 0] = math.inf
        result = opt.step()
        assert bool(result.stepped) == (i not in inject)
        assert opt.get_loss_scale() is manager.get_loss_scale()  # one state: the manager's
    for p, q in zip(model.parameters(), control.parameters()):
        assert torch.equal(p, q)
    # C C O O C C C O C C: x2, /2, /2, x2, (one clean), /2, x2
    assert float(manager.get_loss_scale()) == 2.0**12
    assert manager.scale_state.growth_tracker.item() == 0


def test_saturation_mode_catches_clamped_gradients_that_inf_nan_mode_misses():
    results = {}
    for mode in ("inf_nan", "saturation"):
        model, data = model_and_data(1)
        opt = NPULossScaleOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), FixedLossScaleManager(1024), overflow_mode=mode
        )
        x, y = data[0]
        opt.backward(torch.nn.functional.mse_loss(model(x), y))
        model[0].weight.grad[0, 0] = 65504.0  # the scaled gradient clamped to float16's max: no inf on the device
        results[mode] = bool(opt.step().found_inf)
    assert results == {"inf_nan": False, "saturation": True}


def test_is_distributed_needs_a_process_group():
    model, _ = model_and_data(1)
    with pytest.raises(ValueError, match=r"NPULossScaleOptimizer\(is_distributed=True\): .*init_process_group"):
        NPULossScaleOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), FixedLossScaleManager(8), is_distributed=True
        )


def test_load_state_dict_restores_the_managers_scale():
    model, data = model_and_data(3)
    manager = ExponentialUpdateLossScaleManager(2.0**10, 1)
    opt = NPULossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), manager)
    saved = opt.state_dict()
    for x, y in data:
        opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
    assert float(manager.get_loss_scale()) == 2.0**13
    opt.load_state_dict(saved)
    assert float(manager.get_loss_scale()) == 2.0**10 and manager.scale_state is opt.scale_state


def test_exports_the_precision_mode_api():
    assert ascend.ExperimentalConfig.__module__ == "lossscale.compat.ascend"
    assert ascend.TellMeStepOrLossHook.__module__ == "lossscale.compat.ascend"
    assert {"ExperimentalConfig", "TellMeStepOrLossHook"} <= set(ascend.__all__)


def test_facades_are_not_exported_at_the_top():
    import lossscale

    for name in ("NPULossScaleOptimizer", "DynamicLossScaleUpdateCell", "DynamicLossScalingUpdater"):
        assert not hasattr(lossscale, name)


# --- issue 14: update_loss_scale(finite_grads) ------------------------------------------------------------


def _manager():
    return ExponentialUpdateLossScaleManager(
        init_loss_scale=1024, incr_every_n_steps=1, decr_every_n_nan_or_inf=1, decr_ratio=0.5
    )


@pytest.mark.parametrize(
    "finite_grads, expected",
    [
        (True, 2048.0),
        (False, 512.0),
        (torch.tensor(True), 2048.0),
        (torch.tensor(False), 512.0),
        (torch.tensor([True]), 2048.0),
        # an NPU float status: 0 means no overflow, anything else (or NaN) means overflow
        (torch.tensor(0.0), 2048.0),
        (torch.tensor([0.0]), 2048.0),
        (torch.tensor(1.0), 512.0),
        (torch.tensor(-3.0), 512.0),
        (torch.tensor(math.nan), 512.0),
        (torch.tensor(0.0, dtype=torch.float16), 2048.0),
    ],
)
def test_update_loss_scale_reads_bools_and_float_statuses(finite_grads, expected):
    m = _manager()
    m.update_loss_scale(finite_grads)
    assert m.get_loss_scale().shape == () and float(m.get_loss_scale()) == expected


@pytest.mark.parametrize(
    "finite_grads", [torch.tensor([True, False]), torch.zeros(2), torch.zeros(0, dtype=torch.bool), torch.zeros(8)]
)
def test_update_loss_scale_refuses_more_than_one_value(finite_grads):
    m = _manager()
    with pytest.raises(ValueError, match=r"update_loss_scale\(finite_grads=.*one value.*got shape"):
        m.update_loss_scale(finite_grads)
    assert float(m.get_loss_scale()) == 1024.0 and m.get_loss_scale().shape == ()


@pytest.mark.parametrize("finite_grads", [torch.tensor(1), torch.tensor(0, dtype=torch.int32), 1, 0.0, "True", None])
def test_update_loss_scale_refuses_other_types(finite_grads):
    m = _manager()
    with pytest.raises(TypeError, match=r"update_loss_scale\(finite_grads=.*bool.*got"):
        m.update_loss_scale(finite_grads)
    assert float(m.get_loss_scale()) == 1024.0


def test_set_scale_is_seen_by_get_loss_scale_at_once():
    w = torch.nn.Parameter(torch.ones(2))
    opt = NPULossScaleOptimizer(torch.optim.SGD([w], lr=0.1), FixedLossScaleManager(1024))
    opt.set_scale(2048.0)
    assert float(opt.get_loss_scale()) == 2048.0
    assert float(opt.loss_scale_manager.get_loss_scale()) == 2048.0
