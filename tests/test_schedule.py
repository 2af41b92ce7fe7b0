"""PrecisionSchedule (Ascend's accelerate_train_mode): the switch rule, autocast, validation, the scaler, resume."""

import copy
import dataclasses
import io
import math
import pickle
import re

import pytest
import torch

from lossscale import DynamicScale, FixedScale, LossScaleOptimizer, PrecisionSchedule
from lossscale.addons.schedule import ScheduleConfig, ScheduleState, advance, validate_attachable
from lossscale.compat.ascend import ExperimentalConfig, TellMeStepOrLossHook

ALLOWED_PARTS = ("'fast' (float16)", "'fast1' (bfloat16)", "'step'", "[0.2, 0.9]", "'loss'", "[1.01, 1.5]")


def dtypes_over(schedule, steps):
    out = []
    for i in range(steps):
        schedule.update(step=i)
        out.append(schedule.dtype)
    return out


# --- the switch rule ------------------------------------------------------------------------------


def test_fast_step_09_is_float16_for_steps_0_to_89_and_original_from_90():
    s = PrecisionSchedule("fast|step|0.9", total_steps=100)
    assert (s.dtype, s.switched, s.switch_step, s.step) == (torch.float16, False, None, 0)
    seen = dtypes_over(s, 100)
    assert seen == [torch.float16] * 90 + [None] * 10
    assert s.switched and s.switch_step == 90


def test_fast1_step_025_over_10_is_bfloat16_for_steps_0_to_2():
    s = PrecisionSchedule("fast1|step|0.25", total_steps=10)
    assert dtypes_over(s, 10) == [torch.bfloat16] * 3 + [None] * 7
    assert s.switch_step == 3


@pytest.mark.parametrize(
    "ratio,total,low_steps",
    [("0.3", 10, 3), ("0.7", 10, 7), ("0.2", 5, 1), ("0.9", 7, 7), ("0.29", 100, 29), ("0.51", 3, 2)],
)
def test_step_boundary_is_exact_decimal_arithmetic(ratio, total, low_steps):
    # 10 * 0.3 is 3.0000000000000004 in floats, which would keep step 3 in low precision
    s = PrecisionSchedule(f"fast|step|{ratio}", total_steps=total)
    assert dtypes_over(s, total) == [torch.float16] * low_steps + [None] * (total - low_steps)
    assert low_steps == sum(1 for i in range(total) if i < total * float(ratio) - 1e-12)


def test_fast1_loss_105_switches_at_the_first_loss_at_most_21_and_never_reverts():
    s = PrecisionSchedule("fast1|loss|1.05", target_loss=2.0)
    losses = [3.0, 2.5, float("nan"), 2.1000001, 2.1, 1.9, 5.0, float("inf"), 2.5]
    seen = []
    for loss in losses:
        seen.append(s.dtype)  # the precision the step that produced `loss` ran in
        s.update(loss=torch.tensor(loss, dtype=torch.float64))
    assert seen == [torch.bfloat16] * 5 + [None] * 4
    assert s.switch_step == 5  # the loss of step 4 was 2.1: step 5 is the first in original precision
    assert s.step == len(losses) and s.dtype is None


def test_loss_threshold_is_the_nearest_float_to_target_times_ratio():
    s = PrecisionSchedule("fast|loss|1.15", target_loss=3.0)
    assert s.config.switch_below_loss == 3.45  # 3.0 * 1.15 in floats is 3.4499999999999997
    s.update(loss=3.45)
    assert s.switched


def test_step_and_loss_reports_share_one_position():
    s = PrecisionSchedule("fast|step|0.5", total_steps=6)
    s.update(step=0)
    s.update(loss=9.0)  # the loss of step 0: one step completed
    assert s.step == 1
    s.update(step=1)
    s.update(loss=9.0)
    s.update(loss=9.0)
    assert (s.step, s.switched, s.switch_step) == (3, True, 3)
    s.update(step=0)  # a step report going back does not bring low precision back
    assert s.dtype is None and s.switch_step == 3


def test_a_step_report_does_not_switch_a_loss_trigger_nor_a_loss_a_step_trigger_early():
    loss_trig = PrecisionSchedule("fast|loss", target_loss=1.0)
    loss_trig.update(step=10_000)
    assert not loss_trig.switched
    step_trig = PrecisionSchedule("fast|step", total_steps=10)
    step_trig.update(step=3, loss=0.0)
    assert not step_trig.switched


def test_omitted_ratio_takes_ascends_default():
    step = PrecisionSchedule("fast|step", total_steps=100)
    loss = PrecisionSchedule("fast1|loss", target_loss=2.0)
    assert (step.config.ratio, step.config.switch_at_step) == (0.9, 90)
    assert (loss.config.ratio, loss.config.switch_below_loss, loss.dtype) == (1.05, 2.1, torch.bfloat16)
    assert ExperimentalConfig(accelerate_train_mode="fast1|step").accelerate_train_mode == "fast1|step"


def test_advance_is_the_whole_rule():
    config = PrecisionSchedule("fast|step|0.5", total_steps=4).config
    assert dataclasses.is_dataclass(config) and isinstance(config, ScheduleConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.ratio = 0.2  # type: ignore[misc]
    assert advance(config, ScheduleState(), 1, None) == ScheduleState(1, None)
    assert advance(config, ScheduleState(1, None), None, None) == ScheduleState(2, 2)
    assert advance(config, ScheduleState(9, 2), 0, None) == ScheduleState(0, 2)


# --- autocast --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,low", [("fast|step|0.5", torch.float16), ("fast1|step|0.5", torch.bfloat16)])
def test_autocast_changes_the_matmul_dtype_before_the_switch_and_not_after(mode, low):
    s = PrecisionSchedule(mode, total_steps=2)
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    with s.autocast("cpu"):
        assert (a @ b).dtype == low
        assert torch.nn.Linear(3, 2)(a).dtype == low
    s.update(step=1)
    assert s.switched
    with s.autocast("cpu"):
        assert (a @ b).dtype == torch.float32
    assert (a @ b).dtype == torch.float32


# --- validation ------------------------------------------------------------------------------------

BAD_MODES = [
    "fast|step|0.1",
    "fast|loss|1.6",
    "slow|step|0.5",
    "fast|time|0.5",
    "fast|step|abc",
    "fast|step|0.9|1",
    "fast|step|0.9|",
    "fast|step|",
    "|step|0.9",
    "fast||0.9",
    "fast",
    "",
    "|",
    "fast|step|0.95",
    "fast|loss|1.00",
    "fast|step|1.05",
    "fast|loss|0.9",
    "FAST|step|0.9",
    "fast|step| 0.9",
    "fast |step|0.9",
    "fast|step|nan",
    "fast|step|inf",
    "fast|step|1e-1",
    "fast|step|-0.5",
    "fast|step|0_5",
    "fast1|loss|1.501",
]


@pytest.mark.parametrize("mode", BAD_MODES)
def test_every_invalid_mode_is_a_value_error_that_names_the_allowed_values(mode):
    kwargs = {"target_loss": 1.0} if "loss" in mode else {"total_steps": 10}
    with pytest.raises(ValueError) as err:
        PrecisionSchedule(mode, **kwargs)
    message = str(err.value)
    assert message.startswith(f"PrecisionSchedule(mode={mode!r}): mode is 'type|trigger|ratio'")
    assert all(part in message for part in ALLOWED_PARTS), message
    assert "; got " in message
    with pytest.raises(ValueError) as err:
        ExperimentalConfig(accelerate_train_mode=mode)
    assert str(err.value).startswith(f"ExperimentalConfig(accelerate_train_mode={mode!r}): mode is")


def test_the_error_says_what_was_wrong():
    cases = {
        "fast|step|0.1": "ratio 0.1 for trigger 'step', outside [0.2, 0.9]",
        "fast|loss|1.6": "ratio 1.6 for trigger 'loss', outside [1.01, 1.5]",
        "slow|step|0.5": "type 'slow'",
        "fast|time|0.5": "trigger 'time'",
        "fast|step|abc": "ratio 'abc', which is not a plain decimal number",
        "fast|step|0.9|1": "4 fields",
        "fast|step|": "an empty field",
        "fast": "1 field in",
    }
    for mode, problem in cases.items():
        with pytest.raises(ValueError, match="got " + re.escape(problem)):
            PrecisionSchedule(mode, total_steps=10)


@pytest.mark.parametrize(
    "mode,kwargs,needle",
    [
        ("fast|step|0.9", {}, "total_steps must be an integer >= 1; got None"),
        ("fast|step|0.9", {"total_steps": 0}, "total_steps must be an integer >= 1; got 0"),
        ("fast|step|0.9", {"total_steps": True}, "got True"),
        ("fast|step|0.9", {"total_steps": 10.0}, "got 10.0"),
        ("fast|step|0.9", {"total_steps": 10, "target_loss": 1.0}, "target_loss is only used by the 'loss' trigger"),
        ("fast1|loss|1.05", {}, "target_loss must be a finite number > 0; got None"),
        ("fast1|loss|1.05", {"target_loss": 0.0}, "got 0.0"),
        ("fast1|loss|1.05", {"target_loss": -1.0}, "got -1.0"),
        ("fast1|loss|1.05", {"target_loss": float("nan")}, "got nan"),
        ("fast1|loss|1.05", {"target_loss": float("inf")}, "got inf"),
        ("fast1|loss|1.05", {"target_loss": 2.0, "total_steps": 10}, "total_steps is only used by the 'step' trigger"),
    ],
)
def test_a_trigger_without_its_measure_is_a_value_error(mode, kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)) as err:
        PrecisionSchedule(mode, **kwargs)
    assert str(err.value).startswith(f"PrecisionSchedule({mode!r}, total_steps=")


def test_a_mode_that_is_not_a_string_is_a_type_error():
    with pytest.raises(TypeError, match=r"mode must be a str; mode is 'type\|trigger\|ratio'.*got NoneType None"):
        PrecisionSchedule(None, total_steps=10)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs,error,needle",
    [
        ({}, TypeError, "report step="),
        ({"step": -1}, ValueError, "got -1"),
        ({"step": True}, TypeError, "bool"),
        ({"step": 1.5}, TypeError, "got float"),
        ({"loss": "2.0"}, TypeError, "got str"),
        ({"loss": torch.ones(2)}, ValueError, r"got shape \(2,\)"),
    ],
)
def test_update_rejects_what_is_not_a_step_or_a_loss(kwargs, error, needle):
    s = PrecisionSchedule("fast|loss|1.05", target_loss=2.0)
    with pytest.raises(error, match=needle) as err:
        s.update(**kwargs)
    assert str(err.value).startswith("PrecisionSchedule('fast|loss|1.05', target_loss=2.0).update(step=")
    assert s.state == ScheduleState()


# --- checkpoints -----------------------------------------------------------------------------------


def test_state_dict_round_trips_and_refuses_another_mode():
    s = PrecisionSchedule("fast|step|0.5", total_steps=10)
    dtypes_over(s, 7)
    saved = s.state_dict()
    # never attached to an optimizer: a switch that happened counts as reported
    assert saved == {"mode": "fast|step|0.5", "step": 6, "switch_step": 5, "reported": True, "window": None}
    fresh = PrecisionSchedule("fast|step|0.5", total_steps=10)
    fresh.load_state_dict(saved)
    assert (fresh.state, fresh.dtype) == (s.state, None)
    older = {"mode": "fast|step|0.5", "step": 6, "switch_step": 5}  # saved before reported and window were kept
    fresh.load_state_dict(older)
    assert fresh.state_dict() == saved
    with pytest.raises(ValueError, match=r"window must be None or the precision"):
        fresh.load_state_dict({**saved, "window": "float8"})
    with pytest.raises(TypeError, match=r"reported must be a bool; got str"):
        fresh.load_state_dict({**saved, "reported": "yes"})
    other = PrecisionSchedule("fast1|step|0.5", total_steps=10)
    with pytest.raises(ValueError, match=r"saved by a schedule with mode 'fast\|step\|0.5'"):
        other.load_state_dict(saved)
    assert pickle.loads(pickle.dumps(s)).state == s.state
    assert copy.deepcopy(s).state == s.state


# --- with LossScaleOptimizer ----------------------------------------------------------------------


def attach_error(dtype):
    model = torch.nn.Linear(3, 3).to(dtype)
    with pytest.raises(ValueError) as err:
        LossScaleOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), schedule=PrecisionSchedule("fast|step|0.9", total_steps=10)
        )
    return str(err.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attaching_to_low_precision_parameters_is_an_error_that_says_why(dtype):
    message = attach_error(dtype)
    assert message.startswith("LossScaleOptimizer(schedule=PrecisionSchedule('fast|step|0.9', total_steps=10))")
    assert f"already {dtype}" in message and "original precision" in message and "model.float()" in message


def test_attaching_anything_but_a_schedule_is_a_type_error():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"schedule must be a lossscale.PrecisionSchedule"):
        LossScaleOptimizer(opt, schedule="fast|step|0.9")
    validate_attachable(PrecisionSchedule("fast|step|0.9", total_steps=3), [torch.zeros(2, dtype=torch.float64)])


def regression(seed=0, steps=30):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    gen = torch.Generator().manual_seed(seed + 1)
    teacher = torch.randn(8, 4, generator=gen)
    xs = [torch.randn(32, 8, generator=gen) for _ in range(steps)]
    return model, [(x, x @ teacher) for x in xs]


def train(model, opt, schedule, data, start, stop, feed, inject=()):
    """One step per batch; returns the StepResults. feed='step' reports before the forward, 'loss' after."""
    results = []
    for i in range(start, stop):
        x, y = data[i]
        if feed == "step":
            schedule.update(step=i)
        with schedule.autocast("cpu"):
            loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        opt.backward(loss)
        if i in inject:
            model[2].weight.grad[0, 0] = float("inf")
        results.append(opt.step())
        if feed == "loss":
            schedule.update(loss=loss.detach())
        assert all(torch.isfinite(p).all() for p in model.parameters()), f"step {i}"
    return results


def test_scaler_is_active_before_the_switch_and_idle_after():
    model, data = regression()
    schedule = PrecisionSchedule("fast|step|0.5", total_steps=30)
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        policy=DynamicScale(init_scale=2.0**24, growth_interval=4),
        schedule=schedule,
    )
    results = train(model, opt, schedule, data, 0, 30, "step", inject={22})
    early, late = results[:15], results[15:]
    assert [r.precision for r in results] == ["float16"] * 15 + ["float32"] * 15
    assert [r.switched for r in results] == [False] * 15 + [True] + [False] * 14
    assert results[15].step == schedule.switch_step == 15
    assert any(not bool(r.stepped) for r in early)  # 2^24 overflows float16 at first: skipped, backed off
    assert len({float(r.scale) for r in early}) > 2 and all(float(r.scale) > 1 for r in early)
    frozen = float(opt.scale)
    assert all(float(r.scale) == 1.0 and float(r.next_scale) == frozen for r in late)
    assert [bool(r.stepped) for r in late] == [i != 22 for i in range(15, 30)]  # still catches inf after
    assert schedule.on_loss(torch.tensor(0.5), False) is False  # the hook's answer: losses are not scaled now
    metrics = [r.as_dict() for r in results]  # what a logger records
    assert (metrics[14]["precision"], metrics[15]["precision"], metrics[15]["switched"]) == ("float16", "float32", True)
    loss = torch.tensor(0.5)
    assert opt.scale_loss(loss) is loss


def test_bfloat16_phase_never_scales():
    model, data = regression()
    schedule = PrecisionSchedule("fast1|step|0.5", total_steps=10)
    opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), schedule=schedule)
    assert schedule.on_loss(torch.tensor(0.5), False) is False
    results = train(model, opt, schedule, data, 0, 10, "step")
    assert [r.precision for r in results] == ["bfloat16"] * 5 + ["float32"] * 5
    assert all(float(r.scale) == 1.0 and bool(r.stepped) for r in results)
    assert float(opt.scale) == 2.0**16  # the policy never advanced


def test_a_switch_in_the_middle_of_an_accumulation_window_keeps_the_window_scaled():
    def run(switch_mid_window):
        model, data = regression(2)
        schedule = PrecisionSchedule("fast|loss|1.05", target_loss=1.0)
        opt = LossScaleOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            policy=FixedScale(1024.0),
            accumulation_steps=2,
            schedule=schedule,
        )
        results = []
        for i, (x, y) in enumerate(data[:4]):
            opt.zero_grad()
            opt.backward(torch.nn.functional.mse_loss(model(x), y))
            if i == 0 and switch_mid_window:
                schedule.update(loss=0.5)
            results.append(opt.step())
        if not switch_mid_window:
            schedule.update(loss=0.5)
        return model, results

    switched, results = run(True)
    with pytest.warns(UserWarning, match="never called"):  # the control feeds the schedule only at the end
        control, _ = run(False)
    assert results[1].precision == "float16" and not results[1].switched
    assert results[3].precision == "float32" and results[3].switched
    model, data = regression(2)
    ref = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data[:2]:
        (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
    ref.step()
    ref.zero_grad()
    for x, y in data[2:4]:
        (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
    ref.step()
    for run_model in (switched, control):  # both windows unscaled correctly: equal to plain fp32 SGD
        pairs = zip(run_model.parameters(), model.parameters())
        assert all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in pairs)


@pytest.mark.parametrize("feed", ["step", "loss"])
def test_a_checkpoint_before_the_switch_resumes_to_the_same_switch_step(feed):
    def fresh(target_loss=None):
        model, data = regression(1, steps=24)
        schedule = (
            PrecisionSchedule("fast|step|0.5", total_steps=24)
            if feed == "step"
            else PrecisionSchedule("fast|loss|1.05", target_loss=target_loss)
        )
        opt = LossScaleOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-2),
            policy=DynamicScale(init_scale=2.0**20, growth_interval=3),
            schedule=schedule,
        )
        return model, data, schedule, opt

    target = None
    if feed == "loss":  # a pilot that never switches gives the loss trace; aim for the loss near step 12
        model, data, schedule, opt = fresh(target_loss=1e-9)
        with pytest.warns(UserWarning, match="never called"):  # the pilot never feeds its schedule
            losses = train_unfed(model, data, schedule, opt)
        target = min(losses[:13]) / 1.05 * (1 + 1e-6)

    model, data, schedule, opt = fresh(target)
    whole = train(model, opt, schedule, data, 0, 24, feed)
    switch_step = schedule.switch_step
    assert switch_step is not None and 6 <= switch_step < 20
    assert [r.switched for r in whole].index(True) == switch_step

    model, data, schedule, opt = fresh(target)
    train(model, opt, schedule, data, 0, 5, feed)
    assert not schedule.switched
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    model, data, schedule, opt = fresh(target)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    assert schedule.step == (5 if feed == "loss" else 4) and not schedule.switched  # "step" reports at the top
    resumed = train(model, opt, schedule, data, 5, 24, feed)
    assert schedule.switch_step == switch_step
    assert [r.switched for r in resumed].index(True) == switch_step - 5
    assert [r.precision for r in resumed] == [r.precision for r in whole[5:]]
    assert [float(r.scale) for r in resumed] == [float(r.scale) for r in whole[5:]]


# --- the Ascend facade -----------------------------------------------------------------------------


def test_experimental_config_and_hook_feed_the_same_schedule_as_the_core():
    config = ExperimentalConfig(accelerate_train_mode="fast|step|0.9")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.accelerate_train_mode = "fast|step|0.5"  # type: ignore[misc]
    hook = TellMeStepOrLossHook(step=0, total_step=100)
    schedule = config.schedule(hook)
    assert repr(schedule) == "PrecisionSchedule('fast|step|0.9', total_steps=100)"
    seen = []
    for step in range(100):
        seen.append(schedule.dtype)
        hook(step=step + 1)  # steps completed, like a Lightning callback's trainer.global_step
    assert seen == [torch.float16] * 90 + [None] * 10 and schedule.switch_step == 90

    loss_hook = TellMeStepOrLossHook(final_loss=2.0)
    loss_schedule = ExperimentalConfig(accelerate_train_mode="fast1|loss").schedule(loss_hook)
    for loss in [3.0, 2.2, 2.1, 9.0]:
        loss_hook(loss=torch.tensor(loss))
    assert loss_schedule.switch_step == 3 and loss_schedule.dtype is None


def test_a_hook_started_mid_run_reports_its_start():
    hook = TellMeStepOrLossHook(step=95, total_step=100)
    assert ExperimentalConfig(accelerate_train_mode="fast|step").schedule(hook).switch_step == 95
    loss_hook = TellMeStepOrLossHook(loss=1.0, final_loss=1.0)
    schedule = ExperimentalConfig(accelerate_train_mode="fast|loss|1.5").schedule(loss_hook)
    assert (schedule.step, schedule.switch_step) == (0, 0)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({}, "got neither"),
        ({"step": 0, "total_step": 10, "final_loss": 1.0}, "got both"),
        ({"step": 0}, "total_step must be an integer >= 1; got None"),
        ({"total_step": 0}, "got 0"),
        ({"step": -1, "total_step": 10}, "step must be an integer >= 0; got -1"),
        ({"loss": 2.0}, "final_loss must be a finite number > 0"),
        ({"final_loss": math.nan}, "got nan"),
    ],
)
def test_hook_arguments_are_checked(kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)) as err:
        TellMeStepOrLossHook(**kwargs)
    assert str(err.value).startswith("TellMeStepOrLossHook(")


def test_config_and_hook_misuse_names_the_fix():
    step_hook = TellMeStepOrLossHook(step=0, total_step=10)
    with pytest.raises(RuntimeError, match=r"feeds no schedule yet; call ExperimentalConfig"):
        step_hook(step=1)
    with pytest.raises(ValueError, match=r"the 'loss' trigger is fed by TellMeStepOrLossHook\(loss=..., final_loss"):
        ExperimentalConfig(accelerate_train_mode="fast|loss|1.05").schedule(step_hook)
    with pytest.raises(ValueError, match=r"accelerate_train_mode is None \(off\)"):
        ExperimentalConfig().schedule(step_hook)
    with pytest.raises(TypeError, match="hook must be a TellMeStepOrLossHook"):
        ExperimentalConfig(accelerate_train_mode="fast|step").schedule(lambda step: None)  # type: ignore[arg-type]
    ExperimentalConfig(accelerate_train_mode="fast|step").schedule(step_hook)
    with pytest.raises(RuntimeError, match="already feeds PrecisionSchedule"):
        ExperimentalConfig(accelerate_train_mode="fast|step").schedule(step_hook)


# --- non-finite losses; a schedule that is never told anything ------------------------------------


@pytest.mark.parametrize(
    "loss",
    [
        float("-inf"),
        float("inf"),
        float("nan"),
        torch.tensor(float("-inf")),
        torch.tensor(float("-inf"), dtype=torch.float16),
    ],
)
def test_no_non_finite_loss_switches(loss):
    s = PrecisionSchedule("fast|loss|1.05", target_loss=2.0)
    s.update(loss=loss)
    assert s.dtype == torch.float16 and not s.switched and s.step == 1
    s.update(loss=-1.0)  # a finite loss below the target still switches
    assert s.switched and s.switch_step == 2


def test_advance_ignores_minus_inf():
    config = PrecisionSchedule("fast|loss|1.05", target_loss=2.0).config
    assert advance(config, ScheduleState(), None, float("-inf")) == ScheduleState(1, None)


def train_unfed(model, data, schedule, opt):
    """A plain loop under the schedule's autocast that never feeds the schedule; returns the losses."""
    losses = []
    for x, y in data:
        with schedule.autocast("cpu"):
            loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def never_told(steps):
    model, data = regression(steps=steps)
    schedule = PrecisionSchedule("fast|step|0.5", total_steps=steps)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), schedule=schedule)
    train_unfed(model, data, schedule, opt)
    return schedule


def test_a_loop_that_never_tells_the_schedule_is_warned_once():
    with pytest.warns(
        UserWarning,
        match=r"PrecisionSchedule\('fast\|step\|0.5', total_steps=6\).*2 optimizer "
        r"steps.*update\(\) was never called.*schedule.update\(step=",
    ) as record:
        schedule = never_told(6)
    assert len([w for w in record if "never called" in str(w.message)]) == 1
    assert schedule.dtype == torch.float16


def test_a_loop_that_reports_after_the_first_step_is_not_warned():
    model, data = regression(steps=6)
    schedule = PrecisionSchedule("fast|loss|1.05", target_loss=1e-9)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), schedule=schedule)
    train(model, opt, schedule, data, 0, 6, "loss")  # pytest turns any warning into an error
    assert schedule.step == 6


def test_a_resumed_schedule_is_not_warned():
    saved = PrecisionSchedule("fast|step|0.5", total_steps=6)
    saved.update(step=2)
    model, data = regression(steps=6)
    schedule = PrecisionSchedule("fast|step|0.5", total_steps=6)
    schedule.load_state_dict(saved.state_dict())
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), schedule=schedule)
    for x, y in data[:3]:
        opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
    assert schedule.step == 2
