"""Trust, at the core: every door refuses a scale that would corrupt a run; sparse gradients are unscaled in
place; a step with no gradients never counts as clean; counters hold every value their constructor takes;
torch's private names are views of the real state. Each test here failed before the fix it covers."""

from __future__ import annotations

import math

import pytest
import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from lossscale import DynamicScale, GradScaler, LossScaleOptimizer
from lossscale.compat import ascend, mindspore, nnabla
from lossscale.stages import NoGradientsError

BAD_SCALES = [0.0, 1e-46, 2.0**-140, math.inf, math.nan, -8.0, torch.tensor(0.0), torch.tensor(1e-40),
              torch.tensor(math.inf), torch.tensor(math.nan)]


def _embedding_step(front_end: str, indices: list[int], scale: float = 1024.0) -> torch.Tensor:
    """One SGD step (lr 0.1) of a sparse embedding through a front end; returns the weight change."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 3, sparse=True)
    before = emb.weight.detach().clone()
    sgd = torch.optim.SGD(emb.parameters(), lr=0.1)
    loss = emb(torch.tensor(indices)).sum()
    if front_end == "GradScaler":
        scaler = GradScaler(init_scale=scale)
        scaler.scale(loss).backward()
        scaler.step(sgd)
        scaler.update()
    else:
        opt = LossScaleOptimizer(sgd, policy=DynamicScale(init_scale=scale))
        opt.backward(loss)
        opt.step()
    return emb.weight.detach() - before


@pytest.mark.parametrize("front_end", ["GradScaler", "LossScaleOptimizer"])
@pytest.mark.parametrize("indices", [[1, 2], [1, 1, 2]], ids=["coalesced", "uncoalesced"])
def test_sparse_gradients_are_unscaled_in_place(front_end, indices):
    change = _embedding_step(front_end, indices)
    counts = torch.bincount(torch.tensor(indices), minlength=6).float()
    expected = -0.1 * counts[:, None].expand(6, 3)
    assert torch.allclose(change, expected, atol=1e-6)


@pytest.mark.parametrize("coalesce", [True, False])
def test_sparse_inf_values_are_an_overflow_for_both_dtypes(coalesce):
    for dtype in (torch.float32, torch.float16):
        p = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
        values = torch.tensor([1.0, math.inf], dtype=dtype)
        grad = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), values, (4,), check_invariants=True)
        p.grad = grad.coalesce() if coalesce else grad
        found = GradScaler()._unscale_grads_(torch.optim.SGD([p], lr=1.0), torch.tensor(0.5), torch.zeros(()), True)
        assert float(sum(found.values())) == 1.0


def test_uncoalesced_float16_duplicates_that_overflow_together_are_found():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.tensor([64000.0, 64000.0], dtype=torch.float16),
                                     (4,), check_invariants=True)
    found = GradScaler()._unscale_grads_(torch.optim.SGD([p], lr=1.0), torch.tensor(1.0), torch.zeros(()), True)
    assert float(sum(found.values())) == 1.0 and p.grad.is_coalesced()


@pytest.mark.parametrize("bad", BAD_SCALES, ids=repr)
def test_gradscaler_doors_refuse_a_corrupting_scale(bad):
    scaler = GradScaler(init_scale=1024.0)
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match=r"GradScaler\.update\(new_scale="):
        scaler.update(new_scale=bad)
    with pytest.raises(ValueError, match=r"GradScaler\._scale = "):
        scaler._scale = bad
    with pytest.raises(ValueError, match=r"GradScaler\.load_state_dict.*field 'scale'"):
        scaler.load_state_dict({"scale": bad, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                                "_growth_tracker": 0})
    assert scaler.get_scale() == 1024.0


@pytest.mark.parametrize("bad", BAD_SCALES, ids=repr)
def test_optimizer_and_facade_doors_refuse_a_corrupting_scale(bad):
    w = torch.nn.Parameter(torch.ones(2))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1), policy=DynamicScale(init_scale=1024.0))
    with pytest.raises(ValueError, match=r"LossScaleOptimizer\.set_scale"):
        opt.set_scale(bad)
    saved = opt.state_dict()
    saved["policy_state"]["scale"] = bad
    with pytest.raises(ValueError, match=r"LossScaleOptimizer\.load_state_dict"):
        opt.load_state_dict(saved)
    npu = ascend.NPULossScaleOptimizer(torch.optim.SGD([w], lr=0.1), ascend.FixedLossScaleManager(1024))
    with pytest.raises(ValueError, match=r"set_scale"):
        npu.set_scale(bad)
    cell = mindspore.TrainOneStepWithLossScaleCell(lambda: w.sum(), torch.optim.SGD([w], lr=0.1),
                                                   mindspore.DynamicLossScaleUpdateCell(1024, 2, 100))
    if isinstance(bad, torch.Tensor):
        with pytest.raises(ValueError, match=r"set_sense_scale"):
            cell.set_sense_scale(bad)
    updater = nnabla.DynamicLossScalingUpdater(torch.optim.SGD([w], lr=0.1), lambda: w.sum())
    with pytest.raises(ValueError, match=r"DynamicLossScalingUpdater\.scale = "):
        updater.scale = bad
    assert float(opt.scale) == 1024.0 == float(npu.get_loss_scale()) == float(cell.scale_sense)
    assert updater.scale == 8.0 and torch.equal(w.detach(), torch.ones(2))


@pytest.mark.parametrize("kwargs", [dict(growth_interval=2**31), dict(hysteresis=2**31), dict(growth_delay=2**40)])
def test_counters_refuse_what_int32_cannot_hold(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"{name} must be an integer <= 2147483647"):
        DynamicScale(**kwargs)


def test_the_largest_growth_interval_never_grows_early():
    ours = GradScaler(init_scale=1024.0, growth_interval=2**31 - 1)
    w = torch.nn.Parameter(torch.ones(2))
    sgd = torch.optim.SGD([w], lr=0.0)
    for _ in range(20):
        ours.scale(w.sum()).backward()
        ours.step(sgd)
        ours.update()
    assert ours.get_scale() == 1024.0


def test_a_step_with_no_gradients_raises_in_both_front_ends_and_the_scale_stays():
    w = torch.nn.Parameter(torch.ones(2))
    scaler = GradScaler(init_scale=1024.0, growth_interval=1)
    scaler.scale(torch.ones(()))
    with pytest.raises(NoGradientsError, match="No inf checks were recorded for this optimizer"):
        scaler.step(torch.optim.SGD([w], lr=0.1))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1), policy=DynamicScale(init_scale=1024.0, growth_interval=1))
    with pytest.raises(NoGradientsError):
        opt.step()
    assert scaler.get_scale() == 1024.0 == float(opt.scale)


class _TakesScaler(torch.optim.SGD):
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):  # noqa: D102
        self.seen = grad_scaler
        return "stepped"


def test_optimizers_that_take_grad_scaler_receive_the_scaler_with_torchs_warning():
    w = torch.nn.Parameter(torch.ones(2))
    opt = _TakesScaler([w], lr=0.1)
    scaler = GradScaler()
    scaler.scale(w.sum()).backward()
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
        result = scaler.step(opt)
    assert opt.seen is scaler and result.value == "stepped" and not hasattr(opt, "grad_scale")


def test_torch_private_names_are_views_of_the_real_state():
    scaler = GradScaler(init_scale=512.0)
    assert scaler._scale is None and scaler._per_optimizer_states["x"] == _refresh_per_optimizer_state()
    scaler._lazy_init_scale_growth_tracker("cpu")
    assert scaler._scale is scaler.loss_scale.scale and int(scaler._growth_tracker) == 0
    scaler._init_growth_tracker = 7
    assert scaler.state_dict()["_growth_tracker"] == 7
    w = torch.nn.Parameter(torch.ones(2))
    sgd = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    scaler.unscale_(sgd)
    assert scaler._per_optimizer_states[id(sgd)]["stage"] is OptState.UNSCALED
    assert set(scaler._found_inf_per_device(sgd)) == {torch.device("cpu")}


def _step_with_a_scale_corrupted_in_memory(front_end: str, fused: bool, clip: bool, bad: float):
    """One AdamW step after the scale tensor itself was overwritten (no door saw it); returns (weights
    before, weights after, optimizer state tensors, the step's found_inf)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.randn(5, 4)).square().sum()
    if front_end == "GradScaler":
        scaler = GradScaler(init_scale=1024.0)
        scaler.scale(loss).backward()
        scaler.loss_scale.scale.fill_(bad)
        if clip:
            scaler.unscale_(adamw)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        found = scaler.step(adamw).found_inf
        scaler.update()
    else:
        opt = LossScaleOptimizer(adamw, policy=DynamicScale(init_scale=1024.0), clip_grad_norm=1.0 if clip else None)
        opt.backward(loss)
        opt.loss_scale.scale.fill_(bad)
        found = opt.step().found_inf
    state = [t for s in adamw.state.values() for t in s.values() if t.is_floating_point()]
    return before, [p.detach() for p in model.parameters()], state, found


@pytest.mark.parametrize("bad", [math.nan, 0.0, -1.0, math.inf, 1e-40])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("front_end", ["GradScaler", "LossScaleOptimizer"])
def test_a_scale_corrupted_in_memory_skips_the_step(front_end, fused, clip, bad):
    """The last line behind the doors: whichever stage divides or multiplies by the scale (the fused kernel
    by the scale itself, an unscale pass by its inverse) treats a scale with no finite positive inverse as an
    overflow, so the weights are not moved and no state turns non-finite. GradScaler's fused path, which
    hands the scale to the kernel unchecked, wrote NaN into the weights (NaN, 0) or took a reversed step (-1)."""
    before, after, state, found = _step_with_a_scale_corrupted_in_memory(front_end, fused, clip, bad)
    assert bool(found)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.isfinite(t).all() for t in state)


class _GreedyFused(torch.optim.Optimizer):
    """A third-party SGD that unscales and skips in its step (``_step_supports_amp_scaling``) and then writes
    into the ``grad_scale`` it was handed, as code outside our control may."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        scale, found = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if found is not None and float(found) == 1.0:
            return None
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(p.grad / (1.0 if scale is None else scale), alpha=group["lr"])
        if scale is not None:
            scale.mul_(1024.0)
        return None


@pytest.mark.parametrize("front_end", ["GradScaler", "LossScaleOptimizer"])
def test_an_optimizer_never_holds_the_owners_scale(front_end):
    """The kernel's divisor is a tensor of its own: an optimizer that writes into it cannot move the scale."""
    w = torch.nn.Parameter(torch.ones(3))
    inner = _GreedyFused([w], lr=0.1)
    if front_end == "GradScaler":
        scaler = GradScaler(init_scale=256.0, growth_interval=1000)
        scaler.scale(w.sum()).backward()
        scaler.step(inner)
        scaler.update()
        assert scaler.get_scale() == 256.0
    else:
        opt = LossScaleOptimizer(inner, policy=DynamicScale(init_scale=256.0, growth_interval=1000))
        opt.backward(w.sum())
        opt.step()
        assert float(opt.scale) == 256.0
    assert torch.allclose(w.detach(), torch.full((3,), 0.9))
