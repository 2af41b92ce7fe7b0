"""GradScaler: a drop-in for ``torch.amp.GradScaler`` composed from the step pipeline's stages.

Same calls, same constructor arguments, and with torch's arguments the same scale trajectory and the
same parameter updates, bit for bit. Beyond torch: ``policy=`` (any policy, e.g. hysteresis, floors,
presets of other frameworks), ``overflow_mode="saturation"``, ``step()`` returning its decision, overflow
attribution on demand, and found_inf reduced over ``torch.distributed`` so every rank decides alike.
Intended differences from torch: the scale never goes below the policy's floor (2**-126 by default,
where torch's reaches 0 after 142 overflows in a row and then divides by zero), and every scale set
from outside is validated (:func:`~lossscale.scale_value.checked_scale`).
"""

from __future__ import annotations

from collections import abc
from typing import Any, Iterable

import torch
from torch.amp.grad_scaler import OptState

from lossscale import _prepared_update
from lossscale import distributed as _dist
from lossscale import step as stages
from lossscale._validate import ArgumentTypeError
from lossscale._scaler_state import ScalerCheckpoint, policy_from_args
from lossscale._torch_private import TorchPrivateAttributes
from lossscale.overflow import OverflowMode, check_mode, saturation_threshold
from lossscale.policy import Policy
from lossscale.result import ScalerStep
from lossscale.state import LossScale

__all__ = ["GradScaler", "ScalerStep"]

class GradScaler(ScalerCheckpoint, TorchPrivateAttributes):
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s calls, on a sync-free policy.

    Usage is torch's::

        scaler.scale(loss).backward()
        scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(params, 1.0)   # optional
        scaler.step(opt)
        scaler.update()

    Host reads: ``scale``, ``unscale_`` and ``update`` make none (``update`` makes one with a policy that
    raises at its floor, ``at_floor="raise"``); ``step`` makes none with optimizers that take
    ``grad_scale``/``found_inf`` (fused Adam/AdamW/SGD) and exactly one (found_inf) otherwise, as torch.

    Args:
        device: Accepted for torch compatibility; the state lives on the device of the first scaled output.
        init_scale, growth_factor, backoff_factor, growth_interval: torch's arguments; build a
            :class:`DynamicScale` with torch's rule. Leave them at their defaults when passing ``policy``.
        enabled: False makes every call a no-op (``step`` still steps). Arguments are validated anyway.
        policy: Any :class:`~lossscale.policy.Policy`, e.g. ``DynamicScale(hysteresis=2)`` or a preset.
        overflow_mode: ``"inf_nan"`` (default) or ``"saturation"`` (scaled |g| >= finfo(saturation_dtype).max).
        saturation_dtype: The low-precision format whose max defines saturation (default float16).
        process_group: Where found_inf is reduced when torch.distributed is initialized (default: world).
    """

    _one_optimizer = True  # whether the last update() saw one optimizer (_prepared_update); set per instance

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 policy: Policy | None = None, overflow_mode: OverflowMode = "inf_nan",
                 saturation_dtype: torch.dtype = torch.float16, process_group: Any = None) -> None:
        policy = policy_from_args(policy, dict(init_scale=init_scale, growth_factor=growth_factor,
                                                backoff_factor=backoff_factor, growth_interval=growth_interval))
        check_mode("GradScaler", overflow_mode)
        if not isinstance(enabled, bool):
            raise ValueError(f"GradScaler(enabled={enabled!r}): enabled must be True or False; got {enabled!r}.")
        self._device = device
        self._enabled = enabled
        self.overflow_mode = overflow_mode
        self._threshold = saturation_threshold(saturation_dtype)
        self.process_group = process_group
        self._owner = LossScale(policy)
        self._placed = False  # whether the state has moved to the device of the first scaled output
        self._replicas: dict[torch.device, torch.Tensor] = {}
        self._loss_finite: torch.Tensor | None = None  # every scaled output finite (policies that observe it)
        self._reset_records()

    # --- state -------------------------------------------------------------------------------

    @property
    def loss_scale(self) -> LossScale:
        """The one owner of the scale and counters."""
        return self._owner

    def _place(self, device: torch.device) -> None:
        if not self._placed:
            self._owner.to(device)
            self._placed = True

    def _require_state(self, call: str) -> LossScale:
        if not self._placed:
            raise RuntimeError(f"{call} was called before scale(): call scaler.scale(loss).backward() earlier in "
                               f"the iteration so the scaler knows the scale and its device.")
        return self._owner

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        """The scale on ``device``, copied once per device and value (the owner may change it)."""
        scale = self._owner.scale
        if self._replicas.get(scale.device) is not scale:
            self._replicas = {scale.device: scale}
        if device not in self._replicas:
            self._replicas[device] = scale.to(device, non_blocking=True)
        return self._replicas[device]

    # --- torch's calls -----------------------------------------------------------------------

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor (or nested lists/tuples of tensors) by the current scale. No host read."""
        if not self._enabled:
            return outputs

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                self._place(value.device)
                if self._owner.policy.observes_loss_finite:  # whether the losses themselves were finite
                    finite = torch.isfinite(value.detach()).all().to(self._owner.device)
                    self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
                return value * self._scale_on(value.device)
            if isinstance(value, abc.Iterable) and not isinstance(value, (str, bytes)):
                mapped = map(apply, value)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise ArgumentTypeError(f"GradScaler.scale(outputs): outputs must be a Tensor or an iterable of "
                                    f"Tensors (the loss); got {type(value).__name__} {value!r}.")

        return apply(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record whether they overflowed.

        One fused read+write pass (inf_nan; saturation adds one read pass first). No host read.
        """
        if not self._enabled:
            return
        stages.check_optimizer("GradScaler.unscale_(optimizer)", optimizer)
        owner = self._require_state("unscale_()")
        record = self._per_optimizer_states[id(optimizer)]
        if record["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() was already called for this optimizer since the last update(); "
                               "call unscale_() at most once per optimizer between two update() calls.")
        if record["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() was called after step() for this optimizer; step() already unscaled the "
                               "gradients, so call unscale_() before step(), then update().")
        found_inf = stages.guarded_found(owner.scale)
        inv_scale = stages.inverse_(owner.scale, found_inf)
        found = self._unscale_grads_(optimizer, inv_scale, found_inf, False)  # starts from the guard's verdict
        record["found_inf_per_device"] = self._agreed(found)
        record["stage"] = OptState.UNSCALED

    def _agreed(self, found: dict[torch.device, torch.Tensor]) -> dict[torch.device, torch.Tensor]:
        """found_inf per device, summed onto the scale's device and reduced over ranks when distributed."""
        if not found or not _dist.active(self.process_group):
            return found
        device = self._owner.device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for t in found.values():
            total += t.to(device, non_blocking=True)
        return {device: stages.agree_(total, self.process_group)}

    def _found_inf_sum(self, records: Iterable[dict], call: str) -> torch.Tensor:
        """Every recorded check's found_inf, summed on the scale's device: a count, > 0 where anything
        overflowed (what policies and ``bool()`` take). For one device, the record's own tensor: no op; read
        it, never write it."""
        device = self._owner.device
        values = [t.to(device, non_blocking=True) for r in records for t in r["found_inf_per_device"].values()]
        if not values:
            raise stages.NoGradientsError(f"{call}: No inf checks were recorded for this optimizer: no gradient "
                                          f"was unscaled or checked since the last update(). Call backward on the "
                                          f"scaled loss, then step(optimizer), before update().")
        return sum(values[1:], values[0])  # values[0] itself for one device

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> ScalerStep:
        """Unscale (unless done), then apply ``optimizer.step(*args, **kwargs)`` only if nothing overflowed.

        Fused optimizers receive ``grad_scale``/``found_inf`` and skip inside the kernel (no host read);
        others cost one host read of found_inf, as in torch. Returns a :class:`ScalerStep`.
        """
        if not self._enabled:
            return ScalerStep(overflow=torch.zeros((), dtype=torch.bool), value=optimizer.step(*args, **kwargs))
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled: "
                               "GradScaler.step(optimizer, closure=...) cannot scale the closure's loss.")
        stages.check_optimizer("GradScaler.step(optimizer)", optimizer)
        self._require_state("step()")
        record = self._per_optimizer_states[id(optimizer)]
        if record["stage"] is OptState.STEPPED:
            raise RuntimeError("step() was already called for this optimizer since the last update(); call "
                               "update() after step() before stepping again.")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, record, *args, **kwargs)
        if record["stage"] is OptState.READY:
            self.unscale_(optimizer)
        overflow = self._found_inf_sum([record], "GradScaler.step(optimizer)")  # a count: > 0 overflowed
        applied = stages.applies_on_host(overflow)  # the one host read, as torch
        self._prepare_update(record, overflow, applied)
        value = optimizer.step(*args, **kwargs) if applied else None
        record["stage"] = OptState.STEPPED
        record["clean_on_host"] = applied  # the policy's update may skip what only an overflow needs
        return ScalerStep(overflow=overflow, value=value)

    def _fused_step(self, optimizer: torch.optim.Optimizer, record: dict, *args: Any, **kwargs: Any) -> ScalerStep:
        """The optimizer unscales and skips in its kernel: a read-only check first unless unscale_() ran."""
        if stages.takes_grad_scaler(optimizer):
            stages.warn_grad_scaler_deprecated()
            value = optimizer.step(*args, **dict(kwargs, grad_scaler=self))  # it unscales and skips itself
            record["stage"] = OptState.STEPPED
            found = list(record["found_inf_per_device"].values())
            overflow = (sum(f.to(self._owner.device) for f in found) > 0) if found else torch.zeros(
                (), dtype=torch.bool, device=self._owner.device)
            return ScalerStep(overflow=overflow, value=value)
        if record["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)  # guards the scale the kernel divides by, too
            # a tensor of the kernel's own, as torch hands it: the optimizer never holds the owner's scale
            grad_scale = self._owner.scale * getattr(optimizer, "grad_scale", 1)
        else:
            grad_scale = None  # unscale_() already divided the gradients
        count = self._found_inf_sum([record], "GradScaler.step(optimizer)")
        found_inf = count.clamp(max=1.0)  # a 0/1 flag of the kernel's own (it may keep what it is handed)
        self._prepare_update(record, count, False)
        value = stages.fused_step_(optimizer, grad_scale, found_inf, *args, **kwargs)
        record["stage"] = OptState.STEPPED
        return ScalerStep(overflow=found_inf, value=value)  # the kernel reads found_inf, never writes it

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Advance the policy with this iteration's overflow, or set ``new_scale`` (validated; one host read
        for a tensor). No host read otherwise, unless the policy raises at its floor (``at_floor="raise"``).
        With one optimizer, installs the next state ``step()`` computed before the optimizer ran
        (:mod:`lossscale._prepared_update`)."""
        if not self._enabled:
            return
        owner = self._require_state("update()")
        if new_scale is not None:
            owner.set_scale(new_scale, f"GradScaler.update(new_scale={new_scale!r})", "new_scale")
        else:
            seen = [r for r in self._per_optimizer_states.values() if r["stage"] is not OptState.READY]
            if not seen:
                raise RuntimeError("update() was called without unscale_() or step() since the last update(); call "
                                   "scaler.step(optimizer) (which unscales) before update().")
            self._one_optimizer = len(seen) == 1
            prepared = _prepared_update.prepared_for(self._prepared, seen, self._loss_finite)
            if prepared is not None:
                owner.commit(prepared)
            else:
                self._advance(owner, seen)
        self._loss_finite = None
        self._reset_records()

    def _advance(self, owner: LossScale, seen: list[dict]) -> None:
        """The policy's update from the records unscaled or stepped this iteration (+ amax, loss finiteness)."""
        found_inf = self._found_inf_sum(seen, "GradScaler.update()")  # a count, as policies take it
        amax = None
        if owner.policy.observes_amax:
            maxima = [a.to(owner.device) for a in self._amax_seen]
            amax = torch.stack(maxima).max() if maxima else torch.zeros((), device=owner.device)
            stages.agree_amax_(amax, self.process_group)
        clean = all(r.get("clean_on_host", False) for r in seen)
        owner.update(found_inf, amax, self._loss_finite, clean_on_host=clean)

    def _prepare_update(self, record: dict, count: torch.Tensor, clean_on_host: bool) -> None:
        """Compute the policy's next state now, before the optimizer runs, where update() can install it."""
        self._prepared = _prepared_update.prepare(self._owner, self._per_optimizer_states, record, count,
                                                  self._loss_finite, clean_on_host=clean_on_host,
                                                  one_optimizer=self._one_optimizer, ready=OptState.READY)

    def get_scale(self) -> float:
        """The current scale as a Python float (a host read); 1.0 when disabled."""
        return float(self._owner.scale) if self._enabled else 1.0

    def get_scale_tensor(self) -> torch.Tensor | None:
        """The current scale as a 0-d tensor on its device (no host read); None before the first scale()."""
        return self._owner.scale if self._placed else None

    def is_enabled(self) -> bool:
        """Whether scaling is on."""
        return self._enabled

    # --- attribution -------------------------------------------------------------------------

    def overflowing_parameters(self, optimizer: torch.optim.Optimizer,
                               module: torch.nn.Module | None = None) -> list[str]:
        """Which of ``optimizer``'s parameters have overflowing gradients now (names from ``module``
        where given, else ``"param_groups[i][j]"``). Judged on the scaled values; call it after an
        overflow, before ``zero_grad()``. Cost: one read of the gradients and one host read."""
        names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        record = self._per_optimizer_states.get(id(optimizer))
        unscaled = record is not None and record["stage"] is not OptState.READY and not getattr(
            optimizer, "_step_supports_amp_scaling", False)
        divided = self.get_scale() if (unscaled and self._enabled) else 1.0
        return stages.overflowing_names(optimizer, names, self.overflow_mode, self._threshold, divided)

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled and self._per_optimizer_states:
            raise RuntimeError("GradScaler can be pickled only between iterations (before scale() or after "
                               "update()); an unscale_()/step() is in flight.")
        state = self.__dict__.copy()
        state["_replicas"] = {}
        state["process_group"] = None
        return state  # restored by default (the instance's __dict__ updated with it)
