"""The step pipeline and the one owner of the scale, seen from the front ends and from outside.

LossScaleOptimizer is a real torch optimizer view (hooks, schedulers, keyword-only options with the old
spellings deprecated, ``step(closure)``); its state survives a proxy that copies ``__dict__`` (as
Lightning's LightningOptimizer does); a scale set through one holder is what every holder reads.
"""

from __future__ import annotations

import doctest
import importlib
import warnings

import pytest
import torch

from lossscale import DynamicScale, FixedScale, GradScaler, LossScale, LossScaleOptimizer
from lossscale import stages
from lossscale.compat import ascend, mindspore

from _noting_policy import NotingScale


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _backward(opt: LossScaleOptimizer, model: torch.nn.Module, poison: bool = False) -> torch.Tensor:
    loss = model(torch.ones(3, 4)).pow(2).sum()
    if poison:
        loss = loss * torch.tensor(float("inf"))
    opt.backward(loss)
    return loss


def test_step_hooks_run_around_the_step():
    model = _model()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=FixedScale(8.0))
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", o is opt)))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", o is opt)))
    _backward(opt, model)
    opt.step()
    assert seen == [("pre", True), ("post", True)]


def test_step_hooks_run_in_torchs_order_with_torchs_arguments():
    """Global and own pre hooks, the step (the inner optimizer's own hooks inside), own and global post hooks;
    a pre hook's (args, kwargs) replace the call's, args starting with the optimizer (torch's wrapper)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    model = _model()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=FixedScale(8.0))
    seen = []

    def closure():
        _backward(opt, model)
        return "replaced"
    opt.register_step_pre_hook(lambda o, args, kwargs: (seen.append(("pre", args[0] is o, len(args))),
                                                         ((o, closure), {}))[1])
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", args[1] is closure)))
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: seen.append(("global pre", type(o).__name__))),
               register_optimizer_step_post_hook(lambda o, a, k: seen.append(("global post", type(o).__name__)))]
    try:
        result = opt.step()
    finally:
        for handle in handles:
            handle.remove()
    assert result.loss == "replaced"
    assert seen == [("global pre", "LossScaleOptimizer"), ("pre", True, 1), ("global pre", "SGD"),
                    ("global post", "SGD"), ("post", True), ("global post", "LossScaleOptimizer")]


def test_a_step_pre_hook_that_returns_something_else_is_refused_as_torch_refuses_it():
    model = _model()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=FixedScale(8.0))
    opt.register_step_pre_hook(lambda o, args, kwargs: "not a pair")
    _backward(opt, model)
    with pytest.raises(RuntimeError, match="must return None or a tuple of \\(new_args, new_kwargs\\)"):
        opt.step()


def test_state_dict_hooks_run_and_may_rewrite():
    model = _model()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": 7})
    loaded = []
    opt.register_load_state_dict_post_hook(lambda o: loaded.append(True))
    saved = opt.state_dict()
    assert saved["tag"] == 7
    opt.load_state_dict(saved)
    assert loaded == [True]


def test_param_groups_state_and_defaults_are_the_inner_optimizers():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = LossScaleOptimizer(inner)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _backward(opt, model)
    opt.step()
    sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)


def test_options_after_the_optimizer_are_keyword_only():
    model = _model()
    with pytest.raises(TypeError):
        LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), FixedScale(4.0))


def test_step_with_a_closure_runs_it_first_and_reports_its_loss():
    model = _model()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=FixedScale(8.0))
    calls = []

    def closure() -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        return _backward(opt, model)

    with torch.no_grad():
        result = opt.step(closure)
    assert calls == [True] and bool(result.stepped) and result.loss is not None and result.loss.requires_grad


def test_a_step_without_gradients_raises_and_changes_nothing():
    model = _model()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=DynamicScale(init_scale=1024.0,
                                                                                                growth_interval=1))
    with pytest.raises(stages.NoGradientsError, match="No inf checks were recorded"):
        opt.step()
    assert float(opt.scale) == 1024.0


def test_float16_parameters_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match=r"param_groups\[0\]\[0\] is a float16 parameter.*autocast"):
        LossScaleOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))], lr=0.1))


def _proxy(opt: LossScaleOptimizer):
    """A proxy built as Lightning's LightningOptimizer is: a generated subclass, ``__dict__`` copied."""

    class Wrapper:
        pass

    cls = type("Lightning" + type(opt).__name__, (Wrapper, type(opt)), {})
    proxy = Wrapper.__new__(cls)
    proxy.__dict__ = {k: v for k, v in opt.__dict__.items() if k not in ("step", "__del__")}
    return proxy


def test_a_dict_copying_proxy_loses_no_state():
    model = _model()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=DynamicScale(init_scale=1024.0),
                             accumulation_steps=2)
    proxy = _proxy(opt)
    proxy.set_scale(64.0)
    assert float(opt.scale) == 64.0
    _backward(proxy, model)
    proxy.step()  # the first micro-batch: the position is shared
    assert opt._run.micro == 1
    _backward(opt, model, poison=True)
    result = opt.step()
    assert bool(result.found_inf) and proxy.last_result is result and float(proxy.scale) == 32.0


def test_one_owner_ascend_manager_and_optimizer_see_the_same_scale_at_once():
    model = _model()
    manager = ascend.ExponentialUpdateLossScaleManager(init_loss_scale=1024, incr_every_n_steps=100)
    opt = ascend.NPULossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), manager)
    opt.set_scale(64)
    assert float(manager.get_loss_scale()) == 64.0 == float(opt.get_loss_scale())
    assert opt.loss_scale is manager.loss_scale
    manager.update_loss_scale(True)
    assert float(opt.scale) == 64.0


def test_one_owner_mindspore_cell_and_train_cell_share_the_scale():
    model = _model()
    cell = mindspore.DynamicLossScaleUpdateCell(loss_scale_value=2**12, scale_factor=2, scale_window=100)
    train = mindspore.TrainOneStepWithLossScaleCell(lambda x: model(x).sum(), torch.optim.SGD(model.parameters(),
                                                                                            lr=0.1), cell)
    train.set_sense_scale(torch.tensor(256.0))
    assert float(cell.loss_scale.scale) == 256.0 == float(train.scale_sense)


def test_gradscaler_private_scale_is_a_validated_door():
    scaler = GradScaler(init_scale=1024.0)
    scaler.scale(torch.ones(()))
    scaler._scale = torch.tensor(32.0)
    assert scaler.get_scale() == 32.0 and scaler.loss_scale.scale is scaler._scale
    with pytest.raises(ValueError, match=r"GradScaler\._scale = tensor\(0\.\)"):
        scaler._scale = torch.tensor(0.0)
    assert scaler.get_scale() == 32.0


def test_a_loss_scale_can_be_shared_by_two_optimizers():
    model = _model()
    owner = LossScale(DynamicScale(init_scale=512.0))
    a = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=owner)
    b = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=owner)
    a.set_scale(8.0)
    assert float(b.scale) == 8.0


@pytest.mark.parametrize("scale, refused", [(0.0, True), (-1.0, True), (float("nan"), True), (float("inf"), True),
                                             (-float("inf"), True), (1e-40, True), (2.0**-128, True),
                                             (2.0**-127, False), (2.0**-126, False), (1.0, False), (65536.0, False),
                                             (3.4028234663852886e38, False)])
def test_guard_turns_a_corrupted_scale_into_an_overflow_and_never_a_non_finite_inverse(scale, refused):
    found = stages.guarded_found(torch.tensor(scale))
    inv = stages.inverse_(torch.tensor(scale), found)
    assert found.dtype == torch.float32 and found.dim() == 0 and float(found) == float(refused)
    assert float(inv) == 1.0 if refused else float(inv) == float(torch.tensor(scale).double().reciprocal().float())
    assert 0 < float(inv) < float("inf")


DOCTESTED = ["lossscale.policies.base", "lossscale.policies.dynamic", "lossscale.policies.presets", "lossscale.policies.predictive", "lossscale.reporting",
             "lossscale.state", "lossscale.checks", "lossscale.compat.ascend", "lossscale.compat.mindspore",
             "lossscale.compat.nnabla", "lossscale.compat.keras"]


@pytest.mark.parametrize("name", DOCTESTED)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        failed, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failed == 0 and attempted > 0


@pytest.mark.parametrize("front_end", ["GradScaler", "LossScaleOptimizer"])
def test_a_non_finite_loss_reaches_policies_that_observe_it(front_end):
    """PredictiveScale treats an overflow with a NaN loss as a fault of the data, not of the scale: both front
    ends must tell it the loss was not finite, or it backs off."""
    from lossscale import PredictiveScale

    w = torch.nn.Parameter(torch.ones(4))
    sgd = torch.optim.SGD([w], lr=0.1)
    policy = PredictiveScale(init_scale=2.0**10)
    scaler = GradScaler(policy=policy) if front_end == "GradScaler" else None
    opt = None if scaler else LossScaleOptimizer(sgd, policy=policy)

    def one_step(factor: float) -> float:
        loss = (w * factor).sum()
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(sgd)
            scaler.update()
            sgd.zero_grad()
            return scaler.get_scale()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        return float(opt.scale)

    before = [one_step(2.0) for _ in range(3)][-1]
    assert one_step(float("nan")) == before
    assert torch.allclose(w.detach(), torch.full((4,), 0.4))  # three applied steps, the NaN one skipped


def test_takes_grad_scaler_is_decided_per_step_function():
    """Cached per function: a class whose step takes grad_scaler=, one whose step does not, and an instance
    whose step was replaced by a wrapper of its own all get their own answer, however often asked."""

    class Takes(torch.optim.SGD):
        def step(self, closure=None, grad_scaler=None):
            return super().step(closure)

    w = torch.nn.Parameter(torch.ones(2))
    takes, plain = Takes([w], lr=0.1), torch.optim.SGD([w], lr=0.1)
    wrapped = torch.optim.SGD([w], lr=0.1)
    wrapped.step = lambda closure=None, grad_scaler=None: None
    for _ in range(2):
        assert stages.takes_grad_scaler(takes) is True
        assert stages.takes_grad_scaler(plain) is False
        assert stages.takes_grad_scaler(wrapped) is True


def test_grouped_gradients_keep_each_groups_order_and_skip_missing_gradients():
    dtypes = [torch.float32, torch.float64, None, torch.float32, torch.bfloat16, torch.float32]
    params = [torch.nn.Parameter(torch.zeros(2, dtype=d or torch.float32)) for d in dtypes]
    for i, (p, d) in enumerate(zip(params, dtypes)):
        p.grad = None if d is None else torch.full_like(p, float(i))
    groups = stages.grouped_gradients(torch.optim.SGD(params, lr=1.0), "test")
    seen = {dtype: [int(g[0]) for g in grads] for (_, dtype), grads in groups.items()}
    assert seen == {torch.float32: [0, 3, 5], torch.float64: [1], torch.bfloat16: [4]}
    assert groups.plain and all(g.data_ptr() == params[int(g[0])].grad.data_ptr() for v in groups.values() for g in v)


def test_grouped_gradients_take_a_sparse_gradients_values_and_say_so():
    dense, sparse = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    dense.grad = torch.ones(3)
    sparse.grad = torch.sparse_coo_tensor([[1, 3]], [5.0, 6.0], (4,), check_invariants=True)
    groups = stages.grouped_gradients(torch.optim.SGD([dense, sparse], lr=1.0), "test")
    (grads,) = groups.values()
    assert not groups.plain and [g.tolist() for g in grads] == [[1.0, 1.0, 1.0], [5.0, 6.0]]


def test_grouped_gradients_refuse_float16_where_asked_and_raise_without_gradients():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    p.grad = torch.ones(2, dtype=torch.float16)
    assert stages.grouped_gradients(torch.optim.SGD([p], lr=1.0), "test")  # allowed by default
    with pytest.raises(ValueError, match="float16 gradients"):
        stages.grouped_gradients(torch.optim.SGD([p], lr=1.0), "test", allow_fp16=False)
    p.grad = None
    with pytest.raises(stages.NoGradientsError):
        stages.grouped_gradients(torch.optim.SGD([p], lr=1.0), "test")
    assert stages.grouped_gradients(torch.optim.SGD([p], lr=1.0), "test", required=False) == {}


def test_inverse_is_torchs_double_rounded_reciprocal_bit_for_bit():
    torch.manual_seed(0)
    bits = torch.randint(0x00800000, 0x7F7FFFFF, (4096,), dtype=torch.int32)  # normal positive float32
    scales = torch.cat([bits.view(torch.float32), 2.0 ** torch.arange(-126, 128, dtype=torch.float32)])
    for scale in scales:
        expected = scale.double().reciprocal().float()
        found = stages.guarded_found(scale)
        got = stages.inverse_(scale, found)
        assert got.view(torch.int32) == expected.view(torch.int32) and float(found) == 0.0, float(scale)


def _recorded_step_optimizer(skip_mode: str):
    model = _model()
    inner = (torch.optim.AdamW(model.parameters(), lr=0.1, fused=True) if skip_mode == "fused"
             else torch.optim.SGD(model.parameters(), lr=0.1))
    NotingScale.EVENTS = []
    opt = LossScaleOptimizer(inner, policy=NotingScale(init_scale=8.0, growth_interval=1), skip_mode=skip_mode)
    return model, inner, opt


@pytest.mark.parametrize("skip_mode", ["fused", "host"])
def test_an_inner_step_that_raises_leaves_the_scale_as_it_was(skip_mode):
    model, inner, opt = _recorded_step_optimizer(skip_mode)

    def fail(*_):
        raise RuntimeError("inner step failed")
    inner.register_step_pre_hook(fail)
    _backward(opt, model)
    before = opt.loss_scale.state_dict()
    with pytest.raises(RuntimeError, match="inner step failed"):
        opt.step()
    assert opt.loss_scale.state_dict() == before  # the clean step would have grown it to 16


@pytest.mark.parametrize("skip_mode", ["fused", "host"])
def test_a_scale_set_during_the_inner_step_is_what_the_policy_advances(skip_mode):
    model, inner, opt = _recorded_step_optimizer(skip_mode)
    inner.register_step_pre_hook(lambda *_: opt.loss_scale.set_scale(2.0))
    _backward(opt, model)
    opt.step()
    reference = LossScale(DynamicScale(init_scale=8.0, growth_interval=1))
    reference.set_scale(2.0)
    reference.update(torch.zeros(()))  # the order of effects before the policy moved: set, then advance
    assert opt.loss_scale.state_dict() == reference.state_dict()
    assert float(opt.loss_scale.scale) == 4.0


@pytest.mark.parametrize("skip_mode", ["fused", "host"])
def test_a_rule_set_during_the_inner_step_is_the_rule_the_policy_advances_by(skip_mode):
    model, inner, opt = _recorded_step_optimizer(skip_mode)
    inner.register_step_pre_hook(lambda *_: opt.loss_scale.set_policy(DynamicScale(init_scale=8.0, growth_factor=4.0,
                                                                                    growth_interval=1)))
    _backward(opt, model)
    opt.step()
    assert float(opt.loss_scale.scale) == 32.0  # set, then advance: the new rule's growth, not the old one's 16


@pytest.mark.parametrize("skip_mode", ["fused", "host"])
def test_a_scale_written_in_place_during_the_inner_step_is_what_the_policy_advances(skip_mode):
    model, inner, opt = _recorded_step_optimizer(skip_mode)

    def write_in_place(*_):
        opt.loss_scale.scale.fill_(2.0)
    inner.register_step_pre_hook(write_in_place)
    _backward(opt, model)
    opt.step()
    assert float(opt.loss_scale.scale) == 4.0  # written, then advanced (growth_interval=1), not the old 8 -> 16
