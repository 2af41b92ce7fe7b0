"""lossscale.integrations.transformers with the real transformers Trainer on CPU (a tiny GPT-2 built from a config),
side by side with the Trainer's own path driving torch.amp.GradScaler."""

from __future__ import annotations

import json
import math
import runpy
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.integrations import integration_utils

import lossscale
from _torch_versions import needs_torch
from lossscale import OverflowDiagnosis, OverflowWarning, PredictiveScale
from lossscale.integrations.transformers import LossScaleCallback, use_lossscale
from lossscale.validation import StateDictError
from test_integration_accelerate import reset_accelerate_state

ROOT = Path(__file__).resolve().parent.parent
TORCH_ARGS = dict(init_scale=2.0**8, growth_interval=2)
STEPS = 10
INF_AT = {3, 8}  # optimizer steps (0-based) whose gradients get an inf
SKIPPED = [s in INF_AT for s in range(STEPS)]
CONFIG = GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)


@pytest.fixture(autouse=True)
def fresh_state() -> Iterator[None]:
    """Each Trainer builds its own accelerator."""
    reset_accelerate_state()
    yield
    reset_accelerate_state()


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Steps(TrainerCallback):
    """After each optimizer step: the scaler's scale and whether Accelerate saw the step skipped."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.skipped: list[bool] = []

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.scales.append(optimizer.scaler.get_scale())
        self.skipped.append(optimizer.step_was_skipped)


def trainer(
    out: Path, scaler: str, callbacks: list[TrainerCallback] | None = None, overflow: bool = True, **args: Any
) -> Trainer:
    """A Trainer on a fresh tiny GPT-2 with torch's scaler (as the Trainer makes it on a GPU), lossscale's, or
    none yet (``scaler="none"``); ``overflow`` puts an inf into the gradients of the steps in INF_AT."""
    reset_accelerate_state()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG)
    args = (
        dict(
            output_dir=str(out),
            fp16=True,
            use_cpu=True,
            max_steps=STEPS,
            per_device_train_batch_size=2,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            seed=0,
            disable_tqdm=True,
        )
        | args
    )
    built = Trainer(model=model, args=TrainingArguments(**args), train_dataset=Tokens(), callbacks=callbacks)
    if scaler == "torch":
        built.accelerator.scaler = torch.amp.GradScaler("cpu", **TORCH_ARGS)
        built.accelerator.native_amp = True
    elif scaler == "ours":
        use_lossscale(built, fp16_on_cpu=True, **TORCH_ARGS)
    if overflow:

        def inject(grad: torch.Tensor) -> torch.Tensor:  # into the scaled gradient of the step's last micro-batch
            if built.state.global_step not in INF_AT:
                return grad
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad

        model.transformer.h[0].mlp.c_fc.weight.register_hook(inject)
    return built


def step_logs(t: Trainer) -> list[dict[str, Any]]:
    return [log for log in t.state.log_history if "loss" in log]


def column(logs: list[dict[str, Any]], key: str) -> list[Any]:
    return [log[key] for log in logs]


def assert_same_weights(a: Trainer, b: Trainer) -> None:
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("accumulation,max_grad_norm", [(1, 0.0), (2, 1.0)])
def test_adamw_torch_matches_the_trainers_torch_scaler_bit_for_bit(
    tmp_path: Path, accumulation: int, max_grad_norm: float
) -> None:
    args = dict(optim="adamw_torch", gradient_accumulation_steps=accumulation, max_grad_norm=max_grad_norm)
    ref_steps, steps = Steps(), Steps()
    ref = trainer(tmp_path / "torch", "torch", [ref_steps], **args)
    ref.train()
    run = trainer(tmp_path / "ours", "ours", [steps, LossScaleCallback()], **args)
    run.train()
    ref_logs, logs = step_logs(ref), step_logs(run)
    for key in ("loss", "grad_norm", "learning_rate"):
        assert column(logs, key) == column(ref_logs, key), key
    assert steps.scales == ref_steps.scales and len(set(ref_steps.scales)) > 2
    assert column(logs, "loss_scale") == ref_steps.scales
    assert steps.skipped == ref_steps.skipped == SKIPPED
    assert column(logs, "skipped_steps") == [sum(SKIPPED[: s + 1]) for s in range(STEPS)]
    lrs = column(logs, "learning_rate")  # each step's LR: a skipped step leaves the next one's equal
    assert [lrs[s + 1] == lrs[s] for s in range(STEPS - 1)] == SKIPPED[:-1]
    assert_same_weights(run, ref)


@needs_torch((2, 8), "the Trainer defaults to optim='adamw_torch_fused' from torch 2.8; before, to 'adamw_torch'")
def test_default_fused_adamw_holds_the_lr_on_a_skipped_step_where_torchs_scaler_advances_it(tmp_path: Path) -> None:
    ref_steps, steps = Steps(), Steps()
    ref = trainer(tmp_path / "torch", "torch", [ref_steps])
    assert ref.args.optim == "adamw_torch_fused"  # the Trainer's default on torch >= 2.8
    ref.train()
    run = trainer(tmp_path / "ours", "ours", [steps, LossScaleCallback()])
    run.train()
    ref_logs, logs = step_logs(ref), step_logs(run)
    first = min(INF_AT)
    # Equal up to the first skipped step; the step after it starts from the same weights, at another LR.
    for key in ("loss", "grad_norm"):
        assert column(logs, key)[: first + 2] == column(ref_logs, key)[: first + 2], key
    assert column(logs, "learning_rate")[: first + 1] == column(ref_logs, "learning_rate")[: first + 1]
    assert steps.scales == ref_steps.scales and column(logs, "loss_scale") == ref_steps.scales
    # torch: the fused kernel skipped the update, but Accelerate saw optimizer.step called, so the LR moved on.
    assert ref_steps.skipped == [False] * STEPS
    assert ref_logs[first + 1]["learning_rate"] < ref_logs[first]["learning_rate"]
    # lossscale: Accelerate sees the skip and the Trainer holds the LR.
    assert steps.skipped == SKIPPED
    lrs = column(logs, "learning_rate")
    assert [lrs[s + 1] == lrs[s] for s in range(STEPS - 1)] == SKIPPED[:-1]
    assert column(logs, "skipped_steps")[-1] == len(INF_AT)


@pytest.mark.parametrize("policy", [None, PredictiveScale(init_scale=2.0**8)], ids=["torch-rule", "predictive"])
def test_resume_from_checkpoint_continues_bit_identically(tmp_path: Path, policy: Any) -> None:
    def build(out: Path) -> Trainer:
        built = trainer(
            out,
            "none",
            [LossScaleCallback()],
            optim="adamw_torch",
            gradient_accumulation_steps=2,
            save_strategy="steps",
            save_steps=5,
        )
        kwargs = TORCH_ARGS if policy is None else {"policy": policy}
        scaler = use_lossscale(built, fp16_on_cpu=True, **kwargs)
        assert policy is None or scaler.policy is policy
        return built

    whole = build(tmp_path / "whole")
    whole.train()
    saved = torch.load(tmp_path / "whole" / "checkpoint-5" / "scaler.pt", weights_only=True)
    assert saved["skipped_steps"] == 1  # step 3 of the first five
    resumed = build(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-5"))
    assert step_logs(resumed)[5:] == step_logs(whole)[5:]  # loss, grad norm, LR, loss_scale, skipped_steps
    assert column(step_logs(resumed), "skipped_steps")[-1] == len(INF_AT)
    assert resumed.accelerator.scaler.state_dict() == whole.accelerator.scaler.state_dict()
    assert_same_weights(resumed, whole)


def test_a_torch_scaler_pt_loads_and_a_bad_skipped_count_is_refused(tmp_path: Path) -> None:
    scaler = use_lossscale(trainer(tmp_path, "none"), fp16_on_cpu=True)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=3)
    scaler.load_state_dict(torch_scaler.state_dict())  # what the Trainer's scaler.pt holds after a torch run
    assert scaler.state_dict()["scale"] == 4.0 and scaler.state_dict()["skipped_steps"] == 0
    with pytest.raises(StateDictError, match=r"state_dict\['skipped_steps'\] must be an int >= 0 .*; got -1"):
        scaler.load_state_dict({**torch_scaler.state_dict(), "skipped_steps": -1})
    assert scaler.state_dict()["scale"] == 4.0  # nothing changed


class Reporter(TrainerCallback):
    """Stands in for a report_to integration (TensorBoard, W&B): keeps what its on_log receives."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.logs.append(dict(logs or {}))


def test_values_reach_log_history_the_report_to_integrations_and_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reporter = Reporter()  # report_to=["lossscale-test"] makes the Trainer place it where it places integrations
    monkeypatch.setitem(integration_utils.INTEGRATION_TO_CALLBACK, "lossscale-test", reporter)
    run = trainer(
        tmp_path,
        "ours",
        [LossScaleCallback()],
        max_steps=4,
        report_to=["lossscale-test"],
        save_strategy="steps",
        save_steps=4,
    )
    run.train()
    expected = [(256.0, 0), (512.0, 0), (512.0, 0), (256.0, 1)]  # the overflow at step 3 halves the scale
    assert [(log["loss_scale"], log["skipped_steps"]) for log in step_logs(run)] == expected
    assert len(reporter.logs) == len(run.state.log_history) == 5  # four steps and the run's summary
    for reported, record in zip(reporter.logs, run.state.log_history, strict=True):
        assert type(reported["loss_scale"]) is float and type(reported["skipped_steps"]) is int
        assert {k: reported[k] for k in ("loss_scale", "skipped_steps")} == {
            k: record[k] for k in ("loss_scale", "skipped_steps")
        }
    state = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert [(log["loss_scale"], log["skipped_steps"]) for log in state["log_history"]] == expected


def test_use_lossscale_refuses_what_is_not_a_trainer() -> None:
    with pytest.raises(
        TypeError,
        match=r"use_lossscale\(trainer=dict\(...\)\): trainer must be a "
        r"transformers.Trainer; got builtins.dict",
    ):
        use_lossscale({})  # type: ignore[arg-type]


def test_use_lossscale_refuses_a_trainer_without_fp16(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"TrainingArguments\(fp16=False, bf16=True\); loss scaling needs "
        r"fp16=True .* TrainingArguments\(fp16=True, ...\)",
    ):
        use_lossscale(trainer(tmp_path, "none", fp16=False, bf16=True), fp16_on_cpu=True)


def test_use_lossscale_refuses_a_trainer_that_prepared_its_model(tmp_path: Path) -> None:
    trained = trainer(tmp_path, "none", overflow=False, max_steps=1)
    trained.train()  # fp16=True on CPU without use_lossscale: the Trainer trains in float32
    with pytest.raises(
        RuntimeError,
        match=r"use_lossscale\(trainer, ...\) was called after the Trainer prepared "
        r"its model .* before train\(\)",
    ):
        use_lossscale(trained, fp16_on_cpu=True)


def test_use_lossscale_refuses_cpu_unless_fp16_on_cpu(tmp_path: Path) -> None:
    built = trainer(tmp_path, "none")
    with pytest.raises(
        ValueError,
        match=r"use_lossscale\(trainer, ...\): Accelerate drops fp16 on CPU .* "
        r"use_lossscale\(trainer, fp16_on_cpu=True\)",
    ):
        use_lossscale(built)
    assert isinstance(use_lossscale(built, fp16_on_cpu=True), lossscale.GradScaler)


def test_loss_scale_callback_added_after_use_lossscale_refuses_to_train(tmp_path: Path) -> None:
    built = trainer(tmp_path, "ours", overflow=False)
    built.add_callback(LossScaleCallback())
    with pytest.raises(
        RuntimeError,
        match=r"LossScaleCallback was not given a scaler: register it first .* then "
        r"call use_lossscale\(trainer\) before trainer.train\(\)",
    ):
        built.train()


@pytest.mark.parametrize("with_callback", [False, True])
def test_an_accelerator_rebuilt_after_use_lossscale_is_refused_at_train(tmp_path: Path, with_callback: bool) -> None:
    """Trainer.hyperparameter_search rebuilds the accelerator for every trial (``create_accelerator_and_postprocess``,
    called here as it does): the Trainer would train with another scaler (none on CPU, torch's on a GPU). With or
    without LossScaleCallback, train() refuses; before, without it, the run went on without lossscale."""
    built = trainer(tmp_path, "ours", callbacks=[LossScaleCallback()] if with_callback else None, overflow=False)
    built.create_accelerator_and_postprocess()
    who = "LossScaleCallback" if with_callback else r"use_lossscale\(trainer\)"
    with pytest.raises(
        RuntimeError,
        match=who + r": the Trainer's optimizer steps with NoneType, not the scaler "
        r"use_lossscale\(trainer\) installed.*hyperparameter_search rebuilds it",
    ):
        built.train()


def test_the_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sys, "argv", ["transformers_trainer.py", str(tmp_path)])
    runpy.run_path(str(ROOT / "examples" / "transformers_trainer.py"), run_name="__main__")
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(printed) == 6 and all("loss_scale" in line and "skipped_steps" in line for line in printed)


def test_diagnose_true_names_the_planted_module_in_the_warning_and_in_log_history(tmp_path: Path) -> None:
    """The issue's acceptance: a GPT-2 built from a config, trained through the integration with a forward overflow
    planted in one MLP's input projection, is diagnosed by name, and the result is in ``log_history``."""
    run = trainer(tmp_path, "none", [LossScaleCallback()], overflow=False, max_steps=20, optim="adamw_torch")
    with torch.no_grad():  # weights still below 65504 in float16, its outputs past it at every step
        run.model.transformer.h[0].mlp.c_fc.weight.mul_(5e5)
    use_lossscale(run, fp16_on_cpu=True, diagnose=True, **TORCH_ARGS)
    with pytest.warns(OverflowWarning, match=r"forward overflow: 'transformer.h.0.mlp.c_fc' \(Conv1D\)") as caught:
        run.train()
    [warning] = [w.message for w in caught if isinstance(w.message, OverflowWarning)]
    assert (warning.report.kind, warning.report.module) == ("forward", "transformer.h.0.mlp.c_fc")
    # the loss is non-finite from step 0: the trigger fires at the second (1), is acted on at 2, traces step 3
    assert "the loss was non-finite 2 steps in a row; the traced step 3" in str(warning)
    found = [log for log in run.state.log_history if "overflow_kind" in log]
    assert [(log["step"], log["overflow_kind"], log["overflow_module"]) for log in found] == [
        (4, "forward", "transformer.h.0.mlp.c_fc")  # the log of the traced step (3, counted from 0), the 4th
    ]
    assert column(step_logs(run), "skipped_steps")[-1] == 20  # every step overflowed


def test_diagnose_never_warns_on_isolated_overflows_and_changes_no_log(tmp_path: Path) -> None:
    ref = trainer(tmp_path / "plain", "ours", [LossScaleCallback()], optim="adamw_torch")
    ref.train()
    run = trainer(tmp_path / "diagnosed", "none", [LossScaleCallback()], optim="adamw_torch")
    diagnosis = OverflowDiagnosis(run.model, patience=2)
    use_lossscale(run, fp16_on_cpu=True, diagnose=diagnosis, **TORCH_ARGS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train()  # overflows at steps 3 and 8
    assert not [w for w in caught if issubclass(w.category, OverflowWarning)]
    assert diagnosis.last_report is None
    assert step_logs(run) == step_logs(ref)  # no overflow_kind, the same losses, scales and skips


def test_use_lossscale_refuses_a_diagnose_it_cannot_trace(tmp_path: Path) -> None:
    built = trainer(tmp_path, "none", overflow=False)
    with pytest.raises(
        TypeError,
        match=r"use_lossscale\(diagnose='yes'\): diagnose must be True \(the Trainer's own model, trainer.model\), "
        r"a torch.nn.Module .*; got str",
    ):
        use_lossscale(built, fp16_on_cpu=True, diagnose="yes")  # type: ignore[arg-type]
    [diagnosis] = use_lossscale(built, fp16_on_cpu=True, diagnose=True).add_ons
    assert isinstance(diagnosis, OverflowDiagnosis) and diagnosis.model is built.model


def test_heal_true_heals_the_planted_mlp_and_logs_it_in_log_history(tmp_path: Path) -> None:
    """``use_lossscale(trainer, diagnose=True, heal=True)`` on a GPT-2 built from a config, a forward overflow planted
    in one MLP's input projection: healed (c_fc, then c_proj, where its float32 output overflowed the next float16
    op: two modules for one fault), the scale kept, the heals and forward faults in ``log_history``."""
    run = trainer(tmp_path, "none", [LossScaleCallback()], overflow=False, max_steps=16, optim="adamw_torch")
    with torch.no_grad():
        run.model.transformer.h[0].mlp.c_fc.weight.mul_(5e5)
    use_lossscale(run, fp16_on_cpu=True, diagnose=True, heal=True, init_scale=2.0**10, growth_interval=1000)
    with pytest.warns(lossscale.HealWarning) as caught:
        run.train()
    heals = [str(w.message).split(" (")[0] for w in caught if isinstance(w.message, lossscale.HealWarning)]
    assert heals == [
        "healed at step 3: 'transformer.h.0.mlp.c_fc' now runs in float32, outputs in float32",
        "healed at step 7: 'transformer.h.0.mlp.c_proj' now runs in float32, outputs in float32",
    ]
    logs = step_logs(run)
    assert [(log["step"], log["healed_modules"]) for log in run.state.log_history if "healed_modules" in log] == [
        (4, "transformer.h.0.mlp.c_fc"),
        (8, "transformer.h.0.mlp.c_proj"),
    ]
    assert column(logs, "loss_scale") == [2.0**10] * 16  # no forward fault lowered it
    assert column(logs, "forward_faults")[-1] == 8 and column(logs, "skipped_steps")[-1] == 8
    assert all(math.isfinite(loss) for loss in column(logs, "loss")[8:])
