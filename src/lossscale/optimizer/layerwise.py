"""LayerwiseOptimizer: a LossScaleOptimizer whose unscale is per-layer scales' own (:mod:`lossscale.layerwise`)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from lossscale import stages
from lossscale.layerwise import LayerScales
from lossscale.ops.underflow import underflow_share
from lossscale.optimizer.optimizer import LossScaleOptimizer
from lossscale.optimizer.options import StepOptions
from lossscale.reporting import StepResult


class _WindowScaled:
    """Whether the losses of the optimizer's accumulation window under way are scaled (before its first loss: True):
    :attr:`LayerScales.is_scaled`. Holds the optimizer weakly, so that a deep copy of the model (whose hooks lead
    here) does not copy the optimizer."""

    def __init__(self, optimizer: LayerwiseOptimizer) -> None:
        self._optimizer = weakref.ref(optimizer)

    def __call__(self) -> bool:
        optimizer = self._optimizer()
        return True if optimizer is None else optimizer._run.window is not False


class LayerwiseOptimizer(LossScaleOptimizer, layerwise=True):
    """A :class:`~lossscale.LossScaleOptimizer` with one extra power-of-two scale per module on top of the global one
    (:class:`~lossscale.layerwise.LayerScales`): ``LossScaleOptimizer(inner, layerwise=model)`` builds one.

    The same step as its base class but for the unscale of a scaled window, which is the per-layer scales' own: each
    unit's gradients divided by ``scale * 2**e[unit]`` and checked in that pass, the parameters outside the units by
    the scale; the global-norm clip then multiplies every gradient by its coefficient; before the policy's update the
    exponents move and say which found_inf the policy sees (an overflow the exponents absorb is not the global
    scale's). The result's ``layer_scales`` holds each unit's total scale. Windows a precision schedule leaves
    unscaled run the base class's step.

    Args:
        inner: As :class:`~lossscale.LossScaleOptimizer`.
        layerwise: A model, a list of modules, or a :class:`~lossscale.layerwise.LayerScales`; parameters of the
            optimizer outside its units follow the global scale, and at least one must belong to a unit.
        **kwargs: Every other argument of :class:`~lossscale.LossScaleOptimizer`.
    """

    layers: LayerScales

    def __init__(self, inner: torch.optim.Optimizer, *, layerwise: Any, **kwargs: Any) -> None:
        self._layer_fields: dict[str, Any] = {}
        super().__init__(inner, layerwise=layerwise, **kwargs)

    def _attach_layerwise(self, layerwise: Any) -> None:
        """Build (or take) the per-layer scales and bind them to this optimizer."""
        if layerwise is None:
            raise TypeError(
                "LayerwiseOptimizer(layerwise=None): layerwise must be a model, a list of modules or a "
                "lossscale.layerwise.LayerScales; got None."
            )
        layers = layerwise if isinstance(layerwise, LayerScales) else LayerScales(layerwise, device=self._device)
        self.layers = layers
        self._bind_layers()

    def _bind_layers(self) -> None:
        self.layers.bind("LossScaleOptimizer", self._params(), self._options.process_group, _WindowScaled(self))

    def _configure(self, options: StepOptions) -> None:
        """The base class's, with the unscale the per-layer scales' own: no check before it (it checks every
        gradient), never in a fused kernel."""
        super()._configure(options)
        self._kernel_unscales = False
        self._inverts = True  # in a window the schedule leaves unscaled, the base class's pass runs
        self._reads_scaled = bool(options.underflow_stride)
        if "layers" in self.__dict__:
            self._bind_layers()

    def _read_scaled(
        self, groups: stages.Groups, found: torch.Tensor, scaled: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Only the underflow meter: the per-layer unscale checks every gradient and measures the largest one."""
        options = self._options
        if not (scaled and options.underflow_stride):
            return None, None
        return None, underflow_share([g for grads in groups.values() for g in grads], options.underflow_stride)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The base class's; the scaled loss is where the next backward pass starts (the wiring walk reads it)."""
        scaled = super().scale_loss(loss)
        self.layers.backward_from(scaled)
        return scaled

    def _unscale(
        self,
        groups: stages.Groups,
        scale: torch.Tensor,
        inv: torch.Tensor | None,
        found: torch.Tensor,
        scaled: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-layer scales unscale and check every gradient; then the global-norm clip (on the unscaled gradients,
        a non-finite norm an overflow) and the value clip. Returns (the unscaled global norm, None)."""
        if not scaled:
            return super()._unscale(groups, scale, inv, found, scaled)
        options = self._options
        unit_found, self._unit_amax = self.layers.unscale(scale)
        found.logical_or_(unit_found.to(found.device))
        self._layer_fields = {"layer_scales": self.layers.layer_scales(scale)}  # before the exponents move
        self._run.unscaled_by = None
        grad_norm = None
        if options.clip_grad_norm is not None:  # the norm of the unscaled gradients: 1/scale is 1
            grad_norm, clip = stages.clip_norm(
                groups,
                self._grads,
                self._one,
                found,
                options.clip_grad_norm,
                options.process_group,
                options.sharded_grads,
            )
            for grads in groups.values():
                stages.unscale_(grads, found, clip, None)
        if options.clip_grad_value is not None:
            stages.clip_value_(groups, options.clip_grad_value)
        return grad_norm, None

    def _update_policy(
        self, found: torch.Tensor, amax: torch.Tensor | None, fault: torch.Tensor | None
    ) -> torch.Tensor:
        """The exponents move first; the policy sees the found_inf they return and the largest magnitude over the
        units."""
        scale = self._loss_scale.scale
        return super()._update_policy(self.layers.update_observed(found, scale), self._unit_amax, fault)

    def _boundary_step(self, loss: object) -> StepResult:
        """The base class's step; its result carries ``layer_scales`` (each unit's total scale in a scaled window)."""
        self._layer_fields = {}
        result = super()._boundary_step(loss)
        result.fields.update(self._layer_fields)
        return result

    def _parts(self) -> list[tuple[str, Any]]:
        """The base class's parts, and the per-layer scales under ``layerwise``."""
        return [*super()._parts(), ("layerwise", self.layers)]
