"""torch.amp.GradScaler's private names that real code reads and writes, on lossscale.GradScaler: ``_scale``,
``_growth_tracker``, ``_init_scale``, ``_per_optimizer_states``, ``_unscale_grads_``, ``_check_inf_per_device``,
and ``grad_scaler=self`` for optimizers that take it. Each test runs on both classes (``BOTH``) or compares
lossscale's with torch's. That these names are views of the one owner of the scale: test_state.py.

PyTorch's own GradScaler tests, run against lossscale.GradScaler, are kept outside the repository (CONTRIBUTING.md,
"Tests against what others wrote").
"""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

import lossscale

BOTH = [pytest.param(lossscale.GradScaler, id="lossscale"), pytest.param(torch.amp.GradScaler, id="torch")]


def sgd_on(*grads: torch.Tensor) -> torch.optim.SGD:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    return torch.optim.SGD(params, lr=1.0)


@pytest.mark.parametrize("cls", BOTH)
def test_scale_is_a_live_float32_tensor_that_can_be_assigned(cls):
    scaler = cls("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    assert isinstance(scaler._scale, torch.Tensor) and scaler._scale.dtype == torch.float32
    assert float(scaler._scale) == 8.0 and scaler._scale.device.type == "cpu"
    scaler._scale = torch.tensor(32.0)
    assert scaler.get_scale() == 32.0 and float(scaler.scale(torch.ones(()))) == 32.0


@pytest.mark.parametrize("cls", BOTH)
def test_init_attributes_and_the_state_dicts_growth_tracker(cls):
    s0 = cls("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = cls("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    assert s0._init_scale == 3.0 and s0._init_growth_tracker == 0
    s1._init_growth_tracker = 7
    s1.scale(torch.ones(()))
    assert s1._growth_tracker.dtype == torch.int32
    s1.load_state_dict(s0.state_dict())
    assert (s1.get_scale(), s1._init_growth_tracker, s1.get_growth_interval()) == (3.0, 0, 2)
    assert pickle.loads(pickle.dumps(cls("cpu", init_scale=3.0)))._init_growth_tracker == 0


@pytest.mark.parametrize("cls", BOTH)
def test_per_optimizer_states_default_and_stages(cls):
    scaler = cls("cpu")
    assert scaler._per_optimizer_states["any key"] == _refresh_per_optimizer_state()
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler.scale(w.sum()).backward()
    scaler.unscale_(opt)
    record = scaler._per_optimizer_states[id(opt)]
    assert record["stage"] is OptState.UNSCALED and list(record["found_inf_per_device"]) == [w.device]


@pytest.mark.parametrize("cls", BOTH)
def test_lazy_init_and_found_inf_per_device(cls):
    scaler = cls("cpu", init_scale=4.0)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    assert float(scaler._scale) == 4.0 and int(scaler._growth_tracker) == 0
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler.scale(w.sum()).backward()
    w.grad[0] = math.nan
    found = scaler._check_inf_per_device(opt)
    assert float(sum(found.values())) == 1.0 and scaler._found_inf_per_device(opt) == found


@pytest.mark.parametrize("start", [0.0, 2.0])
@pytest.mark.parametrize("poison", [None, 0, 1, 2])
def test_unscale_grads_returns_and_writes_what_torchs_does(start, poison):
    """Mixed dtypes (float16 allowed), a non-contiguous gradient, a found_inf that starts raised, called before any
    scale(): the found_inf per device and the unscaled gradients are torch's."""
    results = []
    for cls in (torch.amp.GradScaler, lossscale.GradScaler):
        grads = [torch.full((4, 4), 4.0), torch.full((4, 8), 4.0)[:, :5], torch.full((4, 4), 4.0, dtype=torch.float16)]
        if poison is not None:
            grads[poison][1, 1] = math.inf
        opt = sgd_on(*grads)
        found = cls("cpu")._unscale_grads_(opt, torch.full((1,), 0.25), torch.full((1,), start), True)
        results.append(({str(d): float(f) for d, f in found.items()}, [p.grad for p in opt.param_groups[0]["params"]]))
    (torch_found, torch_grads), (our_found, our_grads) = results
    assert our_found == torch_found == {"cpu": 1.0 if poison is not None else start}
    assert all(torch.equal(a, b) for a, b in zip(torch_grads, our_grads))
    assert poison is not None or all(torch.equal(g, torch.ones_like(g)) for g in our_grads)


def sparse(values, indices, dtype=torch.float32) -> torch.Tensor:
    return torch.sparse_coo_tensor(
        torch.tensor(indices), torch.tensor(values), (2, 3), dtype=dtype, check_invariants=True
    )


@pytest.mark.parametrize("cls", BOTH)
def test_sparse_gradients_are_unscaled_in_place(cls):
    scaler = cls("cpu")
    p = torch.nn.Parameter(torch.zeros(2, 3))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = sparse([16.0, 32.0, 64.0], ((0, 1, 0), (2, 0, 2)))  # uncoalesced float32: unscaled as it is
    grad = p.grad
    found = scaler._unscale_grads_(opt, torch.full((1,), 0.25), torch.zeros(1), False)
    assert float(found[torch.device("cpu")]) == 0.0 and p.grad is grad
    assert torch.equal(p.grad.to_dense(), sparse([4.0, 8.0, 16.0], ((0, 1, 0), (2, 0, 2))).to_dense())
    half = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float16))
    # uncoalesced float16: coalesced first, so the two 64000s at one index are found as 128000 > float16's max
    half.grad = sparse([64000.0, 32.0, 64000.0], ((0, 1, 0), (2, 0, 2)), torch.float16)
    found = scaler._unscale_grads_(torch.optim.SGD([half], lr=1.0), torch.full((1,), 0.25), torch.zeros(1), True)
    assert float(found[torch.device("cpu")]) == 1.0


@pytest.mark.parametrize("cls", BOTH)
def test_optimizers_taking_grad_scaler_receive_the_scaler_with_torchs_warning(cls):
    received = []

    class Takes(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, *, grad_scaler=None):
            received.append((grad_scaler, hasattr(self, "grad_scale"), hasattr(self, "found_inf")))

    w = torch.nn.Parameter(torch.ones(2))
    opt = Takes([w], lr=1.0)
    scaler = cls("cpu", init_scale=2.0)
    scaler.scale(w.sum()).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.step(opt)
    assert received == [(scaler, False, False)]
    assert [w.category for w in caught] == [FutureWarning]
