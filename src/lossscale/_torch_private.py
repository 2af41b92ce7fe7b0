"""torch.amp.GradScaler's private attributes, as one documented layer over lossscale's real state.

Training code and libraries read and write some of torch's private names (``scaler._scale`` logged,
compared with a minimum or overwritten; HF Accelerate's FSDP2 ``load_state`` calls
``_lazy_init_scale_growth_tracker``; optimizers that take ``grad_scaler=`` call ``_check_inf_per_device``
and ``_found_inf_per_device``). Here each is a view of the one owner (:class:`~lossscale.state.LossScale`):

======================================  =====================================================================
torch's name                            here
======================================  =====================================================================
``_scale``                              the owner's scale tensor (None before the first ``scale()``);
                                        assigning a value sets it through the one validation
``_growth_tracker``                     the owner's ``growth_tracker`` (None before the first ``scale()``)
``_init_scale``, ``_init_growth_tracker``  the values the state starts from (or was loaded with)
``_per_optimizer_states``               ``{id(optimizer): {"stage": OptState, "found_inf_per_device": {...}}}``,
                                        torch's layout (amax, for policies that observe it, is kept beside)
``_lazy_init_scale_growth_tracker(d)``  moves the state to device ``d``
``_unscale_grads_(opt, inv, found,      unscale (and check) opt's gradients in place; found_inf per device
allow_fp16)``
``_check_inf_per_device(opt)``          a read-only check, recorded for ``opt``
``_found_inf_per_device(opt)``          what was recorded for ``opt``
``_get_growth_tracker()``,              as torch
``_get_scale_async()``
======================================  =====================================================================
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from lossscale import step as stages
from lossscale.overflow import check_with_amax_, unscale_and_check_

__all__ = ["TorchPrivateAttributes"]


def _fresh_record() -> dict[str, Any]:
    """torch's ``_refresh_per_optimizer_state()``: equal to it, so code comparing with it still works."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class TorchPrivateAttributes:
    """Mixin for :class:`~lossscale.GradScaler`: torch's private names over ``self._owner``."""

    _owner: Any
    _placed: bool
    _enabled: bool
    overflow_mode: Any
    _threshold: float

    def _reset_records(self) -> None:
        self._per_optimizer_states: defaultdict[int, dict[str, Any]] = defaultdict(_fresh_record)
        self._amax_seen: list[torch.Tensor] = []  # this iteration's gradient maxima (policies that observe them)
        self._prepared = None  # the policy's next state, computed by step() (GradScaler._prepare_update)

    @property
    def _scale(self) -> torch.Tensor | None:
        return self._owner.scale if self._placed else None

    @_scale.setter
    def _scale(self, value: Any) -> None:
        if value is None:
            raise ValueError("GradScaler._scale = None: the scale cannot be unset; assign a float or a one-element "
                             "tensor, or use update(new_scale=...).")
        if isinstance(value, torch.Tensor) and not self._placed:
            self._lazy_init_scale_growth_tracker(value.device)
        self._owner.set_scale(value, f"GradScaler._scale = {value!r}", "_scale")

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        state = self._owner.state
        return state.growth_tracker if self._placed and hasattr(state, "growth_tracker") else None

    @property
    def _init_scale(self) -> float:
        return float(self._owner.scale)

    @_init_scale.setter
    def _init_scale(self, value: Any) -> None:
        self._owner.set_scale(value, f"GradScaler._init_scale = {value!r}", "_init_scale")

    @property
    def _init_growth_tracker(self) -> int:
        return int(getattr(self._owner.state, "growth_tracker", 0))

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: Any) -> None:
        values = self._owner.state_dict()
        if "growth_tracker" not in values:
            raise AttributeError(f"GradScaler._init_growth_tracker = {value!r}: the policy "
                                 f"{type(self._owner.policy).__name__} keeps no growth tracker.")
        values["growth_tracker"] = value
        self._owner.load_state_dict(values, f"GradScaler._init_growth_tracker = {value!r}")

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        """Place the state on ``dev`` (torch creates its tensors here; ours exist from the start)."""
        self._owner.to(dev)
        self._placed = True

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def _get_growth_tracker(self) -> int:
        return self._init_growth_tracker if self._enabled else 0

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """Unscale ``optimizer``'s gradients by ``inv_scale`` in place; return found_inf per device (each a
        copy of ``found_inf``, set to 1.0 where this check overflowed: a 0/1 flag from a 0/1 start). One
        read+write pass (saturation: one read more); for a policy that observes amax, one more read (recorded
        for ``update()``). No host read."""
        groups = stages.grouped_gradients(optimizer, "GradScaler.unscale_(optimizer)", allow_fp16=allow_fp16,
                                          required=False)
        found: dict[torch.device, torch.Tensor] = {}
        for (device, _), group in groups.items():
            if device not in found:
                found[device] = found_inf.to(device, copy=True)
            if self._owner.policy.observes_amax:
                self._amax_seen.append(check_with_amax_(group, found[device], self.overflow_mode, self._threshold))
            inv = inv_scale if inv_scale.device == device else inv_scale.to(device, non_blocking=True)
            unscale_and_check_(group, found[device], inv, self.overflow_mode, self._threshold)
        return found  # torch's kernel and our checks set 1.0, never add: found_inf's copy, or 1.0, as torch's

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """A read-only check of ``optimizer``'s gradients, recorded for it (found_inf per device), for a fused
        optimizer that then divides them by the scale: a scale it must not divide by counts as an overflow
        (:func:`~lossscale.step.guarded_found`, in the first device's flag). One read pass (``aminmax`` for
        saturation or amax); no write, no host read."""
        record = self._per_optimizer_states[id(optimizer)]
        groups = stages.grouped_gradients(optimizer, "GradScaler.step(optimizer)", required=False)
        found: dict[torch.device, torch.Tensor] = {}
        for (device, dtype), group in groups.items():
            if not found:  # the first flag is born with the scale's verdict
                found[device] = stages.guarded_found(self._owner.scale, device)
            elif device not in found:
                found[device] = torch.zeros((), dtype=torch.float32, device=device)
            amax = stages.measure_({(device, dtype): group}, found[device], self.overflow_mode, self._threshold,
                                   amax=self._owner.policy.observes_amax)
            if amax is not None:
                self._amax_seen.append(amax)
        record["found_inf_per_device"] = self._agreed(found)
        return record["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    _agreed: Any  # GradScaler's: found_inf per device, reduced over ranks when distributed
