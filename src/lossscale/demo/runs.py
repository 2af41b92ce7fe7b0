"""The runs the demo compares: a table ``name -> RunSpec``; adding a run is adding one entry.

Every run wraps the same fused AdamW in :class:`lossscale.LossScaleOptimizer` (so accumulation, the
non-finite check and the :class:`~lossscale.StepResult` are the same code for all of them); only the
autocast precision and the loss-scale policy differ::

    fp32            no autocast;        FixedScale(1.0): numerically plain AdamW
    fp16-noscale    autocast float16;   FixedScale(1.0): no loss scaling (non-finite steps still skipped)
    fp16-dynamic    autocast float16;   DynamicScale(init_scale=cfg.init_scale, growth_interval=cfg.growth_interval):
                                        torch's rule (x0.5 and skip on overflow, x2 after a run of clean steps)
    fp16-predictive autocast float16;   PredictiveScale(init_scale=cfg.init_scale): set from the observed maximum
    bf16            autocast bfloat16;  FixedScale(1.0): bfloat16 has float32's range, needs no scaling
    fast|step|0.9   PrecisionSchedule: float16 for the first 90% of steps, then float32; fp16-dynamic's policy

Both scaled runs start from ``cfg.init_scale`` (2**32, Megatron-LM's default), which overflows: the dynamic
rule halves it one skipped step at a time, the predictive rule jumps to a safe scale after one.
``--quick`` runs :data:`QUICK_RUNS` (all but the schedule); the default runs all of them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from lossscale import DynamicScale, FixedScale, PredictiveScale
from lossscale.demo.config import DemoConfig

__all__ = ["RunSpec", "RUNS", "QUICK_RUNS", "parse_runs"]


@dataclass(frozen=True)
class RunSpec:
    """How one run trains.

    Attributes:
        name: The run's name on the command line, in the table and in ``results.json``.
        summary: What it is, in a few words (the table and ``results.json`` show it).
        dtype: The autocast dtype, or None for float32 (ignored when ``schedule`` is set).
        policy: Builds the loss-scale policy from the demo's configuration.
        schedule: A :class:`lossscale.PrecisionSchedule` mode, or None.
    """

    name: str
    summary: str
    dtype: torch.dtype | None
    policy: Callable[[DemoConfig], Any]
    schedule: str | None = None

    def make_schedule(self, total_steps: int) -> Any:
        """The run's :class:`lossscale.PrecisionSchedule`, or None."""
        if self.schedule is None:
            return None
        from lossscale import PrecisionSchedule

        return PrecisionSchedule(self.schedule, total_steps=total_steps)

    def autocast(self, device_type: str, schedule: Any) -> ContextManager[Any]:
        """The forward pass's precision at this step."""
        if schedule is not None:
            return schedule.autocast(device_type)
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.dtype)


def _no_scaling(cfg: DemoConfig) -> FixedScale:
    return FixedScale(1.0)


def _dynamic(cfg: DemoConfig) -> DynamicScale:
    return DynamicScale(init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)


def _predictive(cfg: DemoConfig) -> PredictiveScale:
    return PredictiveScale(init_scale=cfg.init_scale)


RUNS: dict[str, RunSpec] = {
    spec.name: spec
    for spec in [
        RunSpec("fp32", "float32, the reference", None, _no_scaling),
        RunSpec("fp16-noscale", "float16 autocast, loss scale fixed at 1", torch.float16, _no_scaling),
        RunSpec("fp16-dynamic", "float16 autocast, DynamicScale: halve and skip on overflow, grow after clean steps",
                torch.float16, _dynamic),
        RunSpec("fp16-predictive", "float16 autocast, PredictiveScale: set from the observed gradient maximum",
                torch.float16, _predictive),
        RunSpec("bf16", "bfloat16 autocast, no loss scaling", torch.bfloat16, _no_scaling),
        RunSpec("fast|step|0.9", "PrecisionSchedule: float16 (dynamic scale) for 90% of steps, then float32",
                None, _dynamic, schedule="fast|step|0.9"),
    ]
}

#: ``--quick``'s runs: the schedule is left out (it repeats fp16-dynamic's first 90% and costs as much).
QUICK_RUNS: tuple[str, ...] = ("fp32", "fp16-noscale", "fp16-dynamic", "fp16-predictive", "bf16")


def parse_runs(text: str) -> list[RunSpec]:
    """``"fp32,fp16-dynamic"`` -> their specs, in the order given; a ValueError naming the known runs."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--runs {text!r}: name at least one run; the runs are {', '.join(RUNS)}")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise ValueError(f"--runs {text!r}: unknown run {unknown[0]!r}; the runs are {', '.join(RUNS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--runs {text!r}: each run may be named once")
    return [RUNS[n] for n in names]
