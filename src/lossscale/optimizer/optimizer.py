"""LossScaleOptimizer: a torch optimizer that scales, unscales, checks, clips, skips, and says what it did."""

from __future__ import annotations

import dataclasses
import sys
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, NamedTuple

import torch

from lossscale import stages
from lossscale.addons.arguments import add_ons_from, validate_add_ons
from lossscale.addons.base import AddOn, Host, StepOutcome
from lossscale.ops.clip import global_clip_coefficient, global_norm_squared
from lossscale.ops.flat import FlatGrads
from lossscale.ops.masked import MaskedSkip
from lossscale.ops.overflow import OverflowMode
from lossscale.ops.underflow import underflow_share
from lossscale.optimizer import checkpoint
from lossscale.optimizer.options import Plans, StepOptions, StepPlan, resolve
from lossscale.policies.base import FloorError, Policy, validate_policy
from lossscale.reporting import StepResult
from lossscale.state import LossScale
from lossscale.validation import ArgumentTypeError, capturing

__all__ = ["LossScaleOptimizer"]


def _outside_caller() -> int:
    """The ``stacklevel`` that points a warning raised by the caller at the first frame outside lossscale and
    torch (the user's line, however many of our calls and torch's wrappers are between)."""
    level, frame = 2, sys._getframe(2)  # 1 is the caller itself
    frame_or_none: FrameType | None = frame
    while frame_or_none is not None and frame_or_none.f_globals.get("__name__", "").partition(".")[0] in (
        "lossscale",
        "torch",
    ):
        level, frame_or_none = level + 1, frame_or_none.f_back
    return level


def _refuse_float16_parameters(inner: torch.optim.Optimizer) -> None:
    """A ValueError naming the first float16 parameter: its unscaled gradients would underflow."""
    for i, group in enumerate(inner.param_groups):
        for j, p in enumerate(group["params"]):
            if p.dtype == torch.float16:
                raise ValueError(
                    f"LossScaleOptimizer(inner): param_groups[{i}][{j}] is a float16 parameter; its unscaled "
                    f"gradients (scaled values / scale) would underflow in float16 and its updates round away. "
                    f"Keep the parameters in float32 and run the forward pass under torch.autocast(dtype="
                    f"torch.float16) (mixed precision), or keep float32 master copies for the optimizer."
                )


class ScaledReads(NamedTuple):
    """What a step read of the scaled gradients before unscaling them (each None where the plan reads none)."""

    underflow: torch.Tensor | None  # the underflow meter's share
    amax: torch.Tensor | None  # the largest magnitude, for a policy that reads it
    norm_squared: torch.Tensor | None  # the squared global norm, the clip's input


class Window(NamedTuple):
    """What an accumulation window decided at its first loss."""

    scaled: bool  # the window's losses are scaled
    precision: str | None  # the precision its forward passes ran in, where an add-on decides it


@dataclass
class _Run:
    """Where a run is: what changes from step to step (with the LossScale, the optimizer's mutable state)."""

    micro: int = 0  # micro-batches of the window under way
    boundaries: int = 0  # optimizer steps so far, skipped ones included
    window: Window | None = None  # fixed at a window's first loss
    loss_finite: torch.Tensor | None = None  # every loss of the window finite (policies that observe it)
    unscaled_by: torch.Tensor | None = None  # the scale our pass divided the last step's gradients by
    last_result: StepResult | None = None
    seen_switch: bool = False  # the switch back to the original precision was reported


class _WindowScaled:
    """Whether the losses of the optimizer's accumulation window under way are scaled (as fixed at the window's
    first loss; before it, whether scaling is active now): :attr:`Host.is_scaled` for its add-ons. Holds the
    optimizer weakly, so that a deep copy of an add-on (or of a model whose hooks lead to one) does not copy the
    optimizer."""

    def __init__(self, optimizer: LossScaleOptimizer) -> None:
        self._optimizer = weakref.ref(optimizer)

    def __call__(self) -> bool:
        optimizer = self._optimizer()
        if optimizer is None:  # the optimizer is gone: scale, as without one
            return True
        window = optimizer._run.window
        return optimizer.scaling_active if window is None else window.scaled


_LOW_PRECISIONS = ("float16", "bfloat16")


class LossScaleOptimizer(torch.optim.Optimizer):
    """Wraps any ``torch.optim.Optimizer`` with dynamic loss scaling; ``step()`` returns a :class:`StepResult`.

    Usage::

        opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), fused=True), clip_grad_norm=1.0)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x)
        opt.backward(loss)          # loss * scale / accumulation_steps, then backward
        result = opt.step()         # StepResult(stepped, found_inf, scale, next_scale, grad_norm, ...)
        opt.zero_grad()

    Its ``param_groups``, ``state`` and ``defaults`` are the inner one's; LR schedulers and hooks work on it.

    A boundary step (``_boundary_step``; where each check and unscale happens is resolved once, in
    :mod:`lossscale.optimizer.options`)::

        found_inf = guard(scale); inv = 1/scale
        measure the scaled gradients (amax / saturation / a check for a fused kernel), or an add-on unscales them
        the global norm (the clip's input; a non-finite norm is an overflow)
        unscale by inv x clip in one pass (checking where nothing checked yet), or leave it to a fused kernel
        agree found_inf over ranks; add-ons see the unscaled gradients; skip or apply (fused / host / masked)
        advance the add-ons and the policy with found_inf (and amax, loss finiteness); add-ons see the outcome

    Skip modes (how an overflowing step is skipped):
        ``"fused"``: the inner optimizer takes ``grad_scale``/``found_inf`` (fused Adam/AdamW/SGD) and skips
        in its kernel, unscaling and clipping folded into ``grad_scale``. No host read.
        ``"host"``: found_inf is read once and ``inner.step()`` is not called (torch's behaviour).
        ``"masked"``: the inner step runs and parameters and state are restored where found_inf; no host read.
        On a GPU the optimizer state must live there too (torch's optimizers: ``capturable=True`` or
        ``fused=True``); a state tensor in host memory (a ``step`` counter) raises a ValueError at the first
        masked step.
        ``"auto"``: ``"fused"`` where the optimizer takes it and no stage writes unscaled gradients, else ``"host"``.

    Passes over the gradients per boundary: fused without clipping, one read+write (the check); fused with
    global-norm clipping, one read (the norm is the check); host/masked, one read+write to unscale and check
    (plus one read for the norm when clipping). Saturation mode, and a policy that observes amax, add one read.

    Args:
        inner: The optimizer to wrap (float32 parameters; float16 ones are refused).
        policy: A :class:`~lossscale.Policy` (default ``DynamicScale()``, torch's rule), or a
            :class:`~lossscale.LossScale` to share the scale with another object (a facade).
        overflow_mode: ``"inf_nan"`` or ``"saturation"``.
        clip_grad_norm: Clip the unscaled gradients to this global L2 norm (torch's ``clip_grad_norm_``).
        clip_grad_value: Clamp each unscaled gradient value to [-v, v] (torch's ``clip_grad_value_``, Lightning's
            ``gradient_clip_algorithm="value"``); at most one of the two clips.
        accumulation_steps: Micro-batches per optimizer step; the loss is divided by it.
        ema: An :class:`~lossscale.EMA`, advanced only on applied steps.
        skip_mode: ``"auto"``, ``"fused"``, ``"host"`` or ``"masked"``.
        saturation_dtype: Format whose max defines saturation (default float16).
        process_group: found_inf is reduced over it under torch.distributed (default: world).
        sharded_grads: Which gradients are shards whose squared norms are summed over ranks when clipping.
            None: detected per gradient (DTensor ``Shard``, as FSDP2). True: every one. False: none.
        module: Gives parameter names to overflow attribution.
        schedule: A :class:`~lossscale.PrecisionSchedule`; scaling runs only while it is in float16.
        check_when_unscaled: Keep catching inf/NaN (and skipping those steps) while scaling is off, in a precision
            schedule's bfloat16 or float32 phase, where a non-finite step would otherwise reach the weights.
        layerwise: A model, a list of modules or a :class:`~lossscale.addons.layerwise.LayerScales`: one extra
            power-of-two scale per module on top of the global one (the optimizer's other parameters follow it).
        diagnose: The model to trace when the loss scale collapses (:mod:`lossscale.diagnosis`): the next step's
            forward and backward name the first non-finite value in a :class:`~lossscale.OverflowWarning`.
        add_ons: Further :class:`~lossscale.addons.base.AddOn` objects (a facade's extras, your own), whose hooks
            run in order after those of ``ema``, ``schedule``, ``layerwise`` and ``diagnose``.
        underflow_stride: n: the underflow meter (``StepResult.underflow``) samples every n-th scaled value.
        flat_grads: Keep every gradient as a view of one buffer per (device, dtype)
            (:class:`~lossscale.ops.flat.FlatGrads`), so that the step's passes (check, norm, amax, unscale) are
            one kernel per buffer whatever the number of parameters. Every parameter then always has a gradient
            (zeros where a backward gave none) and ``zero_grad()`` zeroes the buffer in place, whatever
            ``set_to_none`` says, as DDP's ``gradient_as_bucket_view=True``. Gradients set to None elsewhere
            (``model.zero_grad()``) become zeroed views again at the next ``scale_loss``/``backward``; other tensors
            in ``.grad`` are copied in (at ``scale_loss`` or at the step), with a warning the first time.
            Dense ``torch.Tensor`` parameters only (not FSDP2's DTensors).
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        *,
        policy: Policy[Any] | LossScale[Any] | None = None,
        module: torch.nn.Module | None = None,
        ema: AddOn | None = None,
        schedule: AddOn | None = None,
        layerwise: Any = None,
        diagnose: torch.nn.Module | AddOn | None = None,
        add_ons: list[AddOn] | tuple[AddOn, ...] = (),
        **options: Any,
    ) -> None:
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"LossScaleOptimizer(inner={type(inner).__name__}): inner must be a torch.optim.Optimizer.")
        if isinstance(inner, LossScaleOptimizer):
            raise TypeError(
                "LossScaleOptimizer(inner=LossScaleOptimizer): wrap the inner optimizer once, not a wrapper."
            )
        if module is not None and not isinstance(module, torch.nn.Module):
            raise ArgumentTypeError(
                f"LossScaleOptimizer(module={module!r}): module must be None or the "
                f"torch.nn.Module whose parameters the optimizer updates (it names them); got "
                f"{type(module).__name__}."
            )
        if policy is not None and not isinstance(policy, LossScale):
            validate_policy("LossScaleOptimizer", policy)
        self.inner = inner
        self._options = StepOptions(**options)
        # What torch.optim.Optimizer.__init__ sets up, minus the parameter groups (they are the inner one's).
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._patch_step_function()  # torch's: step() runs the step hooks
        self.module = module
        params = self._params()
        self._device = params[0].device if params else torch.device("cpu")
        self._loss_scale = LossScale.shared_or_new(policy, self._device)
        self._masked = MaskedSkip()
        self._run = _Run()
        self._flat: FlatGrads | None = None  # the gradient buffer (flat_grads=True)
        self._flat_warned = False
        self._add_ons = add_ons_from("LossScaleOptimizer", params, self._device, ema=ema, schedule=schedule)
        _refuse_float16_parameters(inner)  # after the schedule's refusal, before anything hooks the model
        self._add_ons += add_ons_from(
            "LossScaleOptimizer", params, self._device, layerwise=layerwise, diagnose=diagnose, add_ons=add_ons
        )
        validate_add_ons("LossScaleOptimizer", self._add_ons)
        self._configure(self._options)
        self._run.seen_switch = self._precision() not in (None, *_LOW_PRECISIONS)

    # --- the inner optimizer's groups, state and defaults ---------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer (with ``flat_grads``, a new buffer holds every gradient)."""
        self.inner.add_param_group(param_group)
        if self._flat is not None:
            self._flat = self._flat_grads()

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.inner.param_groups for p in g["params"]]

    # --- what users read ---------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """The options by their names (``opt.clip_grad_norm``, ``opt.accumulation_steps``, ...)."""
        options = self.__dict__.get("_options")
        if options is not None and name in StepOptions.__dataclass_fields__:
            return getattr(options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def options(self) -> StepOptions:
        """The frozen, checked step options."""
        return self._options

    @property
    def plan(self) -> Plans:
        """How a boundary step runs (:mod:`lossscale.optimizer.options`), resolved from the options."""
        return self._plans

    @property
    def add_ons(self) -> tuple[AddOn, ...]:
        """The add-ons, in the order their hooks run."""
        return tuple(self._add_ons)

    def configure(self, **changes: Any) -> None:
        """Change step options (checked as at construction), e.g. ``opt.configure(clip_grad_norm=1.0)``."""
        self._configure(dataclasses.replace(self._options, **changes))

    def _configure(self, options: StepOptions) -> None:
        """Install ``options``: resolve the plan, tell the add-ons, keep or drop the gradient buffer."""
        plans = resolve(options, self.inner, self._add_ons, self.policy.observes_amax)
        self._options, self._plans = options, plans
        host = Host(
            call="LossScaleOptimizer",
            params=tuple(self._params()),
            device=self._device,
            process_group=options.process_group,
            sharded_grads=options.sharded_grads,
            is_scaled=_WindowScaled(self),
        )
        for add_on in self._add_ons:
            add_on.attach(host)
        if not options.flat_grads:
            self._flat = None
        elif self._flat is None:
            self._flat = self._flat_grads()

    def _flat_grads(self) -> FlatGrads:
        """A gradient buffer over the inner optimizer's parameters, the gradients present copied in."""
        names = [
            f"param_groups[{i}][{j}]"
            for i, group in enumerate(self.inner.param_groups)
            for j in range(len(group["params"]))
        ]
        return FlatGrads(self._params(), "LossScaleOptimizer", names)

    @property
    def skip_mode(self) -> str:
        """The skip mode in use (``"auto"`` resolved for the inner optimizer)."""
        return self._plans.scaled.skip_mode

    @property
    def policy(self) -> Policy[Any]:
        """The frozen rule."""
        return self._loss_scale.policy

    @property
    def loss_scale(self) -> LossScale[Any]:
        """The object that holds the policy and its state (share it to share the scale)."""
        return self._loss_scale

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale, a 0-d float32 tensor on the parameters' device (no host read)."""
        return self._loss_scale.scale

    @property
    def scale_state(self) -> Any:
        """The policy's whole state record."""
        return self._loss_scale.state

    def _add_on(self, key: str) -> Any:
        return next((a for a in self._add_ons if a.key == key), None)

    @property
    def schedule(self) -> Any:
        """The attached :class:`~lossscale.PrecisionSchedule`, or None."""
        return self._add_on("schedule")

    @property
    def ema(self) -> Any:
        """The :class:`~lossscale.EMA`, or None."""
        return self._add_on("ema")

    @property
    def last_result(self) -> StepResult | None:
        """What the last ``step()`` returned."""
        return self._run.last_result

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        """Set the loss scale (checked; one host read for a tensor on an accelerator); the counters carry on."""
        self._loss_scale.set_scale(new_scale, f"LossScaleOptimizer.set_scale(new_scale={new_scale!r})", "new_scale")

    @property
    def scaling_active(self) -> bool:
        """Whether losses are scaled now: unless an add-on (a precision schedule outside float16) says not."""
        return all(add_on.scales_losses() for add_on in self._add_ons)

    def _precision(self) -> str | None:
        """The precision the forward passes run in now, where an add-on decides it."""
        return next((p for a in self._add_ons if (p := a.precision()) is not None), None)

    def __repr__(self) -> str:
        return f"LossScaleOptimizer({self.inner!r}, policy={self.policy!r}, skip_mode={self.skip_mode!r})"

    # --- the training-loop calls ---------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale / accumulation_steps`` (the scale only while scaling is active, as fixed at the first
        loss of the accumulation window). No host read."""
        call = "LossScaleOptimizer.scale_loss(loss)"
        run = self._run
        if run.window is None:
            run.window = Window(self.scaling_active, self._precision())
        if self._flat is not None and not self._flat.attached(params := self._params()):
            self._attach_flat(params)  # before the backward, so that it writes into the buffer
        if not run.window.scaled and self._options.accumulation_steps == 1:
            stages.validate_loss(call, loss)
            scaled = loss
        else:
            factor = self._loss_scale.scale if run.window.scaled else torch.ones_like(self._loss_scale.scale)
            scaled = stages.scale_loss(loss, factor, self._options.accumulation_steps, call)
            if self._loss_scale.policy.observes_loss_finite:
                finite = torch.isfinite(loss.detach()).all()
                run.loss_finite = finite if run.loss_finite is None else run.loss_finite & finite
        for add_on in self._add_ons:
            add_on.on_scale_loss(loss, scaled)
        return scaled

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``scale_loss(loss).backward(**kwargs)``."""
        stages.validate_loss("LossScaleOptimizer.backward(loss)", loss)
        self.scale_loss(loss).backward(**kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients at the start of an accumulation window; a no-op in the middle of one. With
        ``flat_grads``, the buffer is zeroed in place and the gradients stay its views (``set_to_none`` does not
        apply: a None would take the next backward out of the buffer)."""
        if self._run.micro == 0:
            if self._flat is not None:
                self._flat.zero_()
            else:
                self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> StepResult:  # type: ignore[override]  # torch's returns the closure's loss
        """Count a micro-batch; at an accumulation boundary run the boundary step and return its decision.
        ``closure`` runs first, with grad enabled (it calls ``opt.backward(loss)``); it returns ``StepResult.loss``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        run = self._run
        if run.window is None:  # a window whose gradients came without scale_loss (written to .grad by hand)
            run.window = Window(self.scaling_active, self._precision())
        run.micro += 1
        if run.micro < self._options.accumulation_steps:
            false = torch.zeros((), dtype=torch.bool, device=self._device)
            scale = self._loss_scale.scale
            result = StepResult(
                stepped=false,
                found_inf=false,
                scale=scale,
                next_scale=scale,
                accumulating=True,
                step=run.boundaries,
                loss=loss,
                precision=run.window.precision,
            )
        else:
            run.micro = 0
            result = self._boundary_step(loss)
        run.last_result = result
        return result

    # --- the boundary step ---------------------------------------------------------------------

    def _boundary_step(self, loss: Any) -> StepResult:
        """One optimizer step, in the order of the class docstring; ``plan`` says where each part happens."""
        run = self._run
        window, run.window = run.window, None
        assert window is not None  # step() opens it
        plan = self._plans.scaled if window.scaled else self._plans.unscaled
        groups = self._grouped_gradients()
        scale = self._loss_scale.scale
        found, inv = self._guard(plan, scale)
        reads = self._read_scaled(plan, groups, scale, found)
        grad_norm, fused_divisor = self._unscale(plan, groups, scale, found, inv, reads.norm_squared)
        found = stages.agree_(found, self._options.process_group, is_flag=True)  # 0/1, only ever set to 1
        found_inf = found.bool()
        stepped = ~found_inf
        self._apply(plan, groups, found, found_inf, stepped, fused_divisor)
        run.boundaries += 1
        fields: dict[str, Any] = {}
        if plan.scaled:
            if capturing(scale):  # the update writes the next scale into this tensor: the result keeps this one
                scale = scale.clone()
            fields = self._advance(found, reads.amax, scale)
        result_scale = scale if plan.scaled else torch.ones_like(scale)
        outcome = StepOutcome(
            stepped=stepped,
            found_inf=found_inf,
            scale=result_scale,
            next_scale=self._loss_scale.scale,
            step=run.boundaries - 1,
            scaled=plan.scaled,
        )
        for add_on in self._add_ons:
            add_on.after_step(outcome)
        run.loss_finite = None
        return StepResult(
            stepped=stepped,
            found_inf=found_inf,
            scale=result_scale,
            next_scale=outcome.next_scale,
            grad_norm=grad_norm,
            step=outcome.step,
            precision=window.precision,
            switched=self._report_switch(window.precision),
            underflow=reads.underflow,
            loss=loss,
            **fields,
        )

    def _guard(self, plan: StepPlan, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """found_inf's start (1 where the scale itself is corrupted, in scaled windows) and what unscales:
        ``1/scale`` from that verdict alone, 1 where nothing is scaled or an add-on unscales, None where only a
        fused kernel divides (by the scale itself)."""
        if not plan.scaled:
            return torch.zeros((), dtype=torch.float32, device=self._device), torch.ones_like(scale)
        found = stages.guarded_found(scale, self._device)
        if plan.add_on_unscales:
            return found, torch.ones_like(scale)
        return found, stages.inverse(scale, found) if plan.inverse_needed else None

    def _read_scaled(
        self, plan: StepPlan, groups: stages.Groups, scale: torch.Tensor, found: torch.Tensor
    ) -> ScaledReads:
        """The reads before our unscale, each where the plan has it: the underflow meter's sample, the measure
        pass (amax agreed over ranks where the policy reads it), an add-on's own unscale and check, and the squared
        global norm (non-finite: an overflow, where the plan checks). Overflow goes into ``found``."""
        options = self._options
        underflow = None
        if plan.scaled and options.underflow_stride:
            underflow = underflow_share([g for grads in groups.values() for g in grads], options.underflow_stride)
        amax = None
        if plan.measure is not None:
            amax = stages.measure_(groups, found, plan.measure_mode, options.threshold, amax=plan.measure == "amax")
            if amax is not None:
                stages.agree_amax_(amax, options.process_group)
        unscaled = (
            next((u for a in self._add_ons if (u := a.unscale(scale, found)) is not None), None)
            if plan.add_on_unscales
            else None
        )
        if unscaled is not None:
            found.logical_or_(unscaled.found_inf.to(found.device))
            amax = unscaled.amax
        norm_sq = None
        if plan.clip_norm:
            if plan.add_on_unscales:  # the add-on unscaled each parameter's own gradient: their norm
                norm_sq = global_norm_squared(self._grads(), options.process_group, options.sharded_grads, self._device)
            else:
                norm_sq = stages.norm_squared(
                    groups, self._grads, self._device, options.process_group, options.sharded_grads
                )
            if plan.checks:
                stages.note_non_finite_(found, norm_sq)
        return ScaledReads(underflow, amax, norm_sq)

    def _unscale(
        self,
        plan: StepPlan,
        groups: stages.Groups,
        scale: torch.Tensor,
        found: torch.Tensor,
        inv: torch.Tensor | None,
        norm_sq: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Unscale (x the clip coefficient): our pass as the plan has it (unscale and check, only check, only
        multiply), or the divisor a fused kernel takes. Returns (the unscaled global norm, the fused divisor)."""
        grad_norm = clip = None
        if norm_sq is not None:
            assert inv is not None and self._options.clip_grad_norm is not None  # the plan has both with a clip
            grad_norm = norm_sq.sqrt() * inv
            clip = global_clip_coefficient(grad_norm, self._options.clip_grad_norm)
        self._run.unscaled_by = scale if plan.scaled and plan.unscaler == "ours" else None
        if plan.unscaler == "kernel":
            if not (plan.scaled or clip is not None):
                return grad_norm, None
            divisor = scale.clone() if clip is None else (scale if plan.scaled else torch.ones_like(scale)) / clip
            return grad_norm, divisor
        if plan.our_pass is not None:
            assert inv is not None  # the plan computes 1/scale wherever our pass runs
            factor = None if plan.our_pass == "check" else (inv if clip is None else inv * clip)
            check: OverflowMode | None = None if plan.our_pass == "multiply" else "inf_nan"
            for grads in groups.values():
                stages.unscale_(grads, found, factor, check)
        return grad_norm, None

    def _apply(
        self,
        plan: StepPlan,
        groups: stages.Groups,
        found: torch.Tensor,
        found_inf: torch.Tensor,
        stepped: torch.Tensor,
        fused_divisor: torch.Tensor | None,
    ) -> None:
        """The value clip and the add-ons on the unscaled gradients, then the inner step, skipped where found_inf:
        in the fused kernel, on the host (one host read), or masked (on the host while the optimizer state does not
        exist yet)."""
        unscaled = plan.unscaler != "kernel"
        if plan.clip_value is not None and unscaled:
            stages.clip_value_(groups, plan.clip_value)
        grads = self._grads() if unscaled else None
        for add_on in self._add_ons:
            add_on.before_apply(stepped, grads)
        mode = plan.skip_mode
        if mode == "masked" and not self._masked.ready(self.inner):
            mode = "host"
        if mode == "host":
            call = (
                "LossScaleOptimizer.step() with skip_mode='host'"
                if plan.skip_mode == "host"
                else "LossScaleOptimizer.step() before the optimizer state exists (skip_mode='masked' decides that "
                "step on the host; step once before capturing)"
            )
            if stages.applies_on_host(found_inf, call):
                self.inner.step()
        elif mode == "masked":
            self._masked.step(self.inner, found_inf)
        else:
            stages.fused_step_(self.inner, fused_divisor, found)

    def _advance(self, found: torch.Tensor, amax: torch.Tensor | None, scale: torch.Tensor) -> dict[str, Any]:
        """The add-ons' fields for the result (read before they advance), the add-ons' update (per-layer
        exponents), then the policy's; a FloorError names the step."""
        fields: dict[str, Any] = {}
        for add_on in self._add_ons:
            fields.update(add_on.step_fields(scale))
        try:
            for add_on in self._add_ons:
                found = add_on.advance(found, scale)
            self._loss_scale.update(found, amax, self._run.loss_finite)
        except FloorError as err:
            raise FloorError(f"LossScaleOptimizer step {self._run.boundaries}: {err}") from None
        return fields

    def _report_switch(self, precision: str | None) -> bool:
        """True once: on the first boundary whose step ran in the original precision after a low-precision one."""
        run = self._run
        if precision is None or run.seen_switch or precision in _LOW_PRECISIONS:
            return False
        run.seen_switch = True
        return True

    def _grouped_gradients(self) -> stages.Groups:
        """The gradients to pass over: each flat buffer (its views attached again first where a gradient was set
        to None or replaced, with a warning the first time), else every gradient."""
        if self._flat is None:
            return stages.grouped_gradients(self.inner, "LossScaleOptimizer.step()")
        params = self._params()
        if not self._flat.attached(params):
            self._attach_flat(params)
        return stages.flat_groups(self._flat.buffers)

    def _attach_flat(self, params: list[torch.Tensor]) -> None:
        """Put the buffer's views back in ``.grad``: a new buffer where the parameter groups changed; gradients
        set to None become zeroed views; other tensors are copied in, with a warning the first time."""
        assert self._flat is not None
        if not self._flat.holds(params):
            self._flat = self._flat_grads()
        elif self._flat.attach() and not self._flat_warned:
            self._flat_warned = True
            warnings.warn(
                "LossScaleOptimizer(flat_grads=True): some gradients were not views of the gradient buffer "
                "(replaced by other tensors, or set to None and then made by a backward that did not go "
                "through opt.backward() or opt.scale_loss()), so they were copied back into it, one copy "
                "each. Zero gradients with opt.zero_grad(), and backpropagate with opt.backward(loss), to "
                "keep them in place.",
                UserWarning,
                stacklevel=_outside_caller(),
            )

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params() if p.grad is not None]

    # --- add-ons ------------------------------------------------------------------------------------

    def attach_schedule(self, schedule: AddOn) -> None:
        """Scale only while ``schedule`` (a :class:`~lossscale.PrecisionSchedule`) is in float16; refuse parameters
        already in low precision."""
        self._take(add_ons_from("LossScaleOptimizer", self._params(), self._device, schedule=schedule))
        self._run.seen_switch = self._precision() not in (None, *_LOW_PRECISIONS)

    def attach_layerwise(self, layerwise: Any) -> None:
        """Keep one scale per module of ``layerwise`` (a model, a list of modules, or a
        :class:`~lossscale.addons.layerwise.LayerScales`) on top of the global one; parameters outside its units
        follow the global scale, and at least one of the inner optimizer's parameters must belong to a unit."""
        self._take(add_ons_from("LossScaleOptimizer", self._params(), self._device, layerwise=layerwise))

    def _take(self, add_ons: list[AddOn]) -> None:
        """Add ``add_ons`` (checked with the ones already there) and resolve the plan again."""
        validate_add_ons("LossScaleOptimizer", [*self._add_ons, *add_ons])
        before = self._add_ons
        self._add_ons = [*before, *add_ons]
        try:
            self._configure(self._options)
        except Exception:
            self._add_ons = before
            raise

    # --- attribution, checkpoints ------------------------------------------------------------------

    def overflowing_parameters(self) -> list[str]:
        """Names of the parameters whose gradients overflowed in the last step (before ``zero_grad``).
        One read of the gradients and one host read."""
        names = {id(p): n for n, p in self.module.named_parameters()} if self.module is not None else {}
        divided = 1.0 if self._run.unscaled_by is None else float(self._run.unscaled_by)
        return stages.overflowing_names(
            self.inner, names, self._options.overflow_mode, self._options.threshold, divided
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything a run needs to resume, in one dict (keys: :mod:`lossscale.optimizer.checkpoint`), between
        the state-dict hooks. Host reads: the policy state."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        run = self._run
        state_dict: dict[str, Any] = {
            "inner": self.inner.state_dict(),
            "policy_state": self._loss_scale.state_dict(),
            "micro_step": run.micro,
            "boundaries": run.boundaries,
        }
        if run.micro:  # mid-window: the gradients accumulated so far are part of the position
            state_dict["accumulated_grads"] = [
                None if p.grad is None else p.grad.detach().clone() for p in self._params()
            ]
            state_dict["window"] = tuple(run.window) if run.window is not None else None
            if run.loss_finite is not None:  # a policy that observes the losses: whether the window's were finite
                state_dict["loss_finite"] = bool(run.loss_finite)
        for key, part in self._parts():
            state_dict[key] = part.state_dict()
        if self._precision() is not None:
            state_dict["seen_switch"] = run.seen_switch
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            changed = post_hook(self, state_dict)
            if changed is not None:
                state_dict = changed
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, between the load hooks; the whole dict is checked before anything changes. An
        optional part (EMA, schedule, per-layer scales) that only one side has is named in a UserWarning."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            changed = pre_hook(self, state_dict)
            if changed is not None:
                state_dict = changed
        call = "LossScaleOptimizer.load_state_dict"
        run = self._run
        params = self._params()
        micro, boundaries = checkpoint.validated_position(call, state_dict, self._options.accumulation_steps)
        grads, window = checkpoint.validated_window(call, state_dict, params, micro)
        loss_finite = checkpoint.validated_loss_finite(call, state_dict, micro)
        parts = [(key, part) for key, part in self._parts() if key in state_dict]
        for key, part in parts:
            part.validate_state_dict(state_dict[key])
        seen_switch = checkpoint.validated_seen_switch(call, state_dict)
        before = self._loss_scale.state_dict()
        self._loss_scale.load_state_dict(state_dict["policy_state"], f"{call} (key 'policy_state')")
        try:
            self.inner.load_state_dict(state_dict["inner"])
        except ValueError as err:  # torch's own refusal (another optimizer's groups): name the call and the key
            self._loss_scale.load_state_dict(before)
            raise ValueError(
                f"{call} (key 'inner'): the inner optimizer refused its state: {err}. Pass the "
                f"state_dict() of a LossScaleOptimizer over the same parameter groups."
            ) from None
        except Exception:
            self._loss_scale.load_state_dict(before)
            raise
        run.micro, run.boundaries, run.window = micro, boundaries, None if window is None else Window(*window)
        run.loss_finite = None if loss_finite is None else torch.tensor(loss_finite, device=self._device)
        for p, grad in zip(params, grads):
            p.grad = None if grad is None else grad.to(p.device).clone()
        if self._flat is not None:
            self._flat.attach()
        for key, part in parts:
            part.load_state_dict(state_dict[key])
        precision = self._precision()
        if precision is not None and any(key in state_dict for key, _ in parts):
            run.seen_switch = precision not in _LOW_PRECISIONS if seen_switch is None else seen_switch
        self._warn_unmatched_parts(call, state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _warn_unmatched_parts(self, call: str, state_dict: dict[str, Any]) -> None:
        """A UserWarning for each optional part that only one side has: this optimizer (the part keeps its state)
        or the checkpoint (its entry is ignored)."""
        have = {key for key, _ in self._parts()}
        labels = {**checkpoint.PART_LABELS, **{key: part.label for key, part in self._parts()}}
        for key, what in labels.items():
            if key in have and key not in state_dict:
                warnings.warn(
                    f"{call}: this optimizer has {what} ({key}=) and the checkpoint has no {key!r} entry; "
                    f"the {key} part keeps its current state, not the saved run's. Save the checkpoint "
                    f"from an optimizer with the same parts to resume it.",
                    UserWarning,
                    stacklevel=3,
                )
            elif key in state_dict and key not in have:
                warnings.warn(
                    f"{call}: the checkpoint holds a {key!r} entry and this optimizer has no {what}; the "
                    f"entry is ignored. Pass {key}=... when building the optimizer to resume it.",
                    UserWarning,
                    stacklevel=3,
                )

    def _parts(self) -> list[tuple[str, AddOn]]:
        """(checkpoint key, add-on) of each add-on saved in a checkpoint."""
        return [(add_on.key, add_on) for add_on in self._add_ons if add_on.key is not None]

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("LossScaleOptimizer is not pickled directly; save opt.state_dict() with torch.save.")
