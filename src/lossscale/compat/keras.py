"""Keras 3's ``LossScaleOptimizer`` for PyTorch, with the base optimizer arguments Keras refuses on it.

A translation table onto the core :class:`~lossscale.LossScaleOptimizer`; the rule is
:func:`lossscale.presets.keras`.

==========================================================  ===================================================
Keras 3                                                      lossscale
==========================================================  ===================================================
``LossScaleOptimizer(inner_optimizer, initial_scale=2**15,   ``LossScaleOptimizer(inner, policy=presets.keras(
dynamic_growth_steps=2000)``                                 initial_scale, dynamic_growth_steps))``; ``inner`` is
                                                             a torch optimizer
``scale_loss(loss)``                                         ``loss * dynamic_scale`` (``* loss_scale_factor``)
``apply(grads, trainable_variables=None)``                   grads (scaled) written to ``.grad``, then ``step()``:
                                                             skip on inf/NaN, unscale, apply, update the scale
``apply_gradients(grads_and_vars)``                          ``apply(grads, vars)``
``dynamic_scale`` (a float32 Variable)                       the 0-d float32 scale tensor (no host read)
``iterations``                                               0-d int64 tensor: ``apply()`` calls not skipped
``learning_rate``                                            the inner optimizer's ``lr`` (every param group)
``weight_decay``                                             ``weight_decay``: ``p -= p * wd * lr`` before applied
                                                             steps (decoupled, as Keras)
``clipnorm``                                                 ``transform_unscaled=PerTensorClip(clipnorm)``
                                                             (``clip_by_norm`` per variable)
``clipvalue``                                                ``clip_grad_value``
``global_clipnorm``                                          ``clip_grad_norm`` (torch's rule: ``max / (norm +
                                                             1e-6)``; Keras divides by the norm alone)
``use_ema, ema_momentum=0.99``                               ``EMA(ema_momentum)``, advanced on applied steps; the
                                                             first applied step copies the weights (Keras's
                                                             momentum 0 at iteration 0); momentum in [0, 1], 1
                                                             freezes the average; None (R's NULL) = default
``name=None``                                                ``name`` (default ``"loss_scale_optimizer"``)
``ema_overwrite_frequency``                                  weights overwritten by the average when the applied
                                                             step count is a multiple of it
``loss_scale_factor``                                        a static extra factor: ``scale_loss`` multiplies by it,
                                                             ``apply`` divides the gradients by it
``gradient_accumulation_steps`` (>= 2)                       ``accumulation_steps``: gradients averaged over that
                                                             many ``apply()`` calls, one step (or skip) at the end
``finalize_variable_values(var_list)``                       copies the average into the weights when ``use_ema``
==========================================================  ===================================================

Keras 3 raises when these base arguments are given to its ``LossScaleOptimizer`` ("set them on the
inner optimizer"); here they act on the unscaled gradients, after the overflow check, with Keras's
meaning. With ``gradient_accumulation_steps`` the overflow check covers the whole window (Keras would
check each call), and the average moves once per applied step (Keras moves it on every call).
Deviations of the rule: see :func:`lossscale.presets.keras` (no growth into inf, floor 2**-126).
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable, Sequence

import torch

from lossscale import presets
from lossscale.clip import PerTensorClip
from lossscale.compat._checks import check_optimizer, checked_counters
from lossscale.compat._keras_apply import KerasVariables, checked_grads, keras_ema_rules, split_pairs, write_grads
from lossscale.compat._keras_args import BASE_KWARGS, KerasEMA, validated
from lossscale.optimizer import LossScaleOptimizer as _CoreOptimizer
from lossscale.result import StepResult

__all__ = ["LossScaleOptimizer", "BASE_KWARGS"]

_CALL = "LossScaleOptimizer"
_COUNTERS = ("iterations", "applied")  # saved step counts, checked before a load changes anything


class LossScaleOptimizer(KerasVariables):
    """Keras 3's dynamic loss scaling around a torch optimizer: ``scale_loss``, then ``apply(grads)``.

    Usage, as in a Keras custom training step::

        opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), global_clipnorm=1.0)
        loss = loss_fn(model(x), y)
        grads = torch.autograd.grad(opt.scale_loss(loss), list(model.parameters()))
        opt.apply(grads)                     # or opt.apply_gradients(zip(grads, model.parameters()))

    Host reads: none per step with an optimizer that takes ``grad_scale``/``found_inf`` (``fused=True``),
    one (the skip decision) otherwise; the core's rules apply.

    Args:
        inner_optimizer: The torch optimizer to wrap.
        initial_scale: First loss scale.
        dynamic_growth_steps: Clean steps between doublings of the scale.
        **base_kwargs: Any of :data:`BASE_KWARGS`, with Keras's meaning (see the module docstring).

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> opt = LossScaleOptimizer(torch.optim.SGD([w], lr=1.0), initial_scale=8, dynamic_growth_steps=2)
        >>> opt.apply([torch.tensor([8.0, float("inf")])])      # overflow: skipped, scale halved
        >>> opt.apply([torch.tensor([4.0, 4.0])])               # unscaled by 4: w -= 1
        >>> (w.detach().tolist(), float(opt.dynamic_scale), int(opt.iterations))
        ([-1.0, -1.0], 4.0, 1)
    """

    def __init__(self, inner_optimizer: torch.optim.Optimizer, initial_scale: float = 32768,
                 dynamic_growth_steps: int = 2000, **base_kwargs: Any) -> None:
        check_optimizer(_CALL, "inner_optimizer", inner_optimizer)
        args = validated(base_kwargs)
        policy = presets.build_as(_CALL, presets.keras, initial_scale, dynamic_growth_steps)
        self.inner_optimizer = inner_optimizer
        self.initial_scale = initial_scale
        self.dynamic_growth_steps = dynamic_growth_steps
        for name, value in args.items():
            setattr(self, name, value)
        self.name = args["name"] if args["name"] is not None else "loss_scale_optimizer"
        self.ema = KerasEMA(args["ema_momentum"]) if args["use_ema"] else None
        self._opt = _CoreOptimizer(
            inner_optimizer, policy=policy,
            clip_grad_norm=args["global_clipnorm"], clip_grad_value=args["clipvalue"],
            transform_unscaled=None if args["clipnorm"] is None else PerTensorClip(args["clipnorm"]),
            accumulation_steps=args["gradient_accumulation_steps"] or 1,
            ema=self.ema, weight_decay=args["weight_decay"])
        device = self._opt.scale.device
        self._iterations = torch.zeros((), dtype=torch.int64, device=device)
        self._applied = torch.zeros((), dtype=torch.int64, device=device)
        self.last_result: StepResult | None = None


    @property
    def dynamic_scale(self) -> torch.Tensor:
        """The current loss scale, a 0-d float32 tensor (no host read)."""
        return self._opt.scale

    @property
    def scale_state(self) -> Any:
        """The whole state record (scale and counters)."""
        return self._opt.scale_state

    @property
    def iterations(self) -> torch.Tensor:
        """``apply()`` calls whose gradients were not discarded for overflow (0-d int64 tensor)."""
        return self._iterations

    def scale_loss(self, loss: Any) -> torch.Tensor:
        """``loss * dynamic_scale`` (times ``loss_scale_factor`` when set). No host read.

        A Python or NumPy real number is taken as a float32 loss on the scale's device, as Keras's
        ``ops.multiply`` takes it."""
        if not isinstance(loss, torch.Tensor):
            if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
                raise TypeError(f"{_CALL}.scale_loss(loss={loss!r}): loss must be a tensor or a real number; got "
                                f"{type(loss).__name__}.")
            loss = torch.tensor(float(loss), device=self._opt.scale.device)
        factor = self._opt.scale if self.loss_scale_factor is None else self._opt.scale * self.loss_scale_factor
        return loss * factor.to(loss.device)

    @torch.no_grad()
    def apply(self, grads: Sequence[torch.Tensor | None],
              trainable_variables: Sequence[torch.Tensor] | None = None) -> None:
        """Apply scaled ``grads`` to ``trainable_variables`` (default: every parameter of the inner optimizer).

        Skips the step and halves the scale if any gradient is inf or NaN; otherwise unscales, clips, decays,
        steps, advances the average, and grows the scale every ``dynamic_growth_steps`` clean steps.
        """
        variables = self.variables if trainable_variables is None else list(trainable_variables)
        grads = checked_grads(f"{_CALL}.apply", grads, variables, self.variables)
        self._opt.zero_grad(set_to_none=True)  # a no-op inside an accumulation window
        write_grads(grads, variables, self._opt.accumulation_steps * (self.loss_scale_factor or 1.0))
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
            keras_ema_rules(self.ema, result.stepped, first, self._applied, self.ema_overwrite_frequency)

    def apply_gradients(self, grads_and_vars: Iterable[tuple[torch.Tensor | None, torch.Tensor]]) -> None:
        """``apply(grads, vars)`` for a list of ``(grad, var)`` pairs."""
        self.apply(*split_pairs(f"{_CALL}.apply_gradients", grads_and_vars))

    def finalize_variable_values(self, var_list: Sequence[torch.Tensor] | None = None) -> None:
        """Copy the moving average into the weights (when ``use_ema``), as Keras does at the end of ``fit``."""
        if self.ema is not None:
            self.ema.copy_to(var_list)

    def state_dict(self) -> dict[str, Any]:
        """The core optimizer's state plus ``iterations`` and ``applied`` (``_COUNTERS``)."""
        return {"core": self._opt.state_dict(), "iterations": int(self._iterations),
                "applied": int(self._applied)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        checked_counters(f"{_CALL}.load_state_dict", state_dict, ("core", "iterations", "applied"), _COUNTERS)
        self._opt.load_state_dict(state_dict["core"])
        self._iterations.fill_(state_dict["iterations"])
        self._applied.fill_(state_dict["applied"])

    def __repr__(self) -> str:
        return (f"LossScaleOptimizer({self.inner_optimizer!r}, initial_scale={self.initial_scale!r}, "
                f"dynamic_growth_steps={self.dynamic_growth_steps!r})")

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("LossScaleOptimizer is not pickled directly; save opt.state_dict() with torch.save.")
