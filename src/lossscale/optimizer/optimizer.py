"""LossScaleOptimizer: a torch optimizer that scales, unscales, checks, clips, skips, and says what it did."""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from lossscale import stages
from lossscale.addons.layerwise import LayerScales
from lossscale.addons.schedule import PrecisionSchedule, validate_attachable
from lossscale.validation import ArgumentTypeError, capturing
from lossscale.ops.clip import global_clip_coefficient, global_norm_squared, grouped_norm_squared
from lossscale.ops.flat import FlatGrads
from lossscale.ops.masked import MaskedSkip
from lossscale.ops.overflow import check_, unscale_and_check_
from lossscale.ops.underflow import underflow_share
from lossscale.optimizer import checkpoint
from lossscale.optimizer.options import StepOptions
from lossscale.policies.base import FloorError, Policy, validate_policy
from lossscale.reporting import StepResult
from lossscale.state import LossScale

__all__ = ["LossScaleOptimizer"]

def _outside_caller() -> int:
    """The ``stacklevel`` that points a warning raised by the caller at the first frame outside lossscale and
    torch (the user's line, however many of our calls and torch's wrappers are between)."""
    level, frame = 2, sys._getframe(2)  # 1 is the caller itself
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in ("lossscale", "torch"):
        level, frame = level + 1, frame.f_back
    return level


#: The optional parts a checkpoint may hold, by key.
_PARTS = {"ema": "an EMA", "layerwise": "per-layer scales", "schedule": "a precision schedule"}


@dataclass
class _Run:
    """Where a run is and how its steps run: with the LossScale, all of an optimizer's mutable state."""

    options: StepOptions
    skip_mode: str = "host"  # options.skip_mode resolved for the inner optimizer
    explicit_unscale: bool = True  # the gradients are unscaled by a pass of ours, not in a fused kernel
    micro: int = 0
    boundaries: int = 0
    window: tuple[bool, str | None] | None = None  # (scaled?, precision), fixed at a window's first loss
    unscaled_by: torch.Tensor | None = None
    last_result: StepResult | None = None
    schedule: PrecisionSchedule | None = None
    seen_switch: bool = False
    loss_finite: torch.Tensor | None = None  # every loss of the window finite (policies that observe it)
    layers: LayerScales | None = None
    flat: FlatGrads | None = None  # the gradient buffer (flat_grads=True)
    flat_warned: bool = False


class _WindowScaled:
    """``LayerScales.is_scaled`` for a LossScaleOptimizer: whether the losses of its accumulation window under way
    are scaled (as fixed at the window's first loss; before it, whether scaling is active now). Holds the optimizer
    weakly, so that a deep copy of the per-layer scales (or of a model whose hooks lead to them) does not copy
    the optimizer."""

    def __init__(self, optimizer: LossScaleOptimizer) -> None:
        self._optimizer = weakref.ref(optimizer)

    def __call__(self) -> bool:
        optimizer = self._optimizer()
        if optimizer is None:  # the optimizer is gone: the hooks scale, as without one
            return True
        window = optimizer._run.window
        return optimizer.scaling_active if window is None else window[0]


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

    A boundary step::

        found_inf = guard(scale); check (and amax, norm) the scaled gradients
        unscale by 1/scale (x clip coefficient), in our pass or in a fused kernel
        agree found_inf over ranks; skip or apply the inner step (fused / host / masked)
        advance the policy with found_inf (and amax, loss finiteness)

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
        layerwise: A model, a list of modules or a :class:`~lossscale.addons.layerwise.LayerScales`: one extra
            power-of-two scale per module on top of the global one (the optimizer's other parameters follow it).
        underflow_stride: n: the underflow meter (``StepResult.underflow``) samples every n-th scaled value.
        transform_unscaled: ``fn(grads, process_group=..., sharded=...)``, run on the unscaled gradients after
            the overflow check (e.g. :class:`~lossscale.ops.clip.PerTensorClip`).
        flat_grads: Keep every gradient as a view of one buffer per (device, dtype)
            (:class:`~lossscale.ops.flat.FlatGrads`), so that the step's passes (check, norm, amax, unscale) are
            one kernel per buffer whatever the number of parameters. Every parameter then always has a gradient
            (zeros where a backward gave none) and ``zero_grad()`` zeroes the buffer in place, whatever
            ``set_to_none`` says, as DDP's ``gradient_as_bucket_view=True``. Gradients set to None elsewhere
            (``model.zero_grad()``) become zeroed views again at the next ``scale_loss``/``backward``; other tensors
            in ``.grad`` are copied in (at ``scale_loss`` or at the step), with a warning the first time.
            Dense ``torch.Tensor`` parameters only (not FSDP2's DTensors).
    """

    def __init__(self, inner: torch.optim.Optimizer, *, policy: Policy | LossScale | None = None,
                 module: torch.nn.Module | None = None, schedule: PrecisionSchedule | None = None,
                 layerwise: Any = None, **options: Any) -> None:
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"LossScaleOptimizer(inner={type(inner).__name__}): inner must be a torch.optim.Optimizer.")
        if isinstance(inner, LossScaleOptimizer):
            raise TypeError("LossScaleOptimizer(inner=LossScaleOptimizer): wrap the inner optimizer once, not a "
                            "wrapper.")
        if module is not None and not isinstance(module, torch.nn.Module):
            raise ArgumentTypeError(f"LossScaleOptimizer(module={module!r}): module must be None or the "
                                    f"torch.nn.Module whose parameters the optimizer updates (it names them); got "
                                    f"{type(module).__name__}.")
        if policy is not None and not isinstance(policy, LossScale):
            validate_policy("LossScaleOptimizer", policy)
        self.inner = inner
        self._run = _Run(options=StepOptions(**options))
        self._configure(self._run.options, flat=False)
        # What torch.optim.Optimizer.__init__ sets up, minus the parameter groups (they are the inner one's).
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._patch_step_function()  # torch's: step() runs the step hooks
        self.module = module
        params = self._params()
        self._device = params[0].device if params else torch.device("cpu")
        self._loss_scale = LossScale.shared_or_new(policy, self._device)
        self._masked = MaskedSkip()
        if self.options.ema is not None:
            self.options.ema.bind(params)
        if schedule is not None:
            self.attach_schedule(schedule)
        for i, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                if p.dtype == torch.float16:
                    raise ValueError(
                        f"LossScaleOptimizer(inner): param_groups[{i}][{j}] is a float16 parameter; its unscaled "
                        f"gradients (scaled values / scale) would underflow in float16 and its updates round away. "
                        f"Keep the parameters in float32 and run the forward pass under torch.autocast(dtype="
                        f"torch.float16) (mixed precision), or keep float32 master copies for the optimizer.")
        if layerwise is not None:
            self.attach_layerwise(layerwise)
        self._configure(self.options)  # the gradient buffer, once every parameter is known to be accepted

    # --- the inner optimizer's groups, state and defaults ---------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer (with ``flat_grads``, a new buffer holds every gradient)."""
        self.inner.add_param_group(param_group)
        if self._run.flat is not None:
            self._run.flat = self._flat_grads()

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.inner.param_groups for p in g["params"]]

    # --- what users read ---------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """The options by their names (``opt.clip_grad_norm``, ``opt.accumulation_steps``, ...)."""
        run = self.__dict__.get("_run")
        if run is not None and name in StepOptions.__dataclass_fields__:
            return getattr(run.options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def options(self) -> StepOptions:
        """The frozen, checked step options."""
        return self._run.options

    def configure(self, **changes: Any) -> None:
        """Change step options (checked as at construction), e.g. ``opt.configure(clip_grad_norm=1.0)``."""
        self._configure(dataclasses.replace(self._run.options, **changes))

    def _configure(self, options: StepOptions, flat: bool = True) -> None:
        """Install ``options`` and what they resolve to for the inner optimizer (the gradient buffer too, unless
        ``flat`` is False: during construction, before the parameters are checked)."""
        skip_mode = options.resolved_skip_mode(self.inner)
        run = self._run
        run.options, run.skip_mode = options, skip_mode
        run.explicit_unscale = skip_mode != "fused" or options.writes_unscaled or run.layers is not None
        if run.layers is not None:  # the first backward's factors are agreed over the group the steps are
            run.layers.process_group = options.process_group
        if not options.flat_grads:
            run.flat = None
        elif run.flat is None and flat:
            run.flat = self._flat_grads()

    def _flat_grads(self) -> FlatGrads:
        """A gradient buffer over the inner optimizer's parameters, the gradients present copied in."""
        names = [f"param_groups[{i}][{j}]" for i, group in enumerate(self.inner.param_groups)
                 for j in range(len(group["params"]))]
        return FlatGrads(self._params(), "LossScaleOptimizer", names)

    @property
    def skip_mode(self) -> str:
        """The skip mode in use (``"auto"`` resolved for the inner optimizer)."""
        return self._run.skip_mode

    @property
    def policy(self) -> Policy:
        """The frozen rule."""
        return self._loss_scale.policy

    @property
    def loss_scale(self) -> LossScale:
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

    @property
    def schedule(self) -> PrecisionSchedule | None:
        """The attached :class:`~lossscale.PrecisionSchedule`, or None."""
        return self._run.schedule

    @property
    def last_result(self) -> StepResult | None:
        """What the last ``step()`` returned."""
        return self._run.last_result

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        """Set the loss scale (checked; one host read for a tensor on an accelerator); the counters carry on."""
        self._loss_scale.set_scale(new_scale, f"LossScaleOptimizer.set_scale(new_scale={new_scale!r})", "new_scale")

    @property
    def scaling_active(self) -> bool:
        """Whether losses are scaled now: always without a schedule; only in float16 with one."""
        return self.schedule is None or self.schedule.dtype == torch.float16

    def __repr__(self) -> str:
        return f"LossScaleOptimizer({self.inner!r}, policy={self.policy!r}, skip_mode={self.skip_mode!r})"

    # --- the training-loop calls ---------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale / accumulation_steps`` (the scale only while scaling is active, as fixed at the first
        loss of the accumulation window). No host read."""
        run = self._run
        if run.window is None:
            run.window = (self.scaling_active, self._precision())
        if run.flat is not None and not run.flat.attached(params := self._params()):
            self._attach_flat(params)  # before the backward, so that it writes into the buffer
        if not run.window[0] and self.options.accumulation_steps == 1:
            stages.validate_loss("LossScaleOptimizer.scale_loss(loss)", loss)
            scaled = loss
        else:
            factor = self._loss_scale.scale if run.window[0] else torch.ones_like(self._loss_scale.scale)
            scaled = stages.scale_loss(loss, factor, self.options.accumulation_steps,
                                       "LossScaleOptimizer.scale_loss(loss)")
            if self.policy.observes_loss_finite:
                finite = torch.isfinite(loss.detach()).all()
                run.loss_finite = finite if run.loss_finite is None else run.loss_finite & finite
        if run.layers is not None:  # the wiring walk starts from the loss too (reads of unit weights after the units)
            run.layers.backward_from(scaled)
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
            if self._run.flat is not None:
                self._run.flat.zero_()
            else:
                self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> StepResult:  # type: ignore[override]
        """Count a micro-batch; at an accumulation boundary run the boundary step and return its decision.
        ``closure`` runs first, with grad enabled (it calls ``opt.backward(loss)``); it returns ``StepResult.loss``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        run = self._run
        if run.window is None:  # a window whose gradients came without scale_loss (Keras's apply): fixed here
            run.window = (self.scaling_active, self._precision())
        run.micro += 1
        if run.micro < self.options.accumulation_steps:
            false = torch.zeros((), dtype=torch.bool, device=self._device)
            scale = self._loss_scale.scale
            result = StepResult(stepped=false, found_inf=false, scale=scale, next_scale=scale, accumulating=True,
                                step=run.boundaries, loss=loss, precision=run.window[1])
        else:
            run.micro = 0
            result = self._boundary_step(loss)
        run.last_result = result
        return result

    # --- the boundary step ---------------------------------------------------------------------

    def _boundary_step(self, loss: Any) -> StepResult:
        """One optimizer step: measure, unscale (x clip), agree, apply, advance (see the class docstring)."""
        run, options = self._run, self.options
        active, precision = run.window
        run.window = None
        checking = active or options.check_when_unscaled
        groups = self._grouped_gradients()
        scale = self._loss_scale.scale
        found = stages.guarded_found(scale, self._device) if active else torch.zeros(
            (), dtype=torch.float32, device=self._device)
        layers = run.layers if active else None
        underflow = None
        if active and options.underflow_stride:
            underflow = underflow_share([g for grads in groups.values() for g in grads], options.underflow_stride)

        layer_obs = layer_scales = None
        if layers is None:
            # 1/scale from the guard's verdict alone; a fused kernel without clipping divides by the scale itself
            if not active:
                inv = torch.ones_like(scale)
            elif run.explicit_unscale or options.clip_grad_norm is not None:
                inv = stages.inverse(scale, found)
            else:
                inv = None
            amax, norm_sq, detected = self._measure(groups, found, active, checking)
        else:  # per-layer scales: each unit unscaled by scale * 2**e[unit] and checked in one pass
            layer_obs, amax, norm_sq = self._measure_layers(layers, found, scale)
            inv, detected, layer_scales = torch.ones_like(scale), True, layers.layer_scales(scale)
        grad_norm = clip = None
        if norm_sq is not None:
            grad_norm = norm_sq.sqrt() * inv
            clip = global_clip_coefficient(grad_norm, options.clip_grad_norm)
        coef = inv if clip is None else inv * clip  # None: only the fused kernel unscales (by the scale)
        self._unscale(groups, found, coef, active and layers is None, checking and not detected, clip is not None)
        found = stages.agree_(found, options.process_group, is_flag=True)  # starts 0/1, only ever set to 1
        overflow = found.bool()
        stepped = ~overflow
        self._transform_unscaled(groups)
        self._apply(found, overflow, stepped, self._fused_divisor(scale, active, clip))

        run.boundaries += 1
        if run.schedule is not None:  # the schedule warns once when it is never fed
            run.schedule.note_optimizer_step()
        if options.ema is not None:
            options.ema.update(stepped, run.boundaries)
        if active:
            if capturing(scale):  # the update writes the next scale into this tensor: the result keeps this one
                scale = scale.clone()
            self._advance(found, amax, layers, layer_obs, scale)
        run.loss_finite = None
        return StepResult(stepped=stepped, found_inf=overflow, scale=scale if active else torch.ones_like(scale),
                          next_scale=self._loss_scale.scale, grad_norm=grad_norm, step=run.boundaries - 1,
                          precision=precision, switched=self._consume_switch(precision), underflow=underflow,
                          loss=loss, layer_scales=layer_scales)

    def _grouped_gradients(self) -> stages.Groups:
        """The gradients to pass over: each flat buffer (its views attached again first where a gradient was set
        to None or replaced, with a warning the first time), else every gradient."""
        run = self._run
        if run.flat is None:
            return stages.grouped_gradients(self.inner, "LossScaleOptimizer.step()")
        params = self._params()
        if not run.flat.attached(params):
            self._attach_flat(params)
        return stages.flat_groups(run.flat.buffers)

    def _attach_flat(self, params: list[torch.Tensor]) -> None:
        """Put the buffer's views back in ``.grad``: a new buffer where the parameter groups changed; gradients
        set to None become zeroed views; other tensors are copied in, with a warning the first time."""
        run = self._run
        if not run.flat.holds(params):
            run.flat = self._flat_grads()
        elif run.flat.attach() and not run.flat_warned:
            run.flat_warned = True
            warnings.warn("LossScaleOptimizer(flat_grads=True): some gradients were not views of the gradient buffer "
                          "(replaced by other tensors, or set to None and then made by a backward that did not go "
                          "through opt.backward() or opt.scale_loss()), so they were copied back into it, one copy "
                          "each. Zero gradients with opt.zero_grad(), and backpropagate with opt.backward(loss), to "
                          "keep them in place.", UserWarning, stacklevel=_outside_caller())

    def _measure(self, groups: stages.Groups, found: torch.Tensor, active: bool,
                 checking: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
        """The passes before unscaling: (amax, squared norm, whether overflow was already checked)."""
        options = self.options
        observes = active and self.policy.observes_amax
        amax = norm_sq = None
        if observes:
            sink = found if checking else torch.zeros_like(found)
            amax = stages.measure_(groups, sink, options.overflow_mode, options.threshold, amax=True)
            stages.agree_amax_(amax, options.process_group)
        elif checking and active and options.overflow_mode == "saturation":
            stages.measure_(groups, found, "saturation", options.threshold, amax=False)
        if options.clip_grad_norm is not None:
            if options.sharded_grads is not True and groups.plain:
                norm_sq = grouped_norm_squared(groups, self._device)
            else:
                norm_sq = global_norm_squared(self._grads(), options.process_group, options.sharded_grads,
                                              self._device)
            if checking:
                found.logical_or_(~(norm_sq < math.inf))  # inf or NaN (a squared norm is never negative)
        detected = norm_sq is not None or (options.overflow_mode == "saturation" and active) or observes
        if checking and not detected and not self._run.explicit_unscale:
            stages.measure_(groups, found, "inf_nan", options.threshold, amax=False)
            detected = True
        return amax, norm_sq, detected

    def _measure_layers(self, layers: LayerScales, found: torch.Tensor, scale: torch.Tensor
                        ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """Per-layer unscale and check, agreed over ranks; the clip norm of the unscaled gradients."""
        options = self.options
        found_u, amax_u = layers.unscale_(scale, params=self._params())  # [units + 1]: the rest at the scale
        observed = stages.agree_amax_(torch.stack([found_u.float(), amax_u.float()]), options.process_group)
        found_u, amax_u = observed[0] > 0, observed[1]
        found.logical_or_(found_u.any().to(found.device))
        norm_sq = None
        if options.clip_grad_norm is not None:
            norm_sq = global_norm_squared(self._grads(), options.process_group, options.sharded_grads, self._device)
            found.logical_or_(~(norm_sq < math.inf))
        return (found_u, amax_u), amax_u.max().to(scale.device), norm_sq

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params() if p.grad is not None]

    def _unscale(self, groups: stages.Groups, found: torch.Tensor, coef: torch.Tensor | None, active: bool,
                 check_here: bool, clipping: bool) -> None:
        """Explicit unscaling: one read+write pass by ``coef`` (1/scale x clip), checking where nothing did yet."""
        run = self._run
        run.unscaled_by = None
        if not run.explicit_unscale:
            return
        for grads in groups.values():
            device_coef = coef.to(grads[0].device)
            if check_here:
                if active:
                    unscale_and_check_(grads, found, device_coef)
                else:
                    check_(grads, found, "inf_nan")
            elif active or clipping:
                torch._foreach_mul_(grads, device_coef)
        run.unscaled_by = self._loss_scale.scale if active else None

    def _transform_unscaled(self, groups: stages.Groups) -> None:
        """Value clipping and ``transform_unscaled`` on the unscaled gradients (explicit unscaling only)."""
        options = self.options
        if not self._run.explicit_unscale:
            return
        if options.clip_grad_value is not None:
            for grads in groups.values():
                torch._foreach_clamp_min_(grads, -options.clip_grad_value)
                torch._foreach_clamp_max_(grads, options.clip_grad_value)
        if options.transform_unscaled is not None:
            options.transform_unscaled(self._grads(), process_group=options.process_group,
                                       sharded=options.sharded_grads)

    def _fused_divisor(self, scale: torch.Tensor, active: bool, clip: torch.Tensor | None) -> torch.Tensor | None:
        """What the fused kernel divides the gradients by: scale / clip in a tensor of its own, or None."""
        if self._run.explicit_unscale or not (active or clip is not None):
            return None
        if clip is None:
            return scale.clone()
        return (scale if active else torch.ones_like(scale)) / clip

    def _apply(self, found: torch.Tensor, overflow: torch.Tensor, stepped: torch.Tensor,
               fused_divisor: torch.Tensor | None) -> None:
        """The inner step, skipped where found_inf: in the fused kernel, on the host (one host read), or masked
        (on the host while the optimizer state does not exist yet)."""
        mode = self._run.skip_mode
        if mode == "masked" and not self._masked.ready(self.inner):
            mode = "host"
        if mode == "host":
            call = ("LossScaleOptimizer.step() with skip_mode='host'" if self._run.skip_mode == "host" else
                    "LossScaleOptimizer.step() before the optimizer state exists (skip_mode='masked' decides that "
                    "step on the host; step once before capturing)")
            if stages.applies_on_host(overflow, call):
                self._decay(None)
                self.inner.step()
            return
        self._decay(stepped)
        if mode == "masked":
            self._masked.step(self.inner, overflow)
        else:
            stages.fused_step_(self.inner, fused_divisor, found)

    @torch.no_grad()
    def _decay(self, stepped: torch.Tensor | None) -> None:
        """Decoupled weight decay ``p *= 1 - lr * wd``, exactly 1 where the step is skipped (``stepped`` False)."""
        wd = self.options.weight_decay
        if not wd:
            return
        for group in self.inner.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            rate = group["lr"] * wd
            if stepped is None:
                torch._foreach_mul_(params, 1.0 - rate)
            else:
                factor = 1.0 - stepped.to(torch.float32) * rate
                torch._foreach_mul_(params, factor.to(params[0].device))

    def _advance(self, found: torch.Tensor, amax: torch.Tensor | None, layers: LayerScales | None,
                 layer_obs: Any, scale: torch.Tensor) -> None:
        """The policy's update, after the per-layer exponents; a FloorError names the step."""
        try:
            if layers is not None:
                found = layers.update(*layer_obs, scale)
            self._loss_scale.update(found, amax, self._run.loss_finite)
        except FloorError as err:
            raise FloorError(f"LossScaleOptimizer step {self._run.boundaries}: {err}") from None

    # --- schedule and per-layer scales -----------------------------------------------------------

    def attach_schedule(self, schedule: PrecisionSchedule) -> None:
        """Scale only while ``schedule`` is in float16; refuse parameters already in low precision."""
        validate_attachable(schedule, self._params())
        self._run.schedule = schedule
        self._run.seen_switch = schedule.switched

    def _precision(self) -> str | None:
        if self.schedule is None:
            return None
        dtype = self.schedule.dtype
        return "float32" if dtype is None else str(dtype).replace("torch.", "")

    def _consume_switch(self, precision: str | None) -> bool:
        """True once: on the first boundary whose step ran in the original precision."""
        run = self._run
        if run.schedule is None or run.seen_switch or precision in ("float16", "bfloat16"):
            return False
        run.seen_switch = True
        return True

    def attach_layerwise(self, layerwise: Any) -> None:
        """Keep one scale per module of ``layerwise`` (a model, a list of modules, or a
        :class:`~lossscale.addons.layerwise.LayerScales`) on top of the global one; parameters outside its units
        follow the global scale, and at least one of the inner optimizer's parameters must belong to a unit."""
        device = next(p.device for p in self._params())
        layers = layerwise if isinstance(layerwise, LayerScales) else LayerScales(layerwise, device=device)
        covered = {id(p) for p in layers.parameters()}
        if not any(id(p) in covered for p in self._params()):
            raise ValueError(f"LossScaleOptimizer(layerwise={type(layerwise).__name__}): none of the inner "
                             f"optimizer's {len(self._params())} parameters belongs to a unit of the per-layer "
                             f"scales; pass the model whose parameters the optimizer updates, or modules of it.")
        layers.is_scaled = _WindowScaled(self)
        self._run.layers = layers
        self._configure(self.options)

    # --- attribution, checkpoints ------------------------------------------------------------------

    def overflowing_parameters(self) -> list[str]:
        """Names of the parameters whose gradients overflowed in the last step (before ``zero_grad``).
        One read of the gradients and one host read."""
        names = {id(p): n for n, p in self.module.named_parameters()} if self.module is not None else {}
        divided = 1.0 if self._run.unscaled_by is None else float(self._run.unscaled_by)
        return stages.overflowing_names(self.inner, names, self.options.overflow_mode, self.options.threshold,
                                        divided)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
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
            state_dict["accumulated_grads"] = [None if p.grad is None else p.grad.detach().clone()
                                               for p in self._params()]
            state_dict["window"] = run.window
            if run.loss_finite is not None:  # a policy that observes the losses: whether the window's were finite
                state_dict["loss_finite"] = bool(run.loss_finite)
        for key, part in self._parts():
            state_dict[key] = part.state_dict()
        if run.schedule is not None:
            state_dict["seen_switch"] = run.seen_switch
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            changed = post_hook(self, state_dict)
            if changed is not None:
                state_dict = changed
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore :meth:`state_dict`, between the load hooks; the whole dict is checked before anything changes. An
        optional part (EMA, schedule, per-layer scales) that only one side has is named in a UserWarning."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            changed = pre_hook(self, state_dict)
            if changed is not None:
                state_dict = changed
        call = "LossScaleOptimizer.load_state_dict"
        run = self._run
        params = self._params()
        micro, boundaries = checkpoint.validated_position(call, state_dict, self.options.accumulation_steps)
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
            raise ValueError(f"{call} (key 'inner'): the inner optimizer refused its state: {err}. Pass the "
                             f"state_dict() of a LossScaleOptimizer over the same parameter groups.") from None
        except Exception:
            self._loss_scale.load_state_dict(before)
            raise
        run.micro, run.boundaries, run.window = micro, boundaries, window
        run.loss_finite = None if loss_finite is None else torch.tensor(loss_finite, device=self._device)
        for p, grad in zip(params, grads):
            p.grad = None if grad is None else grad.to(p.device).clone()
        if run.flat is not None:
            run.flat.attach()
        for key, part in parts:
            part.load_state_dict(state_dict[key])
        if run.schedule is not None and "schedule" in state_dict:
            run.seen_switch = run.schedule.switched if seen_switch is None else seen_switch
        self._warn_unmatched_parts(call, state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _warn_unmatched_parts(self, call: str, state_dict: dict[str, Any]) -> None:
        """A UserWarning for each optional part that only one side has: this optimizer (the part keeps its state)
        or the checkpoint (its entry is ignored)."""
        have = {key for key, _ in self._parts()}
        for key, what in _PARTS.items():
            if key in have and key not in state_dict:
                warnings.warn(f"{call}: this optimizer has {what} ({key}=) and the checkpoint has no {key!r} entry; "
                              f"the {key} part keeps its current state, not the saved run's. Save the checkpoint "
                              f"from an optimizer with the same parts to resume it.", UserWarning, stacklevel=3)
            elif key in state_dict and key not in have:
                warnings.warn(f"{call}: the checkpoint holds a {key!r} entry and this optimizer has no {what}; the "
                              f"entry is ignored. Pass {key}=... when building the optimizer to resume it.",
                              UserWarning, stacklevel=3)

    def _parts(self) -> list[tuple[str, Any]]:
        """(checkpoint key, object) of each optional part this optimizer has."""
        run = self._run
        parts = [("ema", self.options.ema), ("layerwise", run.layers), ("schedule", run.schedule)]
        return [(key, part) for key, part in parts if part is not None]

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("LossScaleOptimizer is not pickled directly; save opt.state_dict() with torch.save.")
