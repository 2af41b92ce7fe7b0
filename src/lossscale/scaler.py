"""GradScaler: a drop-in for ``torch.amp.GradScaler`` on the sync-free policy engine.

Same calls, same constructor arguments, and with torch's arguments the same scale trajectory and the
same parameter updates, bit for bit. Beyond torch: ``policy=`` (any policy, e.g. hysteresis, floors,
presets of other frameworks), ``overflow_mode="saturation"``, ``step()`` returning its decision, overflow
attribution on demand, and found_inf reduced over ``torch.distributed`` so every rank decides alike.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import abc
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from lossscale import distributed as _dist
from lossscale.overflow import (
    OverflowMode,
    check_,
    check_mode,
    check_with_amax_,
    group_by_device_and_dtype,
    overflowing,
    saturation_threshold,
    unscale_and_check_,
)
from lossscale.policy import (
    DynamicScale,
    FixedScale,
    Policy,
    check_floor,
    state_from_dict,
    state_to_dict,
    with_scale,
)

__all__ = ["GradScaler", "ScalerStep"]

_TORCH_DEFAULTS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class _OptimizerRecord:
    stage: _Stage = _Stage.READY
    found_inf: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    amax: list[torch.Tensor] = field(default_factory=list)  # only for policies that observe it


@dataclass(frozen=True)
class ScalerStep:
    """What ``GradScaler.step`` decided.

    Attributes:
        stepped: 0-d bool tensor, True where the optimizer's update was applied (reading it is a host read).
        found_inf: 0-d bool tensor, True where the gradients overflowed.
        value: What ``optimizer.step()`` returned (None when it was skipped without calling it).
    """

    stepped: torch.Tensor
    found_inf: torch.Tensor
    value: Any = None


class GradScaler:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s calls, on a sync-free policy.

    Usage is torch's::

        scaler.scale(loss).backward()
        scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(params, 1.0)   # optional
        scaler.step(opt)
        scaler.update()

    Host reads: ``scale``, ``unscale_`` and ``update`` make none; ``step`` makes none with optimizers that
    take ``grad_scale``/``found_inf`` (fused Adam/AdamW/SGD) and exactly one (found_inf) otherwise, as torch.

    Args:
        device: Accepted for torch compatibility; the state lives on the device of the first scaled output.
        init_scale, growth_factor, backoff_factor, growth_interval: torch's arguments; build a
            :class:`DynamicScale` with torch's rule. Leave them at their defaults when passing ``policy``.
        enabled: False makes every call a no-op (``step`` still steps). Arguments are validated anyway.
        policy: Any policy (``init``/``update``), e.g. ``DynamicScale(hysteresis=2)`` or a preset.
        overflow_mode: ``"inf_nan"`` (default) or ``"saturation"`` (scaled |g| >= finfo(saturation_dtype).max).
        saturation_dtype: The low-precision format whose max defines saturation (default float16).
        process_group: Where found_inf is reduced when torch.distributed is initialized (default: world).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        policy: Policy | None = None,
        overflow_mode: OverflowMode = "inf_nan",
        saturation_dtype: torch.dtype = torch.float16,
        process_group: Any = None,
    ) -> None:
        torch_args = dict(init_scale=init_scale, growth_factor=growth_factor,
                          backoff_factor=backoff_factor, growth_interval=growth_interval)
        if policy is None:
            policy = DynamicScale(**torch_args)
        else:
            changed = {k: v for k, v in torch_args.items() if v != _TORCH_DEFAULTS[k]}
            if changed:
                raise ValueError(
                    f"GradScaler(policy=..., {', '.join(f'{k}={v!r}' for k, v in changed.items())}): pass "
                    f"either policy= or torch's scale arguments, not both; got both."
                )
            if not isinstance(policy, Policy):
                raise TypeError(
                    f"GradScaler(policy={policy!r}): policy must have init(device) and update(state, found_inf) "
                    f"(e.g. lossscale.DynamicScale); got {type(policy).__name__}."
                )
        check_mode("GradScaler", overflow_mode)
        if not isinstance(enabled, bool):
            raise ValueError(f"GradScaler(enabled={enabled!r}): enabled must be True or False; got {enabled!r}.")
        self._device = device
        self._enabled = enabled
        self.policy = policy
        self.overflow_mode = overflow_mode
        self._threshold = saturation_threshold(saturation_dtype)
        self.process_group = process_group
        self._observes_amax = bool(getattr(policy, "observes_amax", False))
        self._state: Any = None
        self._pending: dict[str, Any] | None = None  # loaded before the first scale()
        self._replicas: dict[torch.device, torch.Tensor] = {}
        self._records: dict[int, _OptimizerRecord] = {}

    # --- state -------------------------------------------------------------------------------

    def _init_state(self, device: torch.device) -> None:
        state = self.policy.init(device)
        if self._pending is not None:
            state = state_from_dict(state, self._pending)
            self._pending = None
        self._set_state(state)

    def _set_state(self, state: Any) -> None:
        self._state = state
        self._replicas = {state.scale.device: state.scale}

    def _require_state(self, call: str) -> Any:
        if self._state is None:
            raise RuntimeError(
                f"{call} was called before scale(): call scaler.scale(loss).backward() earlier in the "
                f"iteration so the scaler knows the scale and its device."
            )
        return self._state

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        rep = self._replicas.get(device)
        if rep is None:
            rep = self._replicas[device] = self._state.scale.to(device, non_blocking=True)
        return rep

    def _record(self, optimizer: torch.optim.Optimizer) -> _OptimizerRecord:
        return self._records.setdefault(id(optimizer), _OptimizerRecord())

    # --- torch's calls -----------------------------------------------------------------------

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor (or nested lists/tuples of tensors) by the current scale. No host read."""
        if not self._enabled:
            return outputs

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if self._state is None:
                    self._init_state(value.device)
                return value * self._scale_on(value.device)
            if isinstance(value, abc.Iterable):
                mapped = map(apply, value)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise ValueError(f"GradScaler.scale(outputs): outputs must be a Tensor or an iterable of Tensors; "
                             f"got {type(value).__name__}.")

        return apply(outputs)

    def _grads(self, optimizer: torch.optim.Optimizer, allow_fp16: bool) -> dict:
        grads = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not allow_fp16 and p.grad.dtype == torch.float16:
                    raise ValueError(
                        "GradScaler.unscale_(optimizer): the optimizer holds float16 gradients, whose unscaled "
                        "values would underflow; keep float32 master parameters (autocast does) and scale the loss."
                    )
                if p.grad.is_sparse and p.grad.dtype == torch.float16:
                    p.grad = p.grad.coalesce()
                grads.append(_dist.local_shard(p.grad))  # a DTensor's shard (FSDP2); found_inf is reduced after
        return group_by_device_and_dtype(grads)

    def _new_found_inf(self, device: torch.device) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32, device=device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record whether they overflowed.

        One fused read+write pass (inf_nan; saturation adds one read pass first). No host read.
        """
        if not self._enabled:
            return
        state = self._require_state("unscale_()")
        record = self._record(optimizer)
        if record.stage is _Stage.UNSCALED:
            raise RuntimeError("unscale_() was already called for this optimizer since the last update(); "
                               "call unscale_() at most once per optimizer between two update() calls.")
        if record.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() was called after step() for this optimizer; step() already "
                               "unscaled the gradients, so call unscale_() before step(), then update().")
        inv_scale = state.scale.double().reciprocal().float()
        found = {}
        for (device, _), grads in self._grads(optimizer, allow_fp16=False).items():
            if device not in found:
                found[device] = self._new_found_inf(device)
            inv = inv_scale if device == inv_scale.device else inv_scale.to(device, non_blocking=True)
            if self._observes_amax:  # one extra read pass: the largest scaled magnitude, before unscaling
                record.amax.append(check_with_amax_(grads, found[device], self.overflow_mode, self._threshold))
            unscale_and_check_(grads, found[device], inv, self.overflow_mode, self._threshold)
        record.found_inf = self._reduced(found, state.scale.device)
        record.stage = _Stage.UNSCALED

    def _check_only(self, optimizer: torch.optim.Optimizer, device: torch.device, record: _OptimizerRecord) -> dict:
        found: dict[torch.device, torch.Tensor] = {}
        for (dev, _), grads in self._grads(optimizer, allow_fp16=True).items():
            if dev not in found:
                found[dev] = self._new_found_inf(dev)
            if self._observes_amax:
                record.amax.append(check_with_amax_(grads, found[dev], self.overflow_mode, self._threshold))
            else:
                check_(grads, found[dev], self.overflow_mode, self._threshold)
        return self._reduced(found, device)

    def _reduced(self, found: dict[torch.device, torch.Tensor], device: torch.device) -> dict:
        """found_inf per device, summed onto the scale's device and reduced over ranks when distributed."""
        if not _dist.active(self.process_group):
            return found
        total = self._new_found_inf(device)
        for t in found.values():
            total += t.to(device, non_blocking=True)
        return {device: _dist.reduce_found_inf(total, self.process_group)}

    @staticmethod
    def _total(record: _OptimizerRecord, device: torch.device) -> torch.Tensor:
        values = [t.to(device, non_blocking=True) for t in record.found_inf.values()]
        if not values:
            return torch.zeros((), dtype=torch.float32, device=device)
        total = values[0].clone()
        for v in values[1:]:
            total += v
        return total.clamp_(max=1.0)  # a 0/1 flag: fused optimizers skip only where found_inf == 1.0

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> ScalerStep:
        """Unscale (unless done), then apply ``optimizer.step(*args, **kwargs)`` only if nothing overflowed.

        Fused optimizers receive ``grad_scale``/``found_inf`` and skip inside the kernel (no host read);
        others cost one host read of found_inf, as in torch. Returns a :class:`ScalerStep`.
        """
        if not self._enabled:
            value = optimizer.step(*args, **kwargs)
            true = torch.ones((), dtype=torch.bool)
            return ScalerStep(stepped=true, found_inf=~true, value=value)
        if "closure" in kwargs:
            raise RuntimeError("GradScaler.step(optimizer, closure=...): closures are not supported while "
                               "the scaler is enabled (the loss must be scaled before backward).")
        state = self._require_state("step()")
        record = self._record(optimizer)
        if record.stage is _Stage.STEPPED:
            raise RuntimeError("step() was already called for this optimizer since the last update(); "
                               "call update() after step() before stepping again.")
        device = state.scale.device

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if record.stage is _Stage.READY:
                record.found_inf = self._check_only(optimizer, device, record)
                grad_scale = state.scale * getattr(optimizer, "grad_scale", 1)
            else:
                grad_scale = getattr(optimizer, "grad_scale", None)
            found_inf = self._total(record, device)
            optimizer.grad_scale = grad_scale
            optimizer.found_inf = found_inf
            try:
                value = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale
                del optimizer.found_inf
            record.stage = _Stage.STEPPED
            overflow = found_inf > 0
            return ScalerStep(stepped=~overflow, found_inf=overflow, value=value)

        if record.stage is _Stage.READY:
            self.unscale_(optimizer)
        found_inf = self._total(record, device)
        overflow = found_inf > 0
        value = None
        if not bool(overflow):  # the one host read of the non-fused path, as in torch
            value = optimizer.step(*args, **kwargs)
        record.stage = _Stage.STEPPED
        return ScalerStep(stepped=~overflow, found_inf=overflow, value=value)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Advance the policy with this iteration's overflow (or set ``new_scale``). No host read
        unless the policy raises at its floor (``at_floor="raise"``: one read)."""
        if not self._enabled:
            return
        state = self._require_state("update()")
        if new_scale is not None:
            self._set_state(with_scale(state, new_scale, "GradScaler.update"))
        else:
            seen = [r for r in self._records.values() if r.stage is not _Stage.READY]
            if not seen:
                raise RuntimeError("update() was called without unscale_() or step() since the last update(); "
                                   "call scaler.step(optimizer) (which unscales) before update().")
            device = state.scale.device
            total = self._total(seen[0], device)
            for r in seen[1:]:
                total += self._total(r, device)
            if self._observes_amax:
                amaxes = [a.to(device) for r in seen for a in r.amax]
                amax = torch.stack(amaxes).max() if amaxes else torch.zeros((), device=device)
                if _dist.active(self.process_group):
                    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=self.process_group)
                self._set_state(self.policy.update(state, total, amax=amax))
            else:
                self._set_state(self.policy.update(state, total))
            check_floor(self.policy, self._state)
        self._records = {}

    def get_scale(self) -> float:
        """The current scale as a Python float (a host read); 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        if self._state is None:
            if self._pending is not None:
                return float(self._pending["scale"])
            return float(self.policy.init("cpu").scale)
        return float(self._state.scale)

    def get_scale_tensor(self) -> torch.Tensor | None:
        """The current scale as a 0-d tensor on its device (no host read); None before the first scale()."""
        return None if self._state is None else self._state.scale

    def is_enabled(self) -> bool:
        """Whether scaling is on."""
        return self._enabled

    # torch's getters and setters of the dynamic rule
    def _dynamic(self, call: str) -> DynamicScale:
        if not isinstance(self.policy, DynamicScale):
            raise TypeError(f"GradScaler.{call}: only a DynamicScale policy has this knob; "
                            f"the policy is {type(self.policy).__name__}.")
        return self.policy

    def get_growth_factor(self) -> float:
        return self._dynamic("get_growth_factor()").growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self.policy = dataclasses.replace(self._dynamic("set_growth_factor()"), growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        return self._dynamic("get_backoff_factor()").backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self.policy = dataclasses.replace(self._dynamic("set_backoff_factor()"), backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        return self._dynamic("get_growth_interval()").growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self.policy = dataclasses.replace(self._dynamic("set_growth_interval()"), growth_interval=new_interval)

    # --- attribution -------------------------------------------------------------------------

    def overflowing_parameters(self, optimizer: torch.optim.Optimizer, module: torch.nn.Module | None = None) -> list[str]:
        """Which of ``optimizer``'s parameters have overflowing gradients now (names from ``module``
        where given, else ``"param_groups[i][j]"``). Judged on the scaled values; call it after an
        overflow, before ``zero_grad()``. Cost: one read of the gradients and one host read."""
        names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        record = self._records.get(id(optimizer))
        unscaled = record is not None and record.stage is not _Stage.READY and not getattr(
            optimizer, "_step_supports_amp_scaling", False)
        divided = self.get_scale() if (unscaled and self._enabled) else 1.0
        named = (
            (names.get(id(p), f"param_groups[{i}][{j}]"), _dist.local_shard(p.grad))
            for i, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])
        )
        return overflowing(named, self.overflow_mode, self._threshold, unscaled_by=divided)

    # --- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's keys (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``) where the policy has them, plus ``policy_state`` (every state field).
        Empty when disabled, as in torch. Reads the state on the host."""
        if not self._enabled:
            return {}
        if self._state is not None:
            values = state_to_dict(self._state)
        elif self._pending is not None:
            values = dict(self._pending)
        else:
            values = state_to_dict(self.policy.init("cpu"))
        out: dict[str, Any] = {"scale": float(values["scale"])}
        if isinstance(self.policy, DynamicScale):
            out.update(growth_factor=self.policy.growth_factor, backoff_factor=self.policy.backoff_factor,
                       growth_interval=self.policy.growth_interval)
        if "growth_tracker" in values:
            out["_growth_tracker"] = int(values["growth_tracker"])
        out["policy_state"] = values
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from our ``state_dict()`` or from ``torch.amp.GradScaler.state_dict()``."""
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("GradScaler.load_state_dict({}): the state dict is empty, as saved by a disabled "
                               "scaler; nothing to restore.")
        if isinstance(self.policy, DynamicScale) and "growth_factor" in state_dict:
            self.policy = dataclasses.replace(
                self.policy, growth_factor=state_dict["growth_factor"],
                backoff_factor=state_dict["backoff_factor"], growth_interval=state_dict["growth_interval"])
        template = self._state if self._state is not None else self.policy.init("cpu")
        values = state_to_dict(template)
        values.update(state_dict.get("policy_state", {}))
        if "policy_state" not in state_dict:  # torch's format
            values["scale"] = state_dict["scale"]
            if "_growth_tracker" in state_dict and "growth_tracker" in values:
                values["growth_tracker"] = state_dict["_growth_tracker"]
        if self._state is not None:
            self._set_state(state_from_dict(self._state, values))
        else:
            self._pending = values

    def __getstate__(self) -> dict[str, Any]:
        if self._records:
            raise RuntimeError("GradScaler can be pickled only between iterations (before scale() or after "
                               "update()); an unscale_()/step() is in flight.")
        state = self.__dict__.copy()
        if self._state is not None:
            state["_pending"] = state_to_dict(self._state)
        state["_state"] = None
        state["_replicas"] = {}
        state["process_group"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
