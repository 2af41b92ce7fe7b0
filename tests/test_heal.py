"""Healing (issue 48): a forward fault keeps the scale, the module it names runs in float32 from then on, and the run
goes on; what heals nothing says so; a checkpoint resumes a healed run bit for bit.

Oracles: the same run without healing (the trajectory of a healthy run must not move, bit for bit), the uninterrupted
run (for every resume), the report's advice followed literally (the fix it names must fix the fault), and the
module's dtypes seen by hooks (what a healed module runs in).
"""

from __future__ import annotations

import copy
import io
import re
import warnings

import pytest
import torch
from torch import nn

import lossscale
from lossscale import (
    DynamicScale,
    GradScaler,
    HealError,
    HealWarning,
    LossScaleOptimizer,
    OverflowDiagnosis,
    OverflowWarning,
    PredictiveScale,
    StepLogger,
    find_overflow,
    keep_float32,
)
from lossscale.testing import HostReadCounter

F16 = torch.float16
STEPS = 16
FAULT_AT = 4


class Chain(nn.Module):
    """inp -> a -> b -> norm -> out: a norm follows the chain, as in a transformer block."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(8, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.b(self.a(self.inp(x)))))


def plant(model: Chain, where: str = "b") -> None:
    """``where``'s float16 output passes 65504 (its weights stay below it). Planted in ``a``, the overflow moves on:
    a's float32 output (2.5e5) overflows when autocast casts it into b's float16 op."""
    with torch.no_grad():
        getattr(model, where).weight.mul_(3e5)
    if where == "a":
        with torch.no_grad():
            model.b.weight.mul_(1e-3)  # b's own float32 output stays small once it runs in float32


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(1000 + step))


def forward_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=F16):
        return model(x).float().pow(2).mean()


def overflowing_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A loss whose float16 term overflows (a sum of squares past 65504) while every gradient stays finite (that term
    does not reach the parameters)."""
    with torch.autocast("cpu", dtype=F16):
        return model(x).float().pow(2).mean() + (x.half() * 200).pow(2).sum()


def optimizer(model: nn.Module, heal: object = True, **kwargs) -> LossScaleOptimizer:
    kwargs.setdefault("policy", DynamicScale(init_scale=2.0**10, growth_interval=1000))
    diagnose = kwargs.pop("diagnose", model)
    return LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), diagnose=diagnose, heal=heal, **kwargs)


def train(model, opt, steps=STEPS, start=0, fault_at=FAULT_AT, where="b", closure=False):
    """Steps ``start..steps-1``; the fault planted at ``fault_at``; the results and the warnings, recorded."""
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(start, steps):
            if step == fault_at:
                plant(model, where)
            x = batch(step)
            if closure:

                def step_closure(x=x):
                    loss = forward_loss(model, x)
                    opt.backward(loss)
                    return loss

                results.append(opt.step(step_closure))
            else:
                opt.backward(forward_loss(model, x))
                results.append(opt.step())
            opt.zero_grad()
    return results, caught


def run_steps(opt, loss_at, steps):
    """``opt`` stepped on ``loss_at(step)`` for each of ``steps``; the results and the warnings, recorded."""
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            opt.backward(loss_at(step))
            results.append(opt.step())
            opt.zero_grad()
    return results, caught


def heal_warnings(caught) -> list:
    return [w for w in caught if issubclass(w.category, HealWarning)]


def diagnosis_of(opt) -> OverflowDiagnosis:
    return next(a for a in opt.add_ons if isinstance(a, OverflowDiagnosis))


def output_dtypes(model: nn.Module, x: torch.Tensor) -> dict[str, torch.dtype]:
    seen: dict[str, torch.dtype] = {}
    handles = [
        m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, out.dtype))
        for name, m in model.named_children()
    ]
    with torch.no_grad():
        forward_loss(model, x)
    for h in handles:
        h.remove()
    return seen


# the diagnosis healing acts on ---------------------------------------------------------------------------------


def test_each_reports_advice_followed_literally_fixes_the_fault_and_ends_with_none():
    model = Chain()
    plant(model, "a")
    x = batch(0)
    followed = []
    for _ in range(4):
        report = find_overflow(model, lambda: forward_loss(model, x), scale=2.0**8)
        if report.kind == "none":
            break
        assert report.kind == "forward"
        code = re.search(r"keep_float32\(model\.get_submodule\('[^']*'\), outputs='float32'\)", report.advice)
        assert code is not None, report.advice
        eval(code.group(0), {"model": model, "keep_float32": keep_float32})  # the advice, as written
        followed.append((report.module, report.advice))
    assert report.kind == "none", report
    assert [m for m, _ in followed] == ["a", "b"]  # the overflow moved on to the next module, and was fixed there
    # a's NaN is an overflow inside its float16 matmul (inf - inf), not an op that makes NaN at any precision
    assert "in float32 its output stays finite" in followed[0][1] and "guard that op" not in followed[0][1]
    # b's input is finite, past 65504, and autocast casts it to float16: an overflow of that input
    assert "is finite but past float16's 65504" in followed[1][1] and "NaN in its own code" not in followed[1][1]


def test_a_real_nan_making_op_keeps_its_advice():
    class Log(nn.Module):
        def forward(self, x):
            return torch.log(x - 10.0)  # NaN at any precision

    model = nn.Sequential(nn.Linear(4, 4), Log(), nn.Linear(4, 1))
    report = find_overflow(model, lambda: forward_loss(model, torch.randn(2, 4)), scale=2.0**8)
    assert (report.kind, report.module, report.nan) == ("forward", "1", True)
    assert "guard that op" in report.advice


def test_diagnose_alone_warns_of_a_loss_that_stays_non_finite_while_the_gradients_are_finite():
    model = Chain()
    opt = optimizer(model, heal=False)
    stepped = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(8):
            opt.backward(overflowing_loss(model, batch(step)))
            stepped.append(bool(opt.step().stepped))
            opt.zero_grad()
    assert all(stepped)  # the gradients stayed finite: every step applied, as before
    [warning] = [w.message for w in caught if issubclass(w.category, OverflowWarning)]
    assert warning.report.kind == "loss"
    assert str(warning).startswith("the loss was non-finite 2 steps in a row; the traced step 3 found")
    assert "set it back to your initial scale" in warning.report.advice  # how to restore a scale the fault lowered


def test_the_warning_says_which_trigger_fired_under_predictive_scale():
    model = Chain()
    opt = optimizer(model, heal=False, policy=PredictiveScale(init_scale=2.0**10))
    results, caught = train(model, opt, steps=10)
    [warning] = [w.message for w in caught if issubclass(w.category, OverflowWarning)]
    assert "the loss was non-finite 2 steps in a row" in str(warning) and "collapse" not in str(warning)
    assert float(results[-1].scale) == float(results[FAULT_AT - 1].next_scale)  # PredictiveScale kept its scale


@pytest.mark.parametrize("front", ["LossScaleOptimizer", "GradScaler"])
def test_the_warning_points_at_the_users_step_line(front):
    import linecache

    model = Chain()
    plant(model)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt = LossScaleOptimizer(sgd, diagnose=model) if front == "LossScaleOptimizer" else None
    scaler = GradScaler("cpu", diagnose=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            loss = forward_loss(model, batch(step))
            if opt is not None:
                opt.backward(loss)
                opt.step()  # the user's step line
            else:
                scaler.scale(loss).backward()
                scaler.step(sgd)
                scaler.update()  # the user's step line
            sgd.zero_grad()
    [w] = [w for w in caught if issubclass(w.category, OverflowWarning)]
    assert w.filename == __file__
    assert linecache.getline(w.filename, w.lineno).strip().endswith("# the user's step line")


# healing on the front ends -------------------------------------------------------------------------------------


def test_heal_keeps_the_module_in_float32_and_the_scale_and_the_run_goes_on(tmp_path):
    model = Chain()
    opt = optimizer(model)
    path = tmp_path / "steps.csv"
    with StepLogger(path) as log:
        results, caught = train(model, opt)
        for r in results:
            log.log(r)
    diagnosis = diagnosis_of(opt)
    assert diagnosis.healed == {"b": torch.float32}
    [warning] = heal_warnings(caught)
    message = str(warning.message)
    assert "healed at step 7: 'b' now runs in float32, outputs in float32" in message
    assert warning.message.healed == {"b": torch.float32} and warning.message.report.module == "b"
    assert not [w for w in caught if not issubclass(w.category, HealWarning)]  # the heal is its own warning
    # the faulted steps 4..7 were skipped as forward faults, the policy never saw them: the scale never moved
    assert [bool(r.forward_fault) for r in results] == [FAULT_AT <= i <= 7 for i in range(STEPS)]
    assert [bool(r.stepped) for r in results] == [not FAULT_AT <= i <= 7 for i in range(STEPS)]
    assert {float(r.scale) for r in results} == {2.0**10}
    assert output_dtypes(model, batch(0))["b"] == torch.float32  # its outputs too
    rows = path.read_text().splitlines()
    header = rows[0].split(",")
    healed_column = [row.split(",")[header.index("healed_modules")] for row in rows[1:]]
    assert healed_column == ["b" if i == 7 else "" for i in range(STEPS)]  # once, in the row of the heal
    faults = [row.split(",")[header.index("forward_faults")] for row in rows[1:]]
    assert faults[-1] == "4" and faults[3] == "0"


def test_a_heal_restores_the_scale_the_run_had_when_the_skipped_steps_began():
    """Gradient overflows first halve the scale (steps 3-5), then the forward breaks (from 6): healing restores the
    scale of step 3, where the run of skipped steps began."""
    model = Chain()

    def loss_at(step):
        if step == 6:
            plant(model)
        loss = forward_loss(model, batch(step))
        return loss * 1e30 if 3 <= step <= 5 else loss  # its gradients overflow at any scale, the loss is finite

    results, caught = run_steps(optimizer(model), loss_at, 14)
    before = float(results[2].next_scale)
    assert [float(r.next_scale) for r in results[3:6]] == [before / 2, before / 4, before / 8]
    [warning] = heal_warnings(caught)
    assert f"the loss scale is restored to 2**{int(before).bit_length() - 1}" in str(warning.message)
    assert float(results[-1].scale) == before and all(bool(r.stepped) for r in results[-3:])


def test_heal_on_the_grad_scaler():
    model = Chain()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=1000, diagnose=model, heal=True)
    decisions, fields = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            if step == FAULT_AT:
                plant(model)
            scaler.scale(forward_loss(model, batch(step))).backward()
            decisions.append(scaler.step(sgd))
            scaler.update()
            fields.append(dict(scaler.last_fields))
            sgd.zero_grad()
    [warning] = heal_warnings(caught)
    assert "healed at step 7: 'b'" in str(warning.message)
    assert [bool(d.forward_fault) for d in decisions] == [FAULT_AT <= i <= 7 for i in range(STEPS)]
    assert [f.get("healed_modules") for f in fields] == ["b" if i == 7 else None for i in range(STEPS)]
    assert "rerun" not in fields[7]  # a GradScaler has no closure: the following steps are the check
    assert scaler.get_scale() == 2.0**10 and all(bool(d.stepped) for d in decisions[8:])


def test_step_with_a_closure_runs_the_healed_batch_again_at_once():
    model = Chain()
    opt = optimizer(model)
    results, _ = train(model, opt, closure=True)
    assert results[7].fields["healed_modules"] == "b"
    assert bool(results[7].stepped)  # the batch ran again after the heal, and stepped
    assert [bool(r.stepped) for r in results] == [not FAULT_AT <= i <= 6 for i in range(STEPS)]


def test_an_overflow_that_moves_on_is_healed_where_it_goes():
    model = Chain()
    opt = optimizer(model)
    results, caught = train(model, opt, steps=24, where="a")
    assert diagnosis_of(opt).healed == {"a": torch.float32, "b": torch.float32}
    assert [str(w.message).split(":")[0] for w in heal_warnings(caught)] == ["healed at step 7", "healed at step 11"]
    assert all(bool(r.stepped) for r in results[12:]) and {float(r.scale) for r in results} == {2.0**10}


def test_heal_with_bfloat16_runs_the_module_in_bfloat16():
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.dtypes: list[torch.dtype] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm):
                self.dtypes.append(out.dtype)
            return out

    model = Chain()
    opt = optimizer(model, heal=torch.bfloat16)
    train(model, opt)
    assert diagnosis_of(opt).healed == {"b": torch.bfloat16}
    with MatmulDtypes() as seen:
        forward_loss(model, batch(0))
    assert seen.dtypes == [F16, F16, torch.bfloat16, F16]  # inp, a, b (healed: bfloat16 autocast inside), out
    assert output_dtypes(model, batch(0))["b"] == torch.float32  # its outputs float32


def test_undo_heal_returns_the_module_to_autocast():
    model = Chain()
    opt = optimizer(model)
    train(model, opt)
    diagnosis = diagnosis_of(opt)
    diagnosis.undo_heal()
    assert diagnosis.healed == {} and diagnosis.healing
    assert output_dtypes(model, batch(0))["b"] == F16


# what heals nothing --------------------------------------------------------------------------------------------


def test_bad_batches_heal_nothing_keep_the_scale_and_never_stop_the_run():
    model = Chain()
    opt = optimizer(model)

    def loss_at(step):
        x = batch(step)
        if 3 <= step <= 8:
            x[0, 0] = float("inf")
        return forward_loss(model, x)

    results, caught = run_steps(opt, loss_at, 14)
    assert diagnosis_of(opt).healed == {} and not heal_warnings(caught)
    [warning] = [w.message for w in caught if issubclass(w.category, OverflowWarning)]
    assert warning.report.kind == "input" and "Healing heals no data and no loss computation" in str(warning)
    assert {float(r.scale) for r in results} == {2.0**10}
    assert [bool(r.forward_fault) for r in results] == [3 <= i <= 8 for i in range(14)]
    assert all(bool(r.stepped) for r in results[9:])


def test_a_loss_that_overflows_heals_nothing_and_says_the_steps_are_skipped_without_backoff():
    model = Chain()
    opt = optimizer(model)
    results, caught = run_steps(opt, lambda step: overflowing_loss(model, batch(step)), 8)
    [warning] = [w.message for w in caught if issubclass(w.category, OverflowWarning)]
    assert warning.report.kind == "loss" and not isinstance(warning, HealWarning)
    assert "skipped without lowering the scale (counted as forward faults)" in str(warning)
    assert all(bool(r.forward_fault) and not bool(r.stepped) for r in results)
    assert {float(r.scale) for r in results} == {2.0**10} and diagnosis_of(opt).healed == {}


def test_a_fault_in_the_models_own_code_stops_healing_and_then_raises_heal_error():
    class Amplify(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) * 1e6  # in the model's own code: no submodule to keep

    model = Amplify()
    diagnosis = OverflowDiagnosis(model, heal=True, give_up_after=8)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), diagnose=diagnosis)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(HealError) as raised:
            for step in range(40):
                opt.backward(forward_loss(model, batch(step)))
                opt.step()
                opt.zero_grad()
    [stop] = heal_warnings(caught)
    assert "healing stops at step 3: the fault is in the model's own code" in str(stop.message)
    assert not diagnosis.healing and diagnosis.healed == {}
    assert "8 steps in a row were skipped up to step 8 and healing stopped" in str(raised.value)
    assert raised.value.reports == diagnosis.reports and raised.value.reports[-1].module == ""


def test_give_up_after_none_keeps_skipping_and_warns_every_hundred_steps():
    model = nn.Linear(8, 1)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), diagnose=model, heal=True)
    opt.add_ons[0].give_up_after = None
    x = torch.full((2, 8), float("nan"))
    _, caught = run_steps(opt, lambda step: forward_loss(model, x), 205)
    skipped = [str(w.message) for w in caught if "steps in a row were skipped" in str(w.message)]
    assert [m.split(" steps")[0] for m in skipped] == ["100", "200"]


def test_with_per_layer_scales_the_healed_module_takes_factor_one_and_the_run_goes_on():
    """A healed module computes in float32, so per-layer scales give it no factor of its own. One set from its own
    small gradients would go with the gradient it hands on, through weights 3e5 times larger, into a's float16
    backward: an overflow at every other step after the heal and the global scale falling to 16 in 40 steps."""
    model = Chain()
    opt = optimizer(model, layerwise=model)
    steps = 40
    results, caught = train(model, opt, steps=steps)
    assert diagnosis_of(opt).healed == {"b": torch.float32} and len(heal_warnings(caught)) == 1
    assert [bool(r.stepped) for r in results] == [not FAULT_AT <= i <= 7 for i in range(steps)]
    assert {float(r.scale) for r in results} == {2.0**10}
    scales = {name: float(total) for name, total in results[-1].layer_scales.items()}
    assert scales["b"] == 2.0**10 and scales["a"] > 2.0**10, scales  # the others keep factors of their own


def test_the_healthy_run_is_the_same_bit_for_bit_with_no_host_read_added():
    def run(heal: bool):
        model = Chain()
        opt = optimizer(model, heal=heal, diagnose=model if heal else None)
        reads, scales = [], []
        for step in range(20):
            loss = forward_loss(model, batch(step))
            with HostReadCounter() as counter:
                opt.backward(loss)
                scales.append(opt.step().next_scale.clone())
            reads.append(counter.count)
            opt.zero_grad()
        return model, reads, scales

    healed, heal_reads, heal_scales = run(True)
    plain, plain_reads, plain_scales = run(False)
    assert heal_reads == plain_reads
    assert all(torch.equal(a, b) for a, b in zip(heal_scales, plain_scales))
    assert all(torch.equal(a, b) for a, b in zip(healed.state_dict().values(), plain.state_dict().values()))


# checkpoints ---------------------------------------------------------------------------------------------------


def _saved(model, front) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "front": front.state_dict()}, buffer)
    return buffer.getvalue()


def _loaded(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


@pytest.mark.parametrize("layerwise", [False, True], ids=["global", "layerwise"])
@pytest.mark.parametrize("resume_at", [2, 5, 6, 7, 8, 12])
def test_a_healed_run_resumes_bit_for_bit_from_any_step(resume_at, layerwise):
    model = Chain()
    opt = optimizer(model, layerwise=model if layerwise else None)
    saved = None
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(STEPS):
            if step == resume_at:
                saved = _saved(model, opt)
            if step == FAULT_AT:
                plant(model)
            opt.backward(forward_loss(model, batch(step)))
            results.append(opt.step())
            opt.zero_grad()
    state = _loaded(saved)
    again = Chain(seed=1)  # other weights: everything comes from the checkpoint
    again.load_state_dict(state["model"])
    resumed = optimizer(again, layerwise=again if layerwise else None)
    resumed.load_state_dict(state["front"])
    tail, caught = train(again, resumed, start=resume_at, fault_at=FAULT_AT if resume_at <= FAULT_AT else -1)
    assert [float(r.scale) for r in tail] == [float(r.scale) for r in results[resume_at:]]
    if layerwise:  # the healed unit is pinned again from the first forward after the load
        factors = [{k: float(v) for k, v in r.layer_scales.items()} for r in results[resume_at:]]
        assert [{k: float(v) for k, v in r.layer_scales.items()} for r in tail] == factors
    assert [bool(r.stepped) for r in tail] == [bool(r.stepped) for r in results[resume_at:]]
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    assert diagnosis_of(resumed).healed == diagnosis_of(opt).healed == {"b": torch.float32}
    assert len(heal_warnings(caught)) == (1 if resume_at <= 7 else 0)  # a heal already made is not made again


def test_a_grad_scaler_checkpoint_carries_the_healed_modules():
    model = Chain()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = GradScaler("cpu", init_scale=2.0**10, diagnose=model, heal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(10):
            if step == FAULT_AT:
                plant(model)
            scaler.scale(forward_loss(model, batch(step))).backward()
            scaler.step(sgd)
            scaler.update()
            sgd.zero_grad()
    state = _loaded(_saved(model, scaler))
    assert state["front"]["diagnosis"]["healed"] == {"b": "float32"}
    again = Chain()
    again.load_state_dict(state["model"])
    resumed = GradScaler("cpu", diagnose=again, heal=True)
    resumed.load_state_dict(state["front"])
    assert resumed.add_ons[0].healed == {"b": torch.float32}
    assert output_dtypes(again, batch(0))["b"] == torch.float32
    with pytest.warns(UserWarning, match=r"this GradScaler has an overflow diagnosis \(diagnose=\)"):
        GradScaler("cpu", diagnose=Chain()).load_state_dict(
            {k: v for k, v in state["front"].items() if k != "diagnosis"}
        )


def test_a_checkpoint_naming_a_module_the_model_lacks_is_refused_and_nothing_changes():
    model = Chain()
    opt = optimizer(model)
    train(model, opt)
    state = copy.deepcopy(opt.state_dict())
    state["diagnosis"]["healed"]["blocks.9.ff"] = "float32"
    fresh = Chain()
    other = optimizer(fresh)
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=r"healed the module 'blocks.9.ff', which the model given as diagnose="):
        other.load_state_dict(state)
    assert other.state_dict() == before and diagnosis_of(other).healed == {}


# arguments -----------------------------------------------------------------------------------------------------


def test_heal_without_a_model_to_diagnose_is_refused_saying_what_to_pass():
    model = Chain()
    with pytest.raises(ValueError, match=r"LossScaleOptimizer\(heal=True\): .* pass diagnose=model beside heal=True"):
        LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), heal=True)
    with pytest.raises(ValueError, match=r"GradScaler\(heal=True\): .* pass diagnose=model"):
        GradScaler("cpu", heal=True)
    with pytest.raises(ValueError, match=r"heal must be one of False, True, torch.float32, torch.bfloat16; got 'yes'"):
        OverflowDiagnosis(model, heal="yes")


def test_heal_under_cuda_graph_capture_is_refused_naming_why(monkeypatch):
    model = Chain()
    opt = optimizer(model)
    monkeypatch.setattr("lossscale.diagnosis.addon.capturing", lambda t: True)
    opt.backward(forward_loss(model, batch(0)))
    with pytest.raises(RuntimeError, match="under CUDA graph capture: healing replaces a module's forward"):
        opt.step()


def test_a_compiled_model_is_traced_eagerly_and_recompiles_once_after_the_heal():
    compiles = []

    def backend(graph_module, example_inputs):
        compiles.append(len(graph_module.graph.nodes))
        return graph_module.forward

    model = Chain()
    compiled = torch.compile(model, backend=backend)
    opt = optimizer(model)
    counts = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(12):
            if step == FAULT_AT:
                plant(model)
            opt.backward(forward_loss(compiled, batch(step)))
            opt.step()
            opt.zero_grad()
            counts.append(len(compiles))
    assert heal_warnings(caught) and diagnosis_of(opt).healed == {"b": torch.float32}
    assert counts == [1] * 8 + [2] * 4  # one graph before; the traced step ran eagerly; one recompile after the heal


# heal before training ------------------------------------------------------------------------------------------


def test_lossscale_heal_makes_a_model_float16_safe_on_one_batch_and_undo_returns_it():
    model = Chain()
    plant(model, "a")
    x = batch(0)
    result = lossscale.heal(model, lambda: forward_loss(model, x), scale=2.0**8)
    assert result.kept == {"a": torch.float32, "b": torch.float32}
    assert [r.kind for r in result.reports] == ["forward", "forward", "none"] and result.healed
    assert torch.isfinite(forward_loss(model, x))
    result.undo()
    assert result.kept == {} and not torch.isfinite(forward_loss(model, x))
    with pytest.raises(ValueError, match="max_healed"):
        lossscale.heal(model, lambda: forward_loss(model, x), max_healed=0)
