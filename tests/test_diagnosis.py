"""find_overflow, keep_float32 and the OverflowDiagnosis add-on on the CPU under float16 autocast.

Every kind is planted in a small model and must be named where it was planted; max_safe_scale is checked against a
brute-force oracle (the backward rerun at every power of two); the model, its gradients, buffers, modes, hooks and
the optimizer must be left as found. The add-on is driven by a hand-written loop that calls its hooks as a front end
does, and its trigger is replayed over every recorded golden trajectory.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lossscale import DynamicScale, presets
from lossscale.addons.base import StepOutcome
from lossscale.diagnosis import (
    OverflowDiagnosis,
    OverflowReport,
    OverflowWarning,
    TriggerState,
    advance_trigger,
    find_overflow,
    keep_float32,
)
from lossscale.testing import HostReadCounter

sys.path.insert(0, str(Path(__file__).parent / "golden"))
import golden_data

F16 = torch.float16


def autocast():
    return torch.autocast("cpu", dtype=F16)


class Gated(nn.Module):
    """A T5-style gated feed-forward: ``wo(gelu(wi_0(x)) * wi_1(x))``."""

    def __init__(self, d: int = 8, ff: int = 16) -> None:
        super().__init__()
        self.wi_0, self.wi_1, self.wo = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False), nn.Linear(ff, d)

    def forward(self, x):
        return self.wo(F.gelu(self.wi_0(x)) * self.wi_1(x))


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = Gated(d)

    def forward(self, x):
        return x + self.ff(self.norm(x))


class Net(nn.Module):
    def __init__(self, d: int = 8, blocks: int = 3, ckpt: bool | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(blocks)])
        self.head = nn.Linear(d, 1)
        self.ckpt = ckpt

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.ckpt) if self.ckpt is not None else block(x)
        return self.head(x)


def make_net(seed: int = 0, **kwargs) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def batch(seed: int = 1, n: int = 4, d: int = 8) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def closure_for(model: nn.Module, x: torch.Tensor, loss=lambda y: y.float().mean()):
    def closure():
        with autocast():
            return loss(model(x))

    return closure


def plant_gate_overflow(model: Net, block: int = 1) -> None:
    """The gated product of one block passes 65504 (each factor stays finite); wo brings it back down."""
    ff = model.blocks[block].ff
    with torch.no_grad():
        ff.wi_0.weight.mul_(250.0)
        ff.wi_1.weight.mul_(250.0)
        ff.wo.weight.mul_(1e-4)


# kinds ----------------------------------------------------------------------------------------------------------


def test_none_on_a_healthy_batch_with_the_oracle_max_safe_scale():
    model, x = make_net(), batch()
    report = find_overflow(model, closure_for(model, x), scale=2.0**10)
    assert report.kind == "none" and report.module is None and not report.nan
    assert report.scale == 2.0**10
    assert report.max_safe_scale == oracle_max_safe_scale(model, x) == 2.0**15
    assert find_overflow(model, closure_for(model, x)).kind == "backward"  # at the default 2**16
    assert [r.module for r in report.records] == [n for n, m in model.named_modules() if n != "blocks"]
    assert "nothing was non-finite" in str(report)


def test_input_inf_and_nan():
    model, x = make_net(), batch()
    x[2, 3] = float("inf")
    report = find_overflow(model, closure_for(model, x))
    assert (report.kind, report.module, report.nan, report.max_safe_scale) == ("input", "", False, None)
    x[2, 3] = float("nan")
    assert find_overflow(model, closure_for(model, x)).nan


def test_forward_names_the_linear_inside_a_nested_block_not_its_parents_or_successors():
    model, x = make_net(), batch()
    with torch.no_grad():
        model.blocks[1].ff.wi_1.weight.mul_(1e5)
    report = find_overflow(model, closure_for(model, x))
    assert (report.kind, report.module, report.call) == ("forward", "blocks.1.ff.wi_1", None)
    assert report.max_safe_scale is None and "keep_float32" in report.advice
    row = next(r for r in report.records if r.module == "blocks.1.ff.wi_1")
    assert math.isinf(row.output_max) and row.input_max < 65504 and row.output_dtype == "float16"


def test_forward_names_the_module_whose_own_code_overflowed_not_its_children():
    model, x = make_net(), batch()
    plant_gate_overflow(model)
    report = find_overflow(model, closure_for(model, x))
    assert (report.kind, report.module) == ("forward", "blocks.1.ff")
    rows = {r.module: r for r in report.records}
    assert rows["blocks.1.ff.wi_0"].output_max < 65504 and rows["blocks.1.ff.wi_1"].output_max < 65504


class Twice(nn.Module):
    """One Linear called twice: the first call is fine, the second passes 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(4) * 300)

    def forward(self, x):
        return self.proj(self.proj(x)).sum(-1)


def test_a_module_called_twice_names_the_call_that_overflowed():
    model = Twice()
    report = find_overflow(model, closure_for(model, torch.ones(2, 4)))
    assert (report.kind, report.module, report.call, report.calls) == ("forward", "proj", 1, 2)
    assert "call 2 of 2" in str(report)
    assert [r.call for r in report.records if r.module == "proj"] == [0, 1]


def test_loss_that_overflows_in_its_own_computation():
    model, x = make_net(), batch()
    report = find_overflow(model, closure_for(model, x, loss=lambda y: (y * 1000).pow(2).sum()))
    assert (report.kind, report.module, report.max_safe_scale) == ("loss", None, None)
    assert all(r.output_max is not None and math.isfinite(r.output_max) for r in report.records)
    assert "float32" in report.advice


class Amplifier(nn.Module):
    """Finite forward; its backward multiplies the gradient by 800 on the way to its input."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.amp = nn.Linear(8, 8)
        with torch.no_grad():
            self.amp.weight.fill_(100.0)

    def forward(self, x):
        return self.amp(torch.tanh(self.inp(x)))


def test_backward_only_overflow_names_the_module_and_bounds_the_scale():
    torch.manual_seed(0)
    model, x = Amplifier(), batch()
    closure = closure_for(model, x)
    report = find_overflow(model, closure)
    assert (report.kind, report.module) == ("backward", "amp")
    assert all(r.output_max is not None and math.isfinite(r.output_max) for r in report.records)
    assert report.max_safe_scale == oracle_max_safe_scale(model, x) < 2.0**16
    assert find_overflow(model, closure, scale=report.max_safe_scale).kind == "none"
    assert find_overflow(model, closure, scale=2 * report.max_safe_scale).kind == "backward"


def test_max_safe_scale_below_one_when_even_an_unscaled_backward_overflows():
    torch.manual_seed(0)
    model, x = Amplifier(), batch()
    with torch.no_grad():
        model.inp.weight.mul_(1e-6)
        model.inp.bias.zero_()
        model.amp.weight.fill_(3e4)  # forward: 3e4 * 8 * 1e-6; backward: 64 * 3e4 * 8 per unit of the loss
    loss = lambda y: y.float().sum() * 64  # noqa: E731
    assert find_overflow(model, closure_for(model, x, loss=loss)).module is None  # 64 * 2**16: the loss's backward
    report = find_overflow(model, closure_for(model, x, loss=loss), scale=1.0)
    assert (report.kind, report.module) == ("backward", "amp")
    assert report.max_safe_scale == oracle_max_safe_scale(model, x, loss) < 1
    assert "exploding gradients" in report.advice


def oracle_max_safe_scale(model: nn.Module, x: torch.Tensor, loss=lambda y: y.float().mean()) -> float | None:
    """Brute force: the largest 2**k whose backward leaves every parameter's gradient finite (a fresh copy per k)."""
    best = None
    for k in range(-30, 40):
        m = copy.deepcopy(model)
        (closure_for(m, x, loss)().float() * 2.0**k).backward()
        if all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None):
            best = 2.0**k
    return best


# model state ----------------------------------------------------------------------------------------------------


def hook_count(model: nn.Module) -> int:
    n = 0
    for m in model.modules():
        n += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        n += len(m._forward_hooks_with_kwargs) + len(m._forward_pre_hooks_with_kwargs)
    for p in model.parameters():
        n += len(p._backward_hooks or {})
    return n


@pytest.mark.parametrize("plant", ["none", "forward", "backward"])
def test_the_model_and_optimizer_are_left_as_found(plant):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8),
        nn.BatchNorm1d(8),
        nn.Dropout(0.5),
        Amplifier() if plant == "backward" else nn.Linear(8, 8),
        nn.Linear(8, 1),
    )
    x = batch(n=6)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with autocast():
        model(x).float().mean().backward()
    opt.step()
    if plant == "forward":
        with torch.no_grad():
            model[3].weight.mul_(1e5)
    model[0].weight.grad = None  # a mix: one None, the rest accumulated values
    model[4].eval()
    grads = {n: p.grad for n, p in model.named_parameters()}
    grad_values = {n: None if g is None else g.clone() for n, g in grads.items()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    modes = [m.training for m in model.modules()]
    opt_state = copy.deepcopy(opt.state_dict())
    hooks = hook_count(model)
    rng = torch.get_rng_state()

    report = find_overflow(model, closure_for(model, x), scale=2.0**4 if plant == "none" else 2.0**16)
    assert report.kind == plant

    assert torch.equal(torch.get_rng_state(), rng)
    assert hook_count(model) == hooks
    assert [m.training for m in model.modules()] == modes
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
        assert p.grad is grads[n], n
        if grad_values[n] is not None:
            assert torch.equal(p.grad, grad_values[n]), n
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    assert _same(opt.state_dict(), opt_state)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a == b


def test_dropout_draws_the_masks_the_next_real_forward_draws():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    x = batch()
    seen = []
    model[1].register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    find_overflow(model, closure_for(model, x))
    closure_for(model, x)()
    assert torch.equal(seen[0], seen[1])


def test_gradients_of_tensors_outside_the_model_are_left_as_found():
    model, x = make_net(), batch()
    extra = torch.ones((), requires_grad=True)
    extra.grad = torch.full((), 5.0)
    grad = extra.grad
    find_overflow(model, closure_for(model, x, loss=lambda y: y.float().mean() * extra))
    assert extra.grad is grad and extra.grad.item() == 5.0


# structures -----------------------------------------------------------------------------------------------------


class TupleDict(nn.Module):
    """A child returning a tuple, one returning a dict; the dict's second entry overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.pair = PairOut()
        self.named = DictOut()

    def forward(self, x):
        a, b = self.pair(x)
        out = self.named(a + b)
        return out["small"] + out["big"].clamp(-1, 1)


class PairOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y, y * 2


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return {"small": y, "big": y * 1e5}


def test_tuple_and_dict_outputs():
    torch.manual_seed(0)
    model = TupleDict()
    report = find_overflow(model, closure_for(model, batch()))
    assert (report.kind, report.module) == ("forward", "named")
    rows = {r.module: r for r in report.records}
    assert math.isfinite(rows["pair"].output_max) and math.isinf(rows["named"].output_max)


def test_modules_without_parameters_are_traced():
    model = nn.Sequential(nn.Identity(), nn.ReLU(), nn.Softmax(-1))
    x = batch().requires_grad_()
    report = find_overflow(model, lambda: model(x).sum() * 1e37, scale=2.0**10)
    assert report.kind == "backward" and report.module is None  # the loss's own backward: 1e37 * 2**10 is inf
    assert [r.module for r in report.records] == ["", "0", "1", "2"]


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def test_tied_weights_blame_the_holder_that_ran_last_and_restore_the_shared_grad():
    torch.manual_seed(0)
    model = Tied()
    ids = torch.randint(0, 16, (64, 32), generator=torch.Generator().manual_seed(0))
    model.embed.weight.grad = torch.ones(16, 8)
    grad = model.embed.weight.grad
    closure = closure_for(model, ids, loss=lambda y: y.float().logsumexp(-1).sum())
    report = find_overflow(model, closure)
    assert report.kind == "backward" and report.module == "head"
    assert model.head.weight.grad is grad and torch.equal(grad, torch.ones(16, 8))
    assert find_overflow(model, closure, scale=report.max_safe_scale).kind == "none"


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_is_not_a_new_call(reentrant):
    plain, x = make_net(), batch()
    ckpt = make_net(ckpt=reentrant)
    for model in (plain, ckpt):
        plant_gate_overflow(model)
    a, b = find_overflow(plain, closure_for(plain, x)), find_overflow(ckpt, closure_for(ckpt, x))
    assert (b.kind, b.module, b.call) == (a.kind, a.module, a.call) == ("forward", "blocks.1.ff", None)
    assert [(r.module, r.call) for r in b.records] == [(r.module, r.call) for r in a.records]
    torch.manual_seed(0)
    healthy = [make_net(), make_net(ckpt=reentrant)]
    for model in healthy:
        with torch.no_grad():
            model.head.weight.mul_(200.0)  # a backward overflow at the head's input gradient
    a, b = (find_overflow(m, closure_for(m, x), scale=2.0**20) for m in healthy)
    assert (b.kind, b.module, b.max_safe_scale) == (a.kind, a.module, a.max_safe_scale)
    assert a.kind == "backward"
    assert [(r.module, r.call) for r in b.records] == [(r.module, r.call) for r in a.records]
    assert all(r.grad_max is not None for r in b.records if r.module.startswith("blocks."))


# keep_float32 ---------------------------------------------------------------------------------------------------


def test_keep_float32_fixes_the_forward_overflow_on_the_same_batch_and_undoes():
    model, x = make_net(), batch()
    plant_gate_overflow(model)
    closure = closure_for(model, x)
    assert find_overflow(model, closure).module == "blocks.1.ff"
    forward = model.blocks[1].ff.forward
    handle = keep_float32(model.get_submodule("blocks.1.ff"))
    fixed = find_overflow(model, closure, scale=2.0**10)
    assert fixed.kind == "none"
    row = next(r for r in fixed.records if r.module == "blocks.1.ff")
    assert row.output_dtype == "float16"  # what autocast gives the wrapped Linear
    assert next(r for r in fixed.records if r.module == "blocks.1.ff.wo").output_dtype == "float32"
    handle.remove()
    handle.remove()
    assert "forward" not in model.blocks[1].ff.__dict__ and model.blocks[1].ff.forward == forward
    assert find_overflow(model, closure).module == "blocks.1.ff"


def test_keep_float32_outputs_and_without_autocast():
    layer = nn.Linear(4, 4)
    with keep_float32(layer, outputs="float32"), autocast():
        assert layer(torch.ones(2, 4)).dtype == torch.float32
    with keep_float32(layer):
        assert layer(torch.ones(2, 4, dtype=torch.float16)).dtype == torch.float16  # the input's dtype
        assert layer(torch.ones(2, 4)).dtype == torch.float32
    assert "forward" not in layer.__dict__


def test_bad_arguments_name_the_parameter():
    model = make_net()
    with pytest.raises(TypeError, match=r"find_overflow\(model=.*model must be a torch.nn.Module"):
        find_overflow("net", lambda: None)
    with pytest.raises(TypeError, match="closure must be a callable"):
        find_overflow(model, 3)
    with pytest.raises(ValueError, match="scale must be"):
        find_overflow(model, closure_for(model, batch()), scale=-1.0)
    with pytest.raises(TypeError, match=r"closure\(\) must return the loss as a tensor; got float"):
        find_overflow(model, lambda: 1.0)
    with pytest.raises(ValueError, match="one loss value"):
        find_overflow(model, lambda: model(batch()))
    with pytest.raises(ValueError, match="does not require grad"):
        find_overflow(model, lambda: torch.zeros(()))

    def calls_backward():
        loss = model(batch()).mean()
        loss.backward()
        return loss

    with pytest.raises(ValueError, match="without calling backward"):
        find_overflow(model, calls_backward)
    assert all(p.grad is None for p in model.parameters()) and hook_count(model) == 0
    with pytest.raises(TypeError, match=r"module must be a torch\.nn\.Module"):
        keep_float32(lambda x: x)
    with pytest.raises(ValueError, match="outputs"):
        keep_float32(model, outputs="half")
    with pytest.raises(TypeError, match=r"model must be the torch\.nn\.Module"):
        OverflowDiagnosis(None)
    with pytest.raises(ValueError, match="patience"):
        OverflowDiagnosis(model, patience=0)


def test_report_prints_and_plots(tmp_path):
    model, x = make_net(), batch()
    plant_gate_overflow(model)
    report = find_overflow(model, closure_for(model, x))
    text = str(report)
    assert "forward overflow" in text and "'blocks.1.ff' (Gated)" in text and "<--" in text
    assert report.log_fields() == {"overflow_kind": "forward", "overflow_module": "blocks.1.ff"}
    import pickle

    warning = pickle.loads(pickle.dumps(OverflowWarning("message", report)))
    assert str(warning) == "message" and str(warning.report) == str(report)
    pytest.importorskip("matplotlib", reason="report.plot needs matplotlib (the demo extra)")
    report.plot(tmp_path / "magnitudes.png")
    assert (tmp_path / "magnitudes.png").stat().st_size > 1000


# the add-on: a hand-written front end calls its hooks ---------------------------------------------------------


class TinyFrontEnd:
    """What a front end does around its add-ons, in their order: show the loss (``on_loss``), scale it, backward,
    check and unscale without a host read, a masked SGD step, the policy's update, ``after_step``."""

    def __init__(self, model: nn.Module, policy, addon: OverflowDiagnosis, lr: float = 1e-3) -> None:
        from lossscale.addons.base import FrontEnd
        from lossscale.state import LossScale

        self.model, self.policy, self.addon, self.lr = model, policy, addon, lr
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.state = policy.init()
        self.steps = 0
        addon.attach(FrontEnd("TinyFrontEnd", LossScale(policy), tuple(self.params)))

    def step(self, x: torch.Tensor, reads: list[int] | None = None) -> torch.Tensor:
        """One training step; where ``reads`` is given, the host reads inside the add-on's hooks are appended."""
        with autocast():
            loss = self.model(x).float().pow(2).mean()
        scale = self.state.scale
        scaled = loss * scale
        with HostReadCounter() as counter:
            self.addon.on_loss(loss, True)
        if reads is not None:
            reads.append(counter.count)
        scaled.backward()
        grads = [p.grad for p in self.params]
        found = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, scale.reciprocal().reshape(1))
        found_inf = found.reshape(()) > 0
        with torch.no_grad():
            for p, g in zip(self.params, grads):
                p.sub_(torch.where(found_inf, torch.zeros_like(g), g * self.lr))
                p.grad = None
        self.state = self.policy.update(self.state, found_inf.float())
        outcome = StepOutcome(~found_inf, found_inf, scale, self.state.scale, self.steps)
        self.steps += 1
        with HostReadCounter() as counter:
            self.addon.after_step(outcome)
        if reads is not None:
            reads.append(counter.count)
        return found_inf


def healthy_batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 8, generator=g) for _ in range(n)]


@pytest.mark.parametrize(
    "policy",
    [presets.megatron(), presets.torch_amp(growth_interval=10), presets.deepspeed(scale_window=10)],
    ids=["megatron", "torch", "deepspeed"],
)
def test_healthy_runs_never_fire_and_make_no_host_read(policy):
    model = make_net()
    addon = OverflowDiagnosis(model)
    front = TinyFrontEnd(model, policy, addon)
    overflows = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x in healthy_batches(150):
            reads: list[int] = []
            overflows.append(bool(front.step(x, reads)))
            assert not addon.tracing
            assert reads == [0, 0]
    assert addon.last_report is None and hook_count(model) == 0
    assert sum(overflows) >= 3  # the search down from the initial scale, and overflows after growth, happened
    if isinstance(policy, DynamicScale) and policy.init_scale == 2.0**32:
        assert overflows[:12] == [True] * 12  # Megatron's search from 2**32 outlasts no patience: it has no clean step


def test_a_persistent_fault_fires_within_the_bound_once_per_cause():
    model = make_net()
    addon = OverflowDiagnosis(model, patience=8)
    front = TinyFrontEnd(model, presets.torch_amp(init_scale=2.0**10, growth_interval=50), addon)
    batches = healthy_batches(120)
    for x in batches[:20]:
        front.step(x)
    with torch.no_grad():
        model.blocks[1].ff.wi_1.weight.mul_(1e5)  # every later forward overflows there
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fired_at = None
        for i, x in enumerate(batches[20:80]):
            front.step(x)
            if caught and fired_at is None:
                fired_at = i
    assert fired_at is not None and fired_at <= 8 + 1  # patience overflows, then the traced step
    assert len(caught) == 1 and issubclass(caught[0].category, OverflowWarning)
    report = caught[0].message.report
    assert isinstance(report, OverflowReport)
    assert addon.last_report.log_fields() == report.log_fields()  # traced again as the fault went on: same cause
    assert (report.kind, report.module) == ("forward", "blocks.1.ff.wi_1")
    assert addon.log_fields == {"overflow_kind": "forward", "overflow_module": "blocks.1.ff.wi_1"}
    assert "blocks.1.ff.wi_1" in str(caught[0].message) and "keep_float32" in str(caught[0].message)
    assert hook_count(model) == 0 or addon.tracing
    # a second, distinct cause is reported once more: the weights fixed, the data now holds an inf
    with torch.no_grad():
        model.blocks[1].ff.wi_1.weight.mul_(1e-5)
    bad = [x.clone().index_fill_(0, torch.tensor([0]), float("inf")) for x in batches[80:110]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in bad:
            front.step(x)
    assert [(w.message.report.kind, w.message.report.module) for w in caught] == [("input", "")]
    addon.remove()
    assert hook_count(model) == 0


def test_the_traced_step_is_the_users_next_step_and_hooks_go_away():
    model = make_net()
    plant_gate_overflow(model)
    addon = OverflowDiagnosis(model, patience=2, initial_limit=2)
    front = TinyFrontEnd(model, presets.torch_amp(init_scale=2.0**10), addon)
    calls = []
    model.blocks[1].ff.register_forward_hook(lambda *a: calls.append(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        front.step(batch(n=16))
        assert not addon.tracing
        front.step(batch(n=16))
        assert not addon.tracing  # fired at this after_step, published to the host, acted on at the next one
        front.step(batch(n=16))
        assert addon.tracing  # the hooks are on for the next step
        assert len(calls) == 3
        front.step(batch(n=16))
        assert not addon.tracing and len(calls) == 4  # traced, nothing re-run
    assert len(caught) == 1 and caught[0].message.report.module == "blocks.1.ff"
    assert hook_count(model) == 1  # only the test's own hook


def test_the_warning_names_the_rank_under_torch_distributed(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = make_net()
        plant_gate_overflow(model)
        addon = OverflowDiagnosis(model, patience=1, initial_limit=1)
        front = TinyFrontEnd(model, presets.torch_amp(init_scale=1.0), addon)
        with pytest.warns(OverflowWarning, match=r"^rank 0: ") as caught:
            for _ in range(3):
                front.step(batch(n=16))
        assert caught[0].message.report.rank == 0 and str(caught[0].message.report).startswith("[rank 0]")
    finally:
        dist.destroy_process_group()


# the trigger over the recorded golden trajectories -----------------------------------------------------------

#: Recorded sequences that ARE persistent faults: every step overflows from the start (all_overflow, the MindSpore
#: manager's 1100 in a row, nnabla's retry budget), or the scale itself reached inf and every later step overflowed
#: by itself (paddle's natural overflows: the real framework records them as overflows).
PERSISTENT = ("all_overflow", "many_overflows", "retry_limit")


def golden_cases():
    for peer in golden_data.peers():
        doc = golden_data.load(peer)
        for key in ("cases", "manager_cases"):
            for case in doc.get(key, []):
                yield f"{peer}/{case['name']}", case


def replay(cases, patience: int = 16, initial_limit: int = 128) -> dict[str, int | None]:
    """Every case through advance_trigger at once (element-wise): the first step at which each fired, or None."""
    names = [name for name, _ in cases]
    length = max(len(c["overflow"]) for _, c in cases)
    over = torch.zeros(len(cases), length, dtype=torch.bool)
    scale = torch.ones(len(cases), length, dtype=torch.float64)
    alive = torch.zeros(len(cases), length, dtype=torch.bool)
    for i, (_, c) in enumerate(cases):
        n = len(c["overflow"])
        over[i, :n] = torch.tensor([bool(v) for v in c["overflow"]])
        scale[i, :n] = torch.tensor([float(v) for v in c["scale_after"][:n]], dtype=torch.float64)
        alive[i, :n] = True
    state = TriggerState.init()
    state = TriggerState(*(t.expand(len(cases)).clone() for t in state))
    first: dict[str, int | None] = dict.fromkeys(names)
    for step in range(length):
        before = state.fired.clone()
        state = advance_trigger(
            state, over[:, step] & alive[:, step], scale[:, step], patience=patience, initial_limit=initial_limit
        )
        state = state._replace(fired=state.fired & (alive[:, step] | before))
        for i in torch.nonzero(state.fired & ~before).flatten().tolist():
            first[names[i]] = step
    return first


def test_the_trigger_never_fires_on_the_golden_trajectories_except_persistent_faults():
    cases = list(golden_cases())
    first = replay(cases)
    natural = {name for name, c in cases if c.get("natural_overflow")}
    fired = {name for name, step in first.items() if step is not None}
    expected = {name for name, _ in cases if any(p in name for p in PERSISTENT)}
    assert fired - natural == expected
    for name, c in cases:
        if name in expected:
            ov = c["overflow"]
            start = next(i for i, v in enumerate(ov) if v)
            assert first[name] - start < 128, name  # the bound from the start: initial_limit


def test_the_trigger_bound():
    """A fault overflowing every step fires at the patience-th overflow after a clean step; from the first step, as
    soon as the scale is down to 1 (torch's 2**16: the 16th; Megatron's 2**32 with hysteresis 2: the 33rd), or at
    initial_limit where the scale stays above 1."""

    def first_fire(policy, clean: int, steps: int = 300):
        state, trig = policy.init(), TriggerState.init()
        for i in range(steps):
            found = torch.tensor(1.0 if i >= clean else 0.0)
            state = policy.update(state, found)
            trig = advance_trigger(trig, found, state.scale, patience=16, initial_limit=128)
            if trig.fired:
                return i - clean + 1
        return None

    assert first_fire(presets.torch_amp(), clean=5) == 16
    assert first_fire(presets.torch_amp(), clean=0) == 16
    assert first_fire(presets.megatron(), clean=0) == 33
    assert first_fire(presets.megatron(min_scale=3.0), clean=0) == 128
    assert first_fire(presets.megatron(), clean=1) == 16


def test_healthy_steps_through_the_addon_on_golden_sequences_make_no_host_read():
    """The add-on itself (not just the rule) on recorded sequences: no trace, no warning, no host read."""
    cases = dict(golden_cases())
    for name in ("megatron/random_p0.5-default", "deepspeed/bursts-w1_h1_noncons", "keras/periodic-default"):
        case = cases[name]
        addon = OverflowDiagnosis(nn.Linear(2, 2))
        with HostReadCounter() as reads:
            for i, (ov, s) in enumerate(zip(case["overflow"], case["scale_after"])):
                s = torch.tensor(min(float(s), 3e38))
                addon.after_step(StepOutcome(torch.tensor(not ov), torch.tensor(bool(ov)), s, s, i))
                assert not addon.tracing, (name, i)
        assert reads.count == 0, name


# through the front ends' diagnose= ------------------------------------------------------------------------------


def _front_end_run(front: str, diagnose: bool, steps: int = 60, fault_at: int = 20):
    """Host reads per step and the warnings of a run of ``front`` (diagnose=model or None); from ``fault_at`` on,
    one Linear's output passes 65504 at every step."""
    from lossscale import GradScaler, LossScaleOptimizer

    model = make_net()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    target = model if diagnose else None
    if front == "LossScaleOptimizer":
        opt = LossScaleOptimizer(sgd, policy=DynamicScale(init_scale=2.0**10, growth_interval=50), diagnose=target)
    else:
        scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=50, diagnose=target)
    reads: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, x in enumerate(healthy_batches(steps)):
            if i == fault_at:
                with torch.no_grad():
                    model.blocks[1].ff.wi_1.weight.mul_(1e5)
            with autocast():
                loss = model(x).float().pow(2).mean()
            with HostReadCounter() as counter:
                scaled = opt.scale_loss(loss) if front == "LossScaleOptimizer" else scaler.scale(loss)
            scaled.backward()
            with HostReadCounter() as step_counter:
                if front == "LossScaleOptimizer":
                    opt.step()
                else:
                    scaler.step(sgd)
                    scaler.update()
            sgd.zero_grad()
            reads.append(counter.count + step_counter.count)
    return reads, [w for w in caught if issubclass(w.category, OverflowWarning)], model


@pytest.mark.parametrize("front", ["LossScaleOptimizer", "GradScaler"])
def test_diagnose_through_the_front_ends_adds_no_host_read_and_warns(front):
    reads, found, _ = _front_end_run(front, diagnose=True)
    plain_reads, none, _ = _front_end_run(front, diagnose=False)
    assert reads[:20] == plain_reads[:20]  # healthy steps: diagnose= adds no host read
    assert not none and len(found) == 1
    report = found[0].message.report
    assert (report.kind, report.module) == ("forward", "blocks.1.ff.wi_1")
    # the loss is non-finite from step 20: the trigger fires at its second (21), is acted on one step later (22),
    # and the step after is traced; the message says which trigger fired
    assert "the loss was non-finite 2 steps in a row; the traced step 23 found" in str(found[0].message)


def test_plot_without_matplotlib_names_the_demo_extra(monkeypatch, tmp_path):
    model = make_net()
    report = find_overflow(model, closure_for(model, batch()), scale=2.0**10)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"needs matplotlib: pip install matplotlib, or .*pip install '\.\[demo\]'"):
        report.plot(tmp_path / "x.png")


def test_keep_float32_removed_under_a_later_wrapper_passes_calls_through():
    layer = nn.Linear(4, 4)
    handle = keep_float32(layer, outputs="float32")
    inner = layer.forward
    layer.forward = lambda x: inner(x)  # someone wraps the forward after us
    handle.remove()
    with autocast():
        assert layer(torch.ones(1, 4)).dtype == torch.float16  # autocast applies again


@pytest.mark.parametrize("run", ["fp16-dynamic", "fp16-predictive", "fp16-noscale"])
def test_the_demos_float16_runs_never_fire(run, monkeypatch):
    """The demo's quick float16 runs (the dynamic one searches down from 2**32 first) with diagnose=model added."""
    from lossscale.demo import train as demo

    made: list[nn.Module] = []
    addons: list[OverflowDiagnosis] = []

    class Model(demo.CharTransformer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    class Optimizer(demo.LossScaleOptimizer):
        def __init__(self, *args, **kwargs):
            addons.append(OverflowDiagnosis(made[-1]))
            super().__init__(*args, add_ons=[addons[-1]], **kwargs)

    monkeypatch.setattr(demo, "CharTransformer", Model)
    monkeypatch.setattr(demo, "LossScaleOptimizer", Optimizer)
    cfg = dataclasses.replace(demo.QUICK, steps=30)
    seen: list[bool] = []
    result = demo.train_run(run, cfg, on_step=lambda applied, row: seen.append(addons[0].tracing))
    assert not any(seen) and addons[0].last_report is None and hook_count(made[0]) == 0
    if run == "fp16-dynamic":
        assert result["skipped_steps"] > 0  # the search down from 2**32 (6 overflows in a row here)
