"""The MindSpore facade end to end: TrainOneStepWithLossScaleCell against an fp32 control, cells, managers."""

import copy
import math

import pytest
import torch

from lossscale import presets
from lossscale.compat.mindspore import (
    DynamicLossScaleManager,
    DynamicLossScaleUpdateCell,
    FixedLossScaleManager,
    FixedLossScaleUpdateCell,
    TrainOneStepWithLossScaleCell,
)

INJECT = {1, 4, 5}


class WithLoss(torch.nn.Module):
    """MindSpore's WithLossCell: the network and its loss in one module."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x), y)


def data(n=10):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)) for _ in range(n)]


def test_train_one_step_steps_on_clean_data_and_skips_on_overflow():
    network = WithLoss()
    control = copy.deepcopy(network)
    ref_opt = torch.optim.SGD(control.parameters(), lr=0.1, momentum=0.9)
    cell = DynamicLossScaleUpdateCell(loss_scale_value=2.0**12, scale_factor=2, scale_window=2)
    train = TrainOneStepWithLossScaleCell(network, torch.optim.SGD(network.parameters(), lr=0.1, momentum=0.9), cell)
    policy = presets.mindspore(2.0**12, 2, 2)
    state = policy.init()
    seen = set()
    for i, (x, y) in enumerate(data()):
        if i in INJECT:
            x = x.clone()
            x[0, 0] = math.inf
        else:
            ref_opt.zero_grad()
            ref_loss = control(x, y)
            ref_loss.backward()
            ref_opt.step()
        loss, overflow, used = train(x, y)
        assert bool(overflow) == (i in INJECT)
        if i not in INJECT:
            assert torch.equal(loss, ref_loss.detach())
        assert float(used) == float(state.scale)  # the scale this step's gradients carried
        state = policy.update(state, overflow)
        assert float(train.scale_sense) == float(state.scale)  # the cell's rule, step for step
        seen.add(float(used))
        for p, q in zip(network.parameters(), control.parameters()):
            assert torch.equal(p, q), i  # skipped steps leave the weights (and momentum) bit for bit
    assert len(seen) >= 3


def test_returned_loss_is_the_unscaled_network_output():
    network = WithLoss()
    train = TrainOneStepWithLossScaleCell(network, torch.optim.SGD(network.parameters(), lr=0.0), torch.tensor(1024.0))
    x, y = data(1)[0]
    loss, overflow, used = train(x, y)
    assert torch.equal(loss, network(x, y).detach()) and not bool(overflow) and float(used) == 1024.0


def test_tensor_scale_sense_is_fixed_and_set_sense_scale_changes_it():
    network = WithLoss()
    train = TrainOneStepWithLossScaleCell(
        network, torch.optim.SGD(network.parameters(), lr=0.1), torch.tensor([1024.0])
    )
    x, y = data(1)[0]
    bad = x.clone()
    bad[0, 0] = math.nan
    before = [p.detach().clone() for p in network.parameters()]
    _, overflow, _ = train(bad, y)
    assert bool(overflow) and all(torch.equal(p, q) for p, q in zip(network.parameters(), before))
    assert float(train.scale_sense) == 1024.0  # a fixed scale does not back off
    train.set_sense_scale(torch.tensor([8.0]))
    _, overflow, used = train(x, y)
    assert not bool(overflow) and float(used) == 8.0
    with pytest.raises(TypeError, match=r"set_sense_scale.*sens must be a 1-element tensor"):
        train.set_sense_scale(8.0)


def test_set_sense_scale_with_an_update_cell_keeps_the_counters():
    network = WithLoss()
    cell = DynamicLossScaleUpdateCell(2.0**10, 2, 3)
    train = TrainOneStepWithLossScaleCell(network, torch.optim.SGD(network.parameters(), lr=0.01), cell)
    x, y = data(1)[0]
    train(x, y)
    train(x, y)  # two clean steps of three
    train.set_sense_scale(torch.tensor(64.0))
    train(x, y)  # the third: grows from the new value
    assert float(train.scale_sense) == 128.0


def test_update_cell_updates_the_parameter_in_place_and_returns_overflow():
    cell = DynamicLossScaleUpdateCell(loss_scale_value=1024, scale_factor=2, scale_window=2)
    scale = torch.tensor([1024.0])  # MindSpore's scale_sense may have shape (1,)
    flag = torch.tensor(True)
    assert cell(scale, flag) is flag and scale.tolist() == [512.0]
    for _ in range(2):
        assert cell(scale, False) is False
    assert scale.tolist() == [1024.0]
    assert cell.get_loss_scale() == 1024  # MindSpore returns the value it was built with
    assert FixedLossScaleUpdateCell(128).get_loss_scale() == 128
    fixed_scale = torch.tensor(128.0)
    assert FixedLossScaleUpdateCell(128)(fixed_scale, True) is True and float(fixed_scale) == 128.0
    with pytest.raises(TypeError, match="loss_scale must be a 1-element tensor"):
        cell(1024.0, True)


def test_dynamic_manager_host_api_and_its_update_cell():
    m = DynamicLossScaleManager(init_loss_scale=2**10, scale_factor=2, scale_window=3)
    assert m.get_loss_scale() == 1024.0 and m.get_drop_overflow_update() is True
    m.update_loss_scale(True)
    for _ in range(3):
        m.update_loss_scale(False)
    assert m.get_loss_scale() == 1024.0
    cell = m.get_update_cell()
    assert isinstance(cell, DynamicLossScaleUpdateCell)
    assert (cell.get_loss_scale(), cell.scale_factor, cell.scale_window) == (1024.0, 2, 3)


def test_dynamic_manager_raises_after_a_thousand_overflows_in_a_row_and_grows_at_the_next_clean_step():
    m = DynamicLossScaleManager(init_loss_scale=2.0**4, scale_window=2000)
    for _ in range(1000):
        m.update_loss_scale(True)
    with pytest.raises(
        RuntimeError,
        match=r"update_loss_scale\(overflow=True\): 1001 overflows in a row exceed "
        r"MindSpore's limit of 1000",
    ):
        m.update_loss_scale(True)
    assert m.get_loss_scale() == 1.0
    m.update_loss_scale(False)  # MindSpore did not advance its step counter: the growth test passes at once
    assert m.get_loss_scale() == 2.0


def test_fixed_manager():
    m = FixedLossScaleManager()
    assert (m.get_loss_scale(), m.get_drop_overflow_update()) == (128.0, True)
    m.update_loss_scale(True)
    assert m.get_loss_scale() == 128.0
    assert isinstance(m.get_update_cell(), FixedLossScaleUpdateCell)
    assert FixedLossScaleManager(1024.0, drop_overflow_update=False).get_update_cell() is None


def test_train_one_step_with_a_managers_update_cell():
    network = WithLoss()
    manager = DynamicLossScaleManager(init_loss_scale=2.0**8, scale_window=1)
    train = TrainOneStepWithLossScaleCell(
        network, torch.optim.SGD(network.parameters(), lr=0.01), manager.get_update_cell()
    )
    x, y = data(1)[0]
    train(x, y)
    assert float(train.scale_sense) == 512.0


# --- issue 14: the update cell's loss_scale is MindSpore's float32 Parameter -------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float16, torch.float64, torch.bfloat16, torch.bool])
def test_update_cell_refuses_a_loss_scale_that_is_not_float32(dtype):
    cell = DynamicLossScaleUpdateCell(loss_scale_value=3, scale_factor=3, scale_window=2)
    loss_scale = torch.tensor(3, dtype=dtype) if dtype != torch.bool else torch.tensor(True)
    before = loss_scale.clone()
    counters = cell.scale_state
    with pytest.raises(
        TypeError,
        match=rf"DynamicLossScaleUpdateCell\(loss_scale, overflow\): loss_scale must "
        rf"be a float32 tensor.*got {dtype}",
    ):
        cell(loss_scale, torch.tensor(True))
    assert torch.equal(loss_scale, before) and cell.scale_state is counters


def test_update_cell_keeps_a_float32_loss_scale_exact():
    cell = DynamicLossScaleUpdateCell(loss_scale_value=3, scale_factor=3, scale_window=2)
    loss_scale = torch.tensor([3.0])
    cell(loss_scale, torch.tensor(True))
    assert loss_scale.dtype == torch.float32 and loss_scale.shape == (1,) and float(loss_scale) == 1.0
