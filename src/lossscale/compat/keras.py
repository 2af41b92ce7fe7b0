"""Keras 3's ``LossScaleOptimizer`` for PyTorch, with the base optimizer arguments Keras refuses on it.
The rule is :func:`lossscale.presets.keras`.

+----------------------------------------------------+-----------------------------------------------------------------+
| Keras 3                                            | lossscale                                                       |
+====================================================+=================================================================+
| ``LossScaleOptimizer(inner_optimizer,              | ``LossScaleOptimizer(inner, policy=presets.keras(               |
| initial_scale=2**15, dynamic_growth_steps=2000)``  | initial_scale, dynamic_growth_steps))``                         |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``scale_loss(loss)``                               | ``loss * dynamic_scale`` (``* loss_scale_factor``)              |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``apply(grads, trainable_variables=None)``         | scaled grads written to ``.grad``, then ``step()``              |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``apply_gradients(grads_and_vars)``                | ``apply(grads, vars)``                                          |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``dynamic_scale`` (a float32 Variable)             | the 0-d float32 scale tensor (no host read)                     |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``iterations``                                     | 0-d int64 tensor: ``apply()`` calls not skipped                 |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``learning_rate``                                  | the inner optimizer's ``lr`` (every param group)                |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``weight_decay``                                   | ``weight_decay``: ``p -= p * wd * lr`` (decoupled)              |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``clipnorm``                                       | each gradient clipped by its own norm (``clip_per_tensor_``)    |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``clipvalue``                                      | ``clip_grad_value``                                             |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``global_clipnorm``                                | ``clip_grad_norm``                                              |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``use_ema, ema_momentum=0.99``                     | ``EMA(ema_momentum)`` on applied steps; the first applied step  |
|                                                    | copies the weights                                              |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``name=None``                                      | ``name`` (default ``"loss_scale_optimizer"``)                   |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``ema_overwrite_frequency``                        | weights = average every that many applied steps                 |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``loss_scale_factor``                              | ``scale_loss`` multiplies by it, ``apply`` divides by it        |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``gradient_accumulation_steps`` (>= 2)             | ``accumulation_steps`` (averaged over that many calls)          |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``finalize_variable_values(var_list)``             | copies the average into the weights when ``use_ema``            |
+----------------------------------------------------+-----------------------------------------------------------------+

The base arguments act on the unscaled gradients, after the overflow check. Deviations: ``global_clipnorm``
divides by ``norm + 1e-6`` (torch's rule); with ``gradient_accumulation_steps`` the check covers the whole
window and the average moves once per applied step; the rule's own are in :func:`lossscale.presets.keras`.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from lossscale import presets
from lossscale.addons.ema import EMA
from lossscale.compat._common import OptimizerHolder, validate_optional_number, validated_counters, validated_tensors
from lossscale.ops.clip import clip_per_tensor_
from lossscale.optimizer import LossScaleOptimizer as _CoreOptimizer
from lossscale.optimizer.inner import WrapsInner
from lossscale.reporting import StepResult
from lossscale.stages import fused_scaling, fused_step_
from lossscale.validation import validate_choice, validate_int_at_least, validate_optimizer

__all__ = ["LossScaleOptimizer", "BASE_KWARGS"]

_CALL = "LossScaleOptimizer"

#: The base optimizer keyword arguments this facade accepts, with Keras's defaults.
BASE_KWARGS: dict[str, Any] = {
    "weight_decay": None,
    "clipnorm": None,
    "clipvalue": None,
    "global_clipnorm": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
    "name": None,
}


def _checked_base_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``BASE_KWARGS`` updated with ``kwargs``, each checked; None (R's NULL) means Keras's default."""
    unknown = sorted(set(kwargs) - set(BASE_KWARGS))
    if unknown:
        raise TypeError(
            f"{_CALL}({', '.join(f'{k}={kwargs[k]!r}' for k in unknown)}): unexpected keyword argument(s) "
            f"{', '.join(unknown)}; the base optimizer arguments are {', '.join(BASE_KWARGS)}."
        )
    args = {**BASE_KWARGS, **kwargs}
    for name in ("clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor"):
        validate_optional_number(_CALL, name, args[name])
    validate_optional_number(_CALL, "weight_decay", args["weight_decay"], inclusive=True)
    clips = [n for n in ("clipnorm", "clipvalue", "global_clipnorm") if args[n] is not None]
    if len(clips) > 1:
        raise ValueError(
            f"{_CALL}({', '.join(f'{n}={args[n]!r}' for n in clips)}): only one of clipnorm, clipvalue "
            f"and global_clipnorm can be set; got {len(clips)}."
        )
    for name in ("use_ema", "ema_momentum"):
        if args[name] is None:
            args[name] = BASE_KWARGS[name]
    validate_choice(_CALL, "use_ema", args["use_ema"], (True, False))
    m = args["ema_momentum"]
    rule = f"{_CALL}(ema_momentum={m!r}): ema_momentum must be None or a number in [0, 1]"
    if isinstance(m, bool) or not isinstance(m, (int, float)):
        raise TypeError(f"{rule}; got {type(m).__name__}.")
    if not 0.0 <= m <= 1.0:
        raise ValueError(f"{rule}; got {m!r}.")
    if args["name"] is not None and not isinstance(args["name"], str):
        raise TypeError(
            f"{_CALL}(name={args['name']!r}): name must be a str or None; got {type(args['name']).__name__}."
        )
    if args["ema_overwrite_frequency"] is not None:
        validate_int_at_least(_CALL, "ema_overwrite_frequency", args["ema_overwrite_frequency"], 1)
    if args["gradient_accumulation_steps"] is not None:
        validate_int_at_least(_CALL, "gradient_accumulation_steps", args["gradient_accumulation_steps"], 2)
    return args


class _KerasEMA(EMA):
    """Keras's moving average of the weights: momentum in [0, 1], and after the core's update (no host read)::

    if stepped and this is the first applied step: average = weights
    if stepped and applied % overwrite_frequency == 0: weights = average
    """

    def __init__(self, momentum: float) -> None:
        super().__init__(0.0)
        self.momentum = float(momentum)

    @torch.no_grad()
    def after_apply(
        self, stepped: torch.Tensor, first: torch.Tensor, applied: torch.Tensor, overwrite_frequency: int | None
    ) -> None:
        """The rules above; ``applied`` counts applied steps, this one included."""
        copy = (stepped & first).to(self.shadow[0].dtype)
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], copy)  # type: ignore[call-overload]  # a 0-d tensor weight: torch takes it, its stubs list numbers only
        if overwrite_frequency:
            due = stepped & (applied % overwrite_frequency == 0)
            torch._foreach_lerp_(  # type: ignore[call-overload]  # a 0-d tensor weight, as above
                [p.detach() for p in self.params], self.shadow, due.to(self.shadow[0].dtype)
            )


class _KerasStep(WrapsInner):
    """The inner optimizer's step with Keras's base-optimizer arguments that torch's optimizers lack, run when the core
    applies the step (never on a skipped one), on the unscaled gradients::

        clipnorm:      g = g * clipnorm / max(||g||, clipnorm)   for each gradient (one read + one write pass)
        weight_decay:  p = p * (1 - lr * weight_decay)            then the inner step

    Its ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's, and so is its checkpoint. Where the
    inner optimizer skips in its kernel (``grad_scale``/``found_inf``) and no ``clipnorm`` writes the gradients, so
    does this step: the decay is masked by ``found_inf`` on the device (no host read).
    """

    def __init__(self, inner: torch.optim.Optimizer, clipnorm: float | None, weight_decay: float | None) -> None:
        self.inner = inner
        self.clipnorm = clipnorm
        self.weight_decay = weight_decay
        self._step_supports_amp_scaling = clipnorm is None and fused_scaling(inner) == "flags"

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if self.clipnorm is not None:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                clip_per_tensor_(grads, self.clipnorm)
        if self.weight_decay:
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if params:
                    keep = torch.tensor(1.0 - group["lr"] * self.weight_decay, device=params[0].device)
                    if found_inf is not None:  # the kernel skips where found_inf: so does the decay
                        keep = torch.where(found_inf.to(keep.device, torch.bool), torch.ones_like(keep), keep)
                    torch._foreach_mul_(params, keep)
        if found_inf is None:
            return self.inner.step(closure)
        return fused_step_(self.inner, grad_scale, found_inf, closure)

    def __repr__(self) -> str:
        return f"_KerasStep({self.inner!r}, clipnorm={self.clipnorm!r}, weight_decay={self.weight_decay!r})"


def _checked_grads(
    call: str, grads: object, variables: Sequence[torch.Tensor], known: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """``grads`` as a list, one per variable (None allowed), shapes matching, not all None; every variable
    a parameter of the inner optimizer. Else a TypeError or ValueError."""
    grads = validated_tensors(call, "grads", grads, none_items=True)
    if len(grads) != len(variables):
        raise ValueError(
            f"{call}(grads, trainable_variables): got {len(grads)} gradients for {len(variables)} "
            f"variables; pass one gradient (or None) per variable."
        )
    ids = {id(p) for p in known}
    stray = [i for i, v in enumerate(variables) if id(v) not in ids]
    if stray:
        raise ValueError(
            f"{call}(grads, trainable_variables): variable {stray[0]} is not a parameter of the inner "
            f"optimizer; pass the parameters it was built with."
        )
    for i, (v, g) in enumerate(zip(variables, grads)):
        if g is not None and g.shape != v.shape:
            raise ValueError(
                f"{call}(grads, trainable_variables): grads[{i}] has shape {tuple(g.shape)}, its "
                f"variable {tuple(v.shape)}; pass one gradient per variable, in order."
            )
    if all(g is None for g in grads):
        raise ValueError(
            f"{call}(grads=[None] * {len(grads)}): No gradients provided for any variable (as Keras "
            f"says); nothing would be applied and the scale would count a clean step."
        )
    return grads


@torch.no_grad()
def _write_grads(grads: Sequence[torch.Tensor | None], variables: Sequence[torch.Tensor], divisor: float) -> None:
    """Add ``g / divisor`` to each variable's ``.grad`` (a copy: the caller's tensor is never written)."""
    for v, g in zip(variables, grads):
        if g is None:
            continue
        g = g.detach().to(device=v.device, dtype=v.dtype)
        g = g / divisor if divisor != 1 else g.clone()
        if v.grad is None:
            v.grad = g
        else:
            v.grad.add_(g)


def _split_pairs(
    call: str, grads_and_vars: Iterable[tuple[torch.Tensor | None, torch.Tensor]]
) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    """``(grads, vars)`` from Keras's ``(gradient, variable)`` pairs; a TypeError for anything else."""
    pairs = list(grads_and_vars)
    if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
        raise TypeError(
            f"{call}(grads_and_vars=...): grads_and_vars must hold (gradient, variable) pairs; got "
            f"{[type(p).__name__ for p in pairs][:4]}."
        )
    return [g for g, _ in pairs], [v for _, v in pairs]


class LossScaleOptimizer(OptimizerHolder):
    """Keras 3's dynamic loss scaling around a torch optimizer: ``scale_loss``, then ``apply(grads)``.

    Host reads: none per step with an optimizer that takes ``grad_scale``/``found_inf``, else one.

    Args:
        inner_optimizer: The torch optimizer to wrap.
        initial_scale: First loss scale.
        dynamic_growth_steps: Clean steps between doublings of the scale.
        **base_kwargs: Any of :data:`BASE_KWARGS`, with Keras's meaning.

    Raises:
        TypeError: ``inner_optimizer`` is not a torch optimizer, an unknown keyword, or a value of the wrong type.
        ValueError: a value out of range.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> opt = LossScaleOptimizer(torch.optim.SGD([w], lr=1.0), initial_scale=8, dynamic_growth_steps=2)
        >>> opt.apply([torch.tensor([8.0, float("inf")])])      # overflow: skipped, scale halved
        >>> opt.apply([torch.tensor([4.0, 4.0])])               # unscaled by 4: w -= 1
        >>> (w.detach().tolist(), float(opt.dynamic_scale), int(opt.iterations))
        ([-1.0, -1.0], 4.0, 1)
    """

    # Keras's base-optimizer arguments (BASE_KWARGS), set by __init__
    weight_decay: float | None
    clipnorm: float | None
    clipvalue: float | None
    global_clipnorm: float | None
    use_ema: bool
    ema_momentum: float
    ema_overwrite_frequency: int | None
    loss_scale_factor: float | None
    gradient_accumulation_steps: int | None
    name: str

    def __init__(
        self,
        inner_optimizer: torch.optim.Optimizer,
        initial_scale: float = 32768,
        dynamic_growth_steps: int = 2000,
        **base_kwargs: Any,
    ) -> None:
        validate_optimizer(_CALL, inner_optimizer, "inner_optimizer")
        args = _checked_base_kwargs(base_kwargs)
        policy = presets.keras(initial_scale, dynamic_growth_steps, call=_CALL)
        self.inner_optimizer = inner_optimizer
        self.initial_scale = initial_scale
        self.dynamic_growth_steps = dynamic_growth_steps
        for name, value in args.items():
            setattr(self, name, value)
        self.name = args["name"] if args["name"] is not None else "loss_scale_optimizer"
        self.ema = _KerasEMA(args["ema_momentum"]) if args["use_ema"] else None
        extras = args["clipnorm"] is not None or bool(args["weight_decay"])
        super().__init__(
            _CoreOptimizer(
                _KerasStep(inner_optimizer, args["clipnorm"], args["weight_decay"]) if extras else inner_optimizer,
                policy=policy,
                clip_grad_norm=args["global_clipnorm"],
                clip_grad_value=args["clipvalue"],
                accumulation_steps=args["gradient_accumulation_steps"] or 1,
                ema=self.ema,
            )
        )
        device = self._opt.scale.device
        self._iterations = torch.zeros((), dtype=torch.int64, device=device)
        self._applied = torch.zeros((), dtype=torch.int64, device=device)
        self.last_result: StepResult | None = None

    @property
    def dynamic_scale(self) -> torch.Tensor:
        """The current loss scale, a 0-d float32 tensor (no host read)."""
        return self._opt.scale

    @property
    def iterations(self) -> torch.Tensor:
        """``apply()`` calls whose gradients were not discarded for overflow (0-d int64 tensor)."""
        return self._iterations

    @property
    def learning_rate(self) -> float:
        """The inner optimizer's learning rate (of its first param group); setting it sets every group's."""
        return self.inner_optimizer.param_groups[0]["lr"]

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        for group in self.inner_optimizer.param_groups:
            group["lr"] = value

    @property
    def variables(self) -> list[torch.Tensor]:
        return [p for g in self.inner_optimizer.param_groups for p in g["params"]]

    def scale_loss(self, loss: torch.Tensor | float) -> torch.Tensor:
        """``loss * dynamic_scale`` (times ``loss_scale_factor`` when set); a real number becomes a float32
        tensor. No host read."""
        if not isinstance(loss, torch.Tensor):
            if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
                raise TypeError(
                    f"{_CALL}.scale_loss(loss={loss!r}): loss must be a tensor or a real number; got "
                    f"{type(loss).__name__}."
                )
            loss = torch.tensor(float(loss), device=self._opt.scale.device)
        factor = self._opt.scale if self.loss_scale_factor is None else self._opt.scale * self.loss_scale_factor
        return loss * factor.to(loss.device)

    @torch.no_grad()
    def apply(
        self, grads: Sequence[torch.Tensor | None], trainable_variables: Sequence[torch.Tensor] | None = None
    ) -> None:
        """Write scaled ``grads`` to ``trainable_variables`` (default: the inner optimizer's) and step the core."""
        variables = self.variables if trainable_variables is None else list(trainable_variables)
        grads = _checked_grads(f"{_CALL}.apply", grads, variables, self.variables)
        self._opt.zero_grad(set_to_none=True)
        _write_grads(grads, variables, self._opt.accumulation_steps * (self.loss_scale_factor or 1.0))
        first = self._applied == 0
        result = self._opt.step()
        self.last_result = result
        if result.accumulating:
            self._iterations += 1
            return
        stepped = result.stepped.to(torch.int64)
        self._iterations += stepped
        self._applied += stepped
        if self.ema is not None:
            self.ema.after_apply(result.stepped, first, self._applied, self.ema_overwrite_frequency)

    def apply_gradients(self, grads_and_vars: Iterable[tuple[torch.Tensor | None, torch.Tensor]]) -> None:
        self.apply(*_split_pairs(f"{_CALL}.apply_gradients", grads_and_vars))

    def finalize_variable_values(self, var_list: Sequence[torch.Tensor] | None = None) -> None:
        """Copy the moving average into the weights (when ``use_ema``)."""
        if self.ema is not None:
            self.ema.copy_to(var_list)

    def state_dict(self) -> dict[str, Any]:
        """The core optimizer's state plus ``iterations`` and ``applied`` (reads them on the host)."""
        return {"core": self._opt.state_dict(), "iterations": int(self._iterations), "applied": int(self._applied)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        validated_counters(
            f"{_CALL}.load_state_dict", state_dict, ("core", "iterations", "applied"), ("iterations", "applied")
        )
        self._opt.load_state_dict(state_dict["core"])
        self._iterations.fill_(state_dict["iterations"])
        self._applied.fill_(state_dict["applied"])

    def __repr__(self) -> str:
        return (
            f"LossScaleOptimizer({self.inner_optimizer!r}, initial_scale={self.initial_scale!r}, "
            f"dynamic_growth_steps={self.dynamic_growth_steps!r})"
        )
