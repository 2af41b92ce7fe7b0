"""LossScaleOptimizer: a torch optimizer that scales, unscales, checks, clips, skips, and says what it did.

A boundary step is the stages of :mod:`lossscale.step` in order (:mod:`lossscale._pipeline`). All mutable
state lives in two objects, the scale's owner (:class:`~lossscale.state.LossScale`) and the run position
(:class:`_Run`), never in attributes rebound later: a framework proxy that copies this object's
``__dict__`` (Lightning's ``LightningOptimizer``) shares both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from lossscale import step as stages
from lossscale._masked import MaskedSkip
from lossscale._optimizer_hooks import Attachments
from lossscale._optimizer_view import OptimizerView
from lossscale._pipeline import run_boundary
from lossscale.options import StepOptions, check_module, refuse_float16_params, upgrade_old_spellings
from lossscale.policy import Policy
from lossscale.result import StepResult
from lossscale.state import LossScale

__all__ = ["LossScaleOptimizer"]


@dataclass
class _Run:
    """Where a run is: micro-batch in the window, boundaries so far, the window's decision, the schedule."""

    micro: int = 0
    boundaries: int = 0
    window: tuple[bool, str | None] | None = None  # (scaled?, precision) fixed at a window's first loss
    unscaled_by: torch.Tensor | None = None
    last_result: StepResult | None = None
    schedule: Any = None
    seen_switch: bool = False
    options: StepOptions | None = None
    loss_finite: torch.Tensor | None = None  # every loss of the window finite (policies that observe it)
    layers: Any = None  # per-layer scales (LayerScales), when on


class LossScaleOptimizer(Attachments, OptimizerView):
    """Wraps any ``torch.optim.Optimizer`` with dynamic loss scaling; ``step()`` returns a :class:`StepResult`.

    Usage::

        opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), fused=True), clip_grad_norm=1.0)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x)
        opt.backward(loss)          # loss * scale / accumulation_steps, then backward
        result = opt.step()         # StepResult(stepped, found_inf, scale, next_scale, grad_norm, ...)
        opt.zero_grad()

    It is a torch optimizer whose ``param_groups``, ``state`` and ``defaults`` are the inner one's: LR
    schedulers, ``register_step_pre_hook``/``post_hook`` and the state-dict hooks work on it.

    Skip modes (how an overflowing step is skipped):
        ``"fused"``: the inner optimizer takes ``grad_scale``/``found_inf`` (fused Adam/AdamW/SGD) and skips
        in its kernel; unscaling and global-norm clipping are folded into ``grad_scale``. No host read.
        ``"host"``: found_inf is read once and ``inner.step()`` is not called (torch's behaviour).
        ``"masked"``: the inner step runs and parameters and state are restored where found_inf; no host
        read, at the cost of a snapshot and a masked restore of params and state.
        ``"auto"``: ``"fused"`` when the optimizer supports it and no stage needs the unscaled gradients
        written; else ``"host"``.

    Passes over the gradients per boundary (fused, global-norm clip): one read. (host/masked: one read for
    the norm or none, plus one read+write to unscale.) Saturation mode adds one read.

    Args:
        inner: The optimizer to wrap (float32 parameters; float16 ones are refused).
        policy: A :class:`~lossscale.policy.Policy` (default ``DynamicScale()``, torch's rule), or a
            :class:`~lossscale.state.LossScale` to share the scale with another object (a facade).
        overflow_mode: ``"inf_nan"`` or ``"saturation"``.
        clip_grad_norm: Clip the unscaled gradients to this global L2 norm (torch's ``clip_grad_norm_``).
        clip_grad_value: Clamp each unscaled gradient value to [-v, v].
        accumulation_steps: Micro-batches per optimizer step; the loss is divided by it.
        ema: An :class:`~lossscale.EMA`, advanced only on applied steps.
        weight_decay: Decoupled decay ``p -= lr * weight_decay * p`` before applied steps only.
        skip_mode: ``"auto"``, ``"fused"``, ``"host"`` or ``"masked"``.
        saturation_dtype: Format whose max defines saturation (default float16).
        process_group: found_inf is reduced over it under torch.distributed (default: world).
        sharded_grads: Which gradients are shards whose squared norms are summed over ranks when clipping.
            None: detected per gradient (DTensor ``Shard``, as FSDP2). True: every one. False: none.
        module: Gives parameter names to overflow attribution.
        schedule: A :class:`~lossscale.PrecisionSchedule`; scaling runs only while it is in float16.
        check_when_unscaled: Keep catching inf/NaN (and skipping) while scaling is off (bf16/fp32 phase).
        layerwise: A model, a list of modules or a :class:`~lossscale.layerwise.LayerScales`: one extra
            power-of-two scale per module on top of the global one (see docs/layerwise.md).
        underflow_stride: Turn on the underflow meter (``StepResult.underflow``): sample every n-th value of
            the scaled gradients and report the share float16 would round to zero (reads 1/n of them).
        transform_unscaled: Called as ``fn(grads, process_group=..., sharded=...)`` on the unscaled
            gradients after the overflow check, before the step (e.g. :class:`~lossscale.clip.PerTensorClip`).

    Policies that observe the gradient maximum (``PredictiveScale``) get it from the overflow pass
    (``aminmax``: one read, replacing the plain check); with global-norm clipping it is one extra read.
    """

    def __init__(self, inner: torch.optim.Optimizer, *args: Any, policy: Policy | LossScale | None = None,
                 module: torch.nn.Module | None = None, schedule: Any = None, layerwise: Any = None,
                 **options: Any) -> None:
        if args or "clip_grad_norm_per_param" in options:
            options = upgrade_old_spellings(args, dict(options, policy=policy) if policy is not None else options)
            policy = options.pop("policy", policy)
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"LossScaleOptimizer(inner={type(inner).__name__}): inner must be a torch.optim.Optimizer.")
        if isinstance(inner, LossScaleOptimizer):
            raise TypeError("LossScaleOptimizer(inner=LossScaleOptimizer): wrap the inner optimizer once, not a wrapper.")
        check_module("LossScaleOptimizer", module)
        self._run = _Run(options=StepOptions(**options))
        self._run.options.resolved_skip_mode(inner)  # refuses skip_mode="fused" for an optimizer without it
        self._init_view(inner)
        self.module = module
        params = [p for g in inner.param_groups for p in g["params"]]
        self._device = params[0].device if params else torch.device("cpu")
        self._owner = LossScale.shared_or_new(policy, self._device)
        self._masked = MaskedSkip()
        if self.options.ema is not None:
            self.options.ema.bind(params)
        if schedule is not None:
            self.attach_schedule(schedule)
        refuse_float16_params(inner)
        if layerwise is not None:
            self.attach_layerwise(layerwise)

    # --- what users read ---------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """The options by their names (``opt.clip_grad_norm``, ``opt.accumulation_steps``, ...)."""
        run = self.__dict__.get("_run")
        if run is not None and name in StepOptions.__dataclass_fields__:
            return getattr(run.options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def options(self) -> StepOptions:
        """The frozen, validated step options."""
        return self._run.options

    def configure(self, **changes: Any) -> None:
        """Change step options (validated as at construction), e.g. ``opt.configure(clip_grad_norm=1.0)`` for a
        framework that maps its own clipping setting; kept in the shared run state, so a proxy's call lands."""
        self._run.options = dataclasses.replace(self._run.options, **changes)
        self._run.options.resolved_skip_mode(self.inner)

    @property
    def skip_mode(self) -> str:
        """The skip mode in use (``"auto"`` resolved for the inner optimizer)."""
        return self.options.resolved_skip_mode(self.inner)

    @property
    def _explicit_unscale(self) -> bool:
        """Whether the gradients are unscaled by a pass of ours (not in a fused kernel)."""
        return self.skip_mode != "fused" or self.options.writes_unscaled or self._run.layers is not None

    @property
    def policy(self) -> Policy:
        """The frozen rule."""
        return self._owner.policy

    @property
    def loss_scale(self) -> LossScale:
        """The one owner of the scale and counters (share it to share the scale)."""
        return self._owner

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale, a 0-d float32 tensor on the parameters' device (no host read)."""
        return self._owner.scale

    @property
    def scale_state(self) -> Any:
        """The policy's whole state record."""
        return self._owner.state

    @property
    def schedule(self) -> Any:
        """The attached :class:`~lossscale.PrecisionSchedule`, or None."""
        return self._run.schedule

    @property
    def last_result(self) -> StepResult | None:
        """What the last ``step()`` returned."""
        return self._run.last_result

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        """Set the loss scale (validated: a finite float32 normal number in the policy's bounds; a tensor on an
        accelerator costs one device sync to validate); the policy's counters carry on."""
        self._owner.set_scale(new_scale, f"LossScaleOptimizer.set_scale(new_scale={new_scale!r})", "new_scale")

    @property
    def scaling_active(self) -> bool:
        """Whether losses are scaled now: always without a schedule; only in float16 with one."""
        return self.schedule is None or self.schedule.dtype == torch.float16

    def __repr__(self) -> str:
        return f"LossScaleOptimizer({self.inner!r}, policy={self.policy!r}, skip_mode={self.skip_mode!r})"

    # --- the training-loop calls ---------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale / accumulation_steps`` (the scale only while scaling is active). No host read.

        Whether to scale is fixed at the first loss of an accumulation window and holds to its step(), so a
        schedule that switches mid-window never mixes scaled and unscaled gradients."""
        run = self._run
        if run.window is None:
            run.window = (self.scaling_active, self._precision())
        if not run.window[0] and self.options.accumulation_steps == 1:
            stages.scale_loss(loss, self._owner.scale)  # the same type check
            return loss
        factor = self._owner.scale if run.window[0] else torch.ones_like(self._owner.scale)
        scaled = stages.scale_loss(loss, factor, self.options.accumulation_steps)
        if self.policy.observes_loss_finite:
            finite = torch.isfinite(loss.detach()).all()
            run.loss_finite = finite if run.loss_finite is None else run.loss_finite & finite
        return scaled

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``scale_loss(loss).backward(**kwargs)``."""
        self.scale_loss(loss).backward(**kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients at the start of an accumulation window; a no-op in the middle of one."""
        if self._run.micro == 0:
            self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> StepResult:  # type: ignore[override]
        """Count a micro-batch; at an accumulation boundary run the pipeline and return its decision.

        ``closure`` (as torch optimizers take it) runs first, with grad enabled; it should compute the loss
        and call ``opt.backward(loss)``; its return value is ``StepResult.loss``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        run = self._run
        run.micro += 1
        if run.micro < self.options.accumulation_steps:
            false = torch.zeros((), dtype=torch.bool, device=self._device)
            scale = self._owner.scale
            result = StepResult(stepped=false, found_inf=false, scale=scale, next_scale=scale, accumulating=True,
                                step=run.boundaries, loss=loss,
                                precision=self._precision() if run.window is None else run.window[1])
        else:
            run.micro = 0
            result = self._boundary_step(loss)
        run.last_result = result
        return result

    # --- the pipeline --------------------------------------------------------------------------

    def _boundary_step(self, loss: Any) -> StepResult:
        return run_boundary(self, loss)

    # --- attribution, checkpoints ------------------------------------------------------------------

    def overflowing_parameters(self) -> list[str]:
        """Names of the parameters whose gradients overflowed in the last step (before ``zero_grad``).

        Cost: one read of the gradients and one host read; call it after a skipped step, when asked."""
        names = {id(p): n for n, p in self.module.named_parameters()} if self.module is not None else {}
        divided = 1.0 if self._run.unscaled_by is None else float(self._run.unscaled_by)
        return stages.overflowing_names(self.inner, names, self.options.overflow_mode, self.options.threshold,
                                        divided)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Inner optimizer, policy state, accumulation position (with the gradients accumulated so far
        when saved mid-window), EMA and schedule in one dict; the state-dict hooks run around it."""
        from lossscale._checkpoint import optimizer_state_dict

        return self._state_dict_with_hooks(lambda: optimizer_state_dict(self))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore everything :meth:`state_dict` saved; the dict is validated before anything changes."""
        from lossscale._checkpoint import load_optimizer_state_dict

        self._load_with_hooks(state_dict, lambda sd: load_optimizer_state_dict(self, sd))

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("LossScaleOptimizer is not pickled directly; save opt.state_dict() with torch.save.")


# Kept for imports of 0.1.
from lossscale.options import SkipMode  # noqa: E402,F401
