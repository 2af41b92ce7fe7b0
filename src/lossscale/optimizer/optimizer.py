"""LossScaleOptimizer: a torch optimizer that scales, unscales, checks, clips, skips, and says what it did."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from lossscale import stages
from lossscale.addons.base import AddOn, FrontEnd, parts_of, warn_unmatched_parts
from lossscale.keywords import add_ons_from, validate_add_ons
from lossscale.ops.flat import FlatGrads
from lossscale.ops.masked import MaskedSkip
from lossscale.ops.overflow import OverflowMode
from lossscale.ops.underflow import underflow_share
from lossscale.optimizer import checkpoint
from lossscale.optimizer.inner import WrapsInner
from lossscale.optimizer.options import ResolvedSkipMode, StepOptions
from lossscale.policies.base import FloorError, Policy, validate_policy
from lossscale.reporting import StepResult
from lossscale.state import LossScale
from lossscale.validation import ArgumentTypeError, outside_caller

_STEP = "LossScaleOptimizer.step()"


def _constructor_signature(cls: type) -> inspect.Signature:
    """``cls.__init__``'s signature without ``self``: what ``help(cls)`` and ``inspect.signature(cls)`` show, where
    they would show the routing ``__new__``'s ``(*args, layerwise=None, **kwargs)``."""
    try:  # annotations evaluated, as autodoc and typing.get_type_hints see them
        init = inspect.signature(cls.__init__, eval_str=True)  # type: ignore[misc]  # the class's own
    except Exception:  # a name imported under TYPE_CHECKING only (a subclass's): the annotations as written
        init = inspect.signature(cls.__init__)  # type: ignore[misc]
    return init.replace(parameters=list(init.parameters.values())[1:], return_annotation=inspect.Signature.empty)


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


@dataclass
class _Run:
    """Where a run is: what changes from step to step (with the LossScale, the optimizer's mutable state)."""

    micro: int = 0  # micro-batches of the window under way
    boundaries: int = 0  # optimizer steps so far, skipped ones included
    window: bool | None = None  # whether the window under way scales its losses (fixed at its first loss)
    loss_finite: torch.Tensor | None = None  # every loss of the window finite (where the losses are watched)
    unscaled_by: torch.Tensor | None = None  # the scale our pass divided the last step's gradients by
    last_result: StepResult | None = None


class LossScaleOptimizer(WrapsInner):
    """Wraps any ``torch.optim.Optimizer`` with dynamic loss scaling; ``step()`` returns a :class:`StepResult`.

    Usage::

        opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), fused=True), clip_grad_norm=1.0)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x)
        opt.backward(loss)          # loss * scale / accumulation_steps, then backward
        result = opt.step()         # StepResult(stepped, found_inf, scale, next_scale, grad_norm, ...)
        opt.zero_grad()

    Its ``param_groups``, ``state`` and ``defaults`` are the inner one's; LR schedulers and hooks work on it.

    One optimizer step, at the end of each accumulation window::

        found_inf = 1 where the scale itself is corrupted (guard)
        read the scaled gradients where something needs them first: the largest magnitude (a policy that reads
            it), the saturation check, the check a fused kernel needs, the underflow meter
        unscale and clip: the clip decided on the scaled gradients (a non-finite global norm is an overflow),
            then the divisor a fused kernel takes, or one pass of ours (multiply by 1/scale x clip, checking)
        agree found_inf (and forward_fault, where forward faults are found) over ranks
        apply or skip (fused kernel / host / masked): skipped where found_inf or forward_fault
        the policy's update with found_inf (its state kept as it was on a forward fault); the add-ons see the step

    Skip modes (how an overflowing step is skipped):
        ``"fused"``: the inner optimizer takes ``grad_scale``/``found_inf`` (fused Adam/AdamW/SGD) and skips
        in its kernel, unscaling and clipping folded into ``grad_scale``. No host read.
        ``"host"``: found_inf is read once and ``inner.step()`` is not called (torch's behaviour).
        ``"masked"``: the inner step runs and parameters and state are restored where found_inf; no host read.
        On a GPU the optimizer state must live there too (torch's optimizers: ``capturable=True`` or
        ``fused=True``); a state tensor in host memory (a ``step`` counter) raises a ValueError at the first
        masked step.
        ``"auto"``: ``"fused"`` where the optimizer takes it and no value clip writes the unscaled gradients,
        else ``"host"``.

    Passes over the gradients per step: fused without clipping, one read+write (the check); fused with
    global-norm clipping, one read (the norm is the check); host/masked, one read+write to unscale and check
    (plus one read for the norm when clipping). Saturation mode, and a policy that observes amax, add one read.

    Args:
        inner: The optimizer to wrap (float32 parameters; float16 ones are refused).
        policy: A :class:`~lossscale.Policy` (default ``DynamicScale()``, torch's rule), or a
            :class:`~lossscale.LossScale` to share the scale with another object (a facade).
        module: Gives parameter names to overflow attribution.
        ema: An :class:`~lossscale.EMA`, moved only on applied steps.
        schedule: A :class:`~lossscale.PrecisionSchedule`; scaling runs only while it is in float16.
        layerwise: A model, a list of modules or a :class:`~lossscale.layerwise.LayerScales`: one extra
            power-of-two scale per module on top of the global one (the optimizer is then a
            :class:`~lossscale.optimizer.layerwise.LayerwiseOptimizer`).
        diagnose: The model to trace when the loss scale collapses or the loss stays non-finite
            (:mod:`lossscale.diagnosis`): the next step's forward and backward name the first non-finite value in a
            :class:`~lossscale.OverflowWarning`. Or an :class:`~lossscale.OverflowDiagnosis`; None or False: none.
        heal: True (or ``torch.bfloat16``), with ``diagnose``: heal the run (docs/diagnosis.md, "Healing"): a step
            whose loss is non-finite is skipped without lowering the scale, and a forward fault's module runs in
            float32 (bfloat16) from then on, the scale restored; with ``step(closure)`` the healed step runs again at
            once.
        add_ons: Further :class:`~lossscale.addons.AddOn` objects (your own), whose hooks run in order after those
            of ``ema``, ``schedule`` and ``diagnose``.
        **options: The step's options (:class:`~lossscale.optimizer.options.StepOptions`), checked once:
            ``overflow_mode`` (``"inf_nan"`` or ``"saturation"``); ``clip_grad_norm`` (clip the unscaled gradients
            to this global L2 norm, torch's ``clip_grad_norm_``); ``clip_grad_value`` (clamp each unscaled
            gradient value to [-v, v], torch's ``clip_grad_value_``; at most one of the two clips);
            ``accumulation_steps`` (micro-batches per optimizer step; the loss is divided by it); ``skip_mode``
            (``"auto"``, ``"fused"``, ``"host"`` or ``"masked"``); ``saturation_dtype`` (the format whose max
            defines saturation, default float16); ``process_group`` (found_inf is agreed over it under
            torch.distributed, default the world); ``sharded_grads`` (which gradients are shards whose squared
            norms are summed over ranks when clipping: None, detected per gradient as FSDP2's DTensor ``Shard``;
            True, every one; False, none); ``check_when_unscaled`` (keep catching inf/NaN, and skipping those
            steps, while a precision schedule does not scale); ``underflow_stride`` (n: the underflow meter,
            ``StepResult.underflow``, samples every n-th scaled value); ``flat_grads`` (keep every gradient as a
            view of one buffer per device and dtype, :class:`~lossscale.ops.flat.FlatGrads`, so that each pass is
            one kernel per buffer; every parameter then always has a gradient, zeros where a backward gave none,
            and ``zero_grad()`` zeroes the buffer in place whatever ``set_to_none`` says; gradients set to None
            elsewhere become zeroed views again at the next ``scale_loss``/``backward``, other tensors in
            ``.grad`` are copied in with a warning the first time; dense ``torch.Tensor`` parameters only).
    """

    #: The front end ``layerwise=`` builds: the subclass declared with ``layerwise=True``
    #: (:class:`~lossscale.optimizer.layerwise.LayerwiseOptimizer`).
    _layerwise_type: ClassVar[type[LossScaleOptimizer] | None] = None
    __signature__: ClassVar[inspect.Signature]  # _constructor_signature's: set after the class and per subclass

    def __init_subclass__(cls, *, layerwise: bool = False, **kwargs: Any) -> None:
        """``class LayerwiseOptimizer(LossScaleOptimizer, layerwise=True)`` makes it what ``layerwise=`` builds."""
        super().__init_subclass__(**kwargs)
        cls.__signature__ = _constructor_signature(cls)
        if layerwise:
            LossScaleOptimizer._layerwise_type = cls

    def __new__(cls, *args: Any, layerwise: Any = None, **kwargs: Any) -> LossScaleOptimizer:
        """``layerwise=`` makes the optimizer a :class:`~lossscale.optimizer.layerwise.LayerwiseOptimizer`."""
        if layerwise is not None and cls is LossScaleOptimizer and cls._layerwise_type is not None:
            cls = cls._layerwise_type
        return super().__new__(cls)

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        *,
        policy: Policy[Any] | LossScale[Any] | None = None,
        module: torch.nn.Module | None = None,
        ema: AddOn | None = None,
        schedule: AddOn | None = None,
        layerwise: Any = None,
        diagnose: torch.nn.Module | AddOn | Literal[False] | None = None,
        heal: bool | torch.dtype = False,
        add_ons: list[AddOn] | tuple[AddOn, ...] = (),
        **options: Any,
    ) -> None:
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"LossScaleOptimizer(inner={type(inner).__name__}): inner must be a torch.optim.Optimizer.")
        if isinstance(inner, LossScaleOptimizer):
            raise TypeError(
                "LossScaleOptimizer(inner=LossScaleOptimizer): wrap the inner optimizer once, not a wrapper."
            )
        if layerwise is not None and (self._layerwise_type is None or not isinstance(self, self._layerwise_type)):
            raise TypeError(
                f"{type(self).__name__}(layerwise=...): per-layer scales are a LossScaleOptimizer of their own "
                f"(lossscale.optimizer.layerwise.LayerwiseOptimizer); a subclass of LossScaleOptimizer cannot take "
                f"them; got {type(self).__name__}."
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
        self._one = torch.ones((), dtype=torch.float32, device=self._device)  # the scale of an unscaled window
        self._masked = MaskedSkip()
        self._run = _Run()
        self._flat: FlatGrads | None = None  # the gradient buffer (flat_grads=True)
        self._flat_warned = False
        self._add_ons: list[AddOn] = []
        self._configure(self._options)
        self.attach_add_ons(add_ons_from("LossScaleOptimizer", ema=ema, schedule=schedule))
        _refuse_float16_parameters(inner)  # after the schedule's own refusal, before anything hooks the model
        self._attach_layerwise(layerwise)
        self.attach_add_ons(add_ons_from("LossScaleOptimizer", diagnose=diagnose, heal=heal, add_ons=add_ons))

    def _attach_layerwise(self, layerwise: Any) -> None:
        """Where per-layer scales hook the model (:class:`~lossscale.optimizer.layerwise.LayerwiseOptimizer`)."""

    # --- the inner optimizer's groups, state and defaults: WrapsInner's; its param groups -------

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
    def add_ons(self) -> tuple[AddOn, ...]:
        """The add-ons, in the order their hooks run."""
        return tuple(self._add_ons)

    def configure(self, **changes: Any) -> None:
        """Change step options (checked as at construction), e.g. ``opt.configure(clip_grad_norm=1.0)``."""
        self._configure(dataclasses.replace(self._options, **changes))

    def attach_add_ons(self, add_ons: Sequence[AddOn]) -> None:
        """Take more add-ons (built by :func:`lossscale.keywords.add_ons_from`, as an integration does when it meets
        the model), checked with the ones already here; they attach at once."""
        validate_add_ons("LossScaleOptimizer", [*self._add_ons, *add_ons])
        before = self._add_ons
        self._add_ons = [*before, *add_ons]
        try:
            self._configure(self._options)
        except Exception:
            self._add_ons = before
            raise

    def _configure(self, options: StepOptions) -> None:
        """Install ``options``: decide once what the step reads and who unscales, tell the add-ons, keep or drop the
        gradient buffer."""
        skip_mode = options.resolved_skip_mode(self.inner)
        reads_amax = self._loss_scale.policy.observes_amax
        kernel_unscales = skip_mode == "fused" and options.clip_grad_value is None
        self._options, self._skip_mode, self._kernel_unscales = options, skip_mode, kernel_unscales
        self._inverts = options.clip_grad_norm is not None or not kernel_unscales  # the step needs 1/scale
        # a read of the scaled gradients before anything writes them: the largest magnitude, the saturation check,
        # the check a fused kernel needs (where no norm is computed, which would be the check), the underflow meter
        self._reads_scaled = bool(
            reads_amax
            or options.overflow_mode == "saturation"
            or (kernel_unscales and options.clip_grad_norm is None)
            or options.underflow_stride
        )
        self._finds_forward_faults = any(a.finds_forward_faults for a in self._add_ons)
        self._watches_losses = self._finds_forward_faults or self._loss_scale.policy.observes_loss_finite
        front_end = FrontEnd(
            call="LossScaleOptimizer",
            loss_scale=self._loss_scale,
            params=tuple(self._params()),
            process_group=options.process_group,
        )
        for add_on in self._add_ons:
            add_on.attach(front_end)
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
    def skip_mode(self) -> ResolvedSkipMode:
        """The skip mode in use (``"auto"`` resolved for the inner optimizer)."""
        return self._skip_mode

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

    @property
    def last_result(self) -> StepResult | None:
        """What the last ``step()`` returned."""
        return self._run.last_result

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        """Set the loss scale (checked; one host read for a tensor on an accelerator); the counters carry on."""
        self._loss_scale.set_scale(new_scale, f"LossScaleOptimizer.set_scale(new_scale={new_scale!r})", "new_scale")

    def __repr__(self) -> str:
        return f"LossScaleOptimizer({self.inner!r}, policy={self.policy!r}, skip_mode={self.skip_mode!r})"

    # --- the training-loop calls ---------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale / accumulation_steps`` (the scale only where the accumulation window scales its losses,
        as the add-ons said at its first loss). No host read."""
        stages.validate_loss("LossScaleOptimizer.scale_loss(loss)", loss)
        run = self._run
        opens = run.window is None
        scaled = all([add_on.on_loss(loss, opens) for add_on in self._add_ons])  # noqa: C419  # a list: every add-on sees the loss
        if opens:
            run.window = scaled
        if self._flat is not None and not self._flat.attached(params := self._params()):
            self._attach_flat(params)  # before the backward, so that it writes into the buffer
        if self._watches_losses:
            finite = torch.isfinite(loss.detach()).all()
            run.loss_finite = finite if run.loss_finite is None else run.loss_finite & finite
        if not run.window and self._options.accumulation_steps == 1:
            return loss
        factor = self._loss_scale.scale if run.window else self._one
        return stages.scale_loss(loss, factor, self._options.accumulation_steps)

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
        """Count a micro-batch; at the end of an accumulation window run the optimizer step and return its
        decision. ``closure`` runs first, with grad enabled (it calls ``opt.backward(loss)``); it returns
        ``StepResult.loss``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        run = self._run
        if run.window is None:  # a window whose gradients came without a loss (written to .grad by hand)
            run.window = all([add_on.on_loss(None, True) for add_on in self._add_ons])  # noqa: C419  # every add-on is asked
        run.micro += 1
        if run.micro < self._options.accumulation_steps:
            false = torch.zeros((), dtype=torch.bool, device=self._device)
            scale = self._loss_scale.scale
            result = StepResult(false, false, scale, scale, run.boundaries, accumulating=True, loss=loss)
        else:
            run.micro = 0
            result = self._boundary_step(loss)
            if result.fields.pop("rerun", False) and closure is not None and self._options.accumulation_steps == 1:
                result = self._run_again(closure, result)
        run.last_result = result
        return result

    def _run_again(self, closure: Callable[[], Any], skipped: StepResult) -> StepResult:
        """An add-on changed the model at a skipped step (healing) and asked for the step again: with the closure at
        hand, run it again now, once. The result is the second step's, with the first one's added fields where the
        second has none."""
        self.zero_grad()
        with torch.enable_grad():
            loss = closure()
        if self._run.window is None:  # the closure wrote the gradients by hand
            self._run.window = all([add_on.on_loss(None, True) for add_on in self._add_ons])  # noqa: C419  # every add-on is asked
        result = self._boundary_step(loss)
        result.fields.pop("rerun", None)
        for name, value in skipped.fields.items():
            if result.fields.get(name) is None:
                result.fields[name] = value
        return result

    # --- the optimizer step ---------------------------------------------------------------------

    def _boundary_step(self, loss: object) -> StepResult:
        """One optimizer step, in the order of the class docstring."""
        run, options = self._run, self._options
        scaled, run.window = bool(run.window), None
        groups = stages.grouped_gradients(self.inner, _STEP) if self._flat is None else self._flat_groups()
        scale = self._loss_scale.scale if scaled else self._one
        found = stages.guarded_found(scale, self._device)
        inv = stages.inverse(scale, found) if self._inverts else None  # from the guard's verdict alone
        amax = underflow = None
        if self._reads_scaled:
            amax, underflow = self._read_scaled(groups, found, scaled)
        grad_norm, divisor = self._unscale(groups, scale, inv, found, scaled)
        if not (scaled or options.check_when_unscaled):
            found.zero_()
        fault = (~run.loss_finite).float() if self._finds_forward_faults and run.loss_finite is not None else None
        found, fault = stages.agree_(found, fault, options.process_group)
        skip = found if fault is None else torch.maximum(found, fault)
        self._apply(groups, skip, divisor)
        run.boundaries += 1
        if scaled:
            scale = self._update_policy(found, amax, fault)
        found_inf = found.bool()
        result = StepResult(
            stepped=~(found_inf if fault is None else skip.bool()),
            found_inf=found_inf,
            scale=scale,
            next_scale=self._loss_scale.scale,
            step=run.boundaries - 1,
            forward_fault=None if fault is None else fault.bool(),
            loss_scaled=scaled,
            grad_norm=grad_norm,
            underflow=underflow,
            loss=loss,
        )
        run.loss_finite = None
        for add_on in self._add_ons:
            result.fields.update(add_on.after_step(result) or {})
        return result

    def _read_scaled(
        self, groups: stages.Groups, found: torch.Tensor, scaled: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The reads of the scaled gradients before anything writes them; overflow goes into ``found``. Returns
        (the largest magnitude, agreed over ranks, for a policy that reads it; the underflow meter's share)."""
        options, policy = self._options, self._loss_scale.policy
        underflow = None
        if scaled and options.underflow_stride:
            underflow = underflow_share([g for grads in groups.values() for g in grads], options.underflow_stride)
        amax = None
        if scaled and (policy.observes_amax or options.overflow_mode == "saturation"):
            amax = stages.measure_(groups, found, options.overflow_mode, options.threshold, amax=policy.observes_amax)
            if amax is not None:
                stages.agree_amax_(amax, options.process_group)
        elif self._kernel_unscales and options.clip_grad_norm is None:
            stages.measure_(groups, found, "inf_nan", options.threshold, amax=False)  # the kernel's found_inf
        return amax, underflow

    def _unscale(
        self,
        groups: stages.Groups,
        scale: torch.Tensor,
        inv: torch.Tensor | None,
        found: torch.Tensor,
        scaled: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Unscale and clip, in this one place: the global-norm clip decided on the scaled gradients (the norm is the
        overflow check), then either the divisor a fused kernel takes (``scale / clip``) or one pass of ours
        (multiply by ``1/scale x clip``, checking where nothing checked yet), then the value clip. Returns (the
        unscaled global norm, or None without a norm clip; the fused kernel's divisor, or None)."""
        options = self._options
        grad_norm = clip = None
        if options.clip_grad_norm is not None:
            assert inv is not None  # made where a norm clip is asked for
            grad_norm, clip = stages.clip_norm(
                groups, self._grads, inv, found, options.clip_grad_norm, options.process_group, options.sharded_grads
            )
        self._run.unscaled_by = scale if scaled and not self._kernel_unscales else None
        if self._kernel_unscales:
            if not (scaled or clip is not None):
                return grad_norm, None
            return grad_norm, (scale.clone() if clip is None else scale / clip)
        assert inv is not None  # made above wherever our pass runs
        checked = (
            clip is not None
            or (scaled and options.overflow_mode == "saturation")
            or (scaled and self._loss_scale.policy.observes_amax)
        )
        check: OverflowMode | None = None if checked else "inf_nan"
        factor = None if not scaled and clip is None else (inv if clip is None else inv * clip)
        for grads in groups.values():
            stages.unscale_(grads, found, factor, check)
        if options.clip_grad_value is not None:
            stages.clip_value_(groups, options.clip_grad_value)
        return grad_norm, None

    def _apply(self, groups: stages.Groups, skip: torch.Tensor, divisor: torch.Tensor | None) -> None:
        """The inner step, skipped where ``skip``: in the fused kernel, on the host (one host read), or masked (on
        the host while the optimizer state does not exist yet)."""
        mode = self._skip_mode
        if mode == "masked" and not self._masked.ready(self.inner):
            mode = "host"
        if mode == "host":
            call = (
                "LossScaleOptimizer.step() with skip_mode='host'"
                if self._skip_mode == "host"
                else "LossScaleOptimizer.step() before the optimizer state exists (skip_mode='masked' decides that "
                "step on the host; step once before capturing)"
            )
            if stages.applies_on_host(skip, call):
                self.inner.step()
        elif mode == "masked":
            self._masked.step(self.inner, skip)
        else:
            stages.fused_step_(self.inner, divisor, skip)

    def _update_policy(
        self, found: torch.Tensor, amax: torch.Tensor | None, fault: torch.Tensor | None
    ) -> torch.Tensor:
        """The policy's update (its state kept as it was on a forward fault); a FloorError names the step (counted
        from 1). Returns the scale the step ran at."""
        try:
            return self._loss_scale.update(found, amax, self._run.loss_finite, skip=fault)
        except FloorError as err:
            raise FloorError(f"LossScaleOptimizer step {self._run.boundaries}: {err}") from None

    def _flat_groups(self) -> stages.Groups:
        """Each flat buffer, as the gradients to pass over (its views attached again first where a gradient was set
        to None or replaced, with a warning the first time)."""
        assert self._flat is not None  # called only with a buffer
        params = self._params()
        if not self._flat.attached(params):
            self._attach_flat(params)
        return stages.Groups({key: [buffer] for key, buffer in self._flat.buffers.items()})

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
                stacklevel=outside_caller(),
            )

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params() if p.grad is not None]

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
            state_dict["window"] = (bool(run.window), None)
            if run.loss_finite is not None:  # the losses are watched: whether the window's were finite
                state_dict["loss_finite"] = bool(run.loss_finite)
        for key, part in self._parts():
            state_dict[key] = part.state_dict()
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
        state_dict = checkpoint.migrated(call, state_dict)
        micro, boundaries = checkpoint.validated_position(call, state_dict, self._options.accumulation_steps)
        grads, window = checkpoint.validated_window(call, state_dict, params, micro)
        loss_finite = checkpoint.validated_loss_finite(call, state_dict, micro)
        parts = [(key, part) for key, part in self._parts() if key in state_dict]
        for key, part in parts:
            part.validate_state_dict(state_dict[key])
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
        run.micro, run.boundaries, run.window = micro, boundaries, window
        run.loss_finite = None if loss_finite is None else torch.tensor(loss_finite, device=self._device)
        for p, grad in zip(params, grads):
            p.grad = None if grad is None else grad.to(p.device).clone()
        if self._flat is not None:
            self._flat.attach()
        for key, part in parts:
            part.load_state_dict(state_dict[key])
        warn_unmatched_parts(call, "optimizer", self._parts(), state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _parts(self) -> list[tuple[str, Any]]:
        """(checkpoint key, part) of each part saved in a checkpoint: the add-ons with a key."""
        return parts_of(self._add_ons)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("LossScaleOptimizer is not pickled directly; save opt.state_dict() with torch.save.")


LossScaleOptimizer.__signature__ = _constructor_signature(LossScaleOptimizer)
