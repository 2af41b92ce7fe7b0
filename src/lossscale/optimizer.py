"""LossScaleOptimizer: scale, unscale, check, clip, skip, accumulate, and say what it did.

One boundary step is a short pipeline of named stages::

    measure   one read pass over the scaled gradients: overflow (inf/NaN, or saturation) and, when
              clipping by global norm, the norm (whose non-finiteness is the inf/NaN check)
    agree     found_inf (and a sharded norm) reduced over ranks under torch.distributed
    unscale   fold 1/scale and the clip factor into one coefficient; apply it in the fused optimizer
              kernel (grad_scale/found_inf), or with one _foreach_mul_ pass
    apply     the inner step: skipped inside the fused kernel, on the host (one read), or masked
    advance   weight decay and EMA (only where stepped), then the policy's sync-free update
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from lossscale import distributed as _dist
from lossscale._masked import MaskedSkip
from lossscale._validate import check_choice, check_int_at_least
from lossscale.clip import clip_per_tensor_, global_clip_coefficient, global_norm_squared
from lossscale.ema import EMA
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
    FloorError,
    Policy,
    check_floor,
    state_from_dict,
    state_to_dict,
    with_scale,
)
from lossscale.result import StepResult
from lossscale.underflow import underflow_share

__all__ = ["LossScaleOptimizer", "SkipMode"]

SkipMode = Literal["auto", "fused", "host", "masked"]


def _positive(call: str, name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < float("inf")):
        raise ValueError(f"{call}({name}={value!r}): {name} must be None or a finite number > 0; got {value!r}.")


def _shared(name: str) -> Any:  # HELPER-CHANGE: proxy safety until the lead's one-inner-state refactor
    """An attribute kept in ``self._shared_state``: a proxy that copies ``__dict__`` reads and writes the same one
    (Lightning's optimizer proxy forwards reads to the wrapper but would keep plain writes for itself)."""
    return property(lambda self: self._shared_state[name],
                    lambda self, value: self._shared_state.__setitem__(name, value))


class LossScaleOptimizer(torch.optim.Optimizer):
    """Wraps any ``torch.optim.Optimizer`` with dynamic loss scaling; ``step()`` returns a :class:`StepResult`.

    Usage::

        opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), fused=True), clip_grad_norm=1.0)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x)
        opt.backward(loss)          # loss * scale / accumulation_steps, then backward
        result = opt.step()         # StepResult(stepped, found_inf, scale, next_scale, grad_norm, ...)
        opt.zero_grad()

    Skip modes (how an overflowing step is skipped):
        ``"fused"``: the inner optimizer takes ``grad_scale``/``found_inf`` (fused Adam/AdamW/SGD) and skips in
        its kernel; unscaling and global-norm clipping are folded into ``grad_scale``. No host read.
        ``"host"``: found_inf is read once and ``inner.step()`` is not called (torch's behaviour).
        ``"masked"``: the inner step runs and parameters and state are restored where found_inf; no host read,
        at the cost of a snapshot (read+write) and a masked restore (2 reads + write) of params and state.
        ``"auto"``: ``"fused"`` when the optimizer supports it and no per-value/per-parameter clipping needs
        the unscaled gradients written; else ``"host"``.

    Passes over the gradients per boundary (fused, global-norm clip): one read. (host/masked: one read for
    the norm or none, plus one read+write to unscale.) Saturation mode adds one read.

    Args:
        inner: The optimizer to wrap.
        policy: Loss-scale policy (default ``DynamicScale()``, torch's rule).
        overflow_mode: ``"inf_nan"`` or ``"saturation"``.
        clip_grad_norm: Clip the unscaled gradients to this global L2 norm (torch's ``clip_grad_norm_``).
        clip_grad_value: Clamp each unscaled gradient value to [-v, v].
        clip_grad_norm_per_param: Keras's ``clipnorm``: clip each gradient tensor to this L2 norm.
        accumulation_steps: Micro-batches per optimizer step; the loss is divided by it.
        ema: An :class:`EMA`, advanced only on applied steps.
        weight_decay: Decoupled decay ``p -= lr * weight_decay * p`` before applied steps only.
        skip_mode: ``"auto"``, ``"fused"``, ``"host"`` or ``"masked"``.
        saturation_dtype: Format whose max defines saturation (default float16).
        process_group: found_inf is reduced over it under torch.distributed (default: world).
        sharded_grads: Which gradients are shards whose squared norms are summed over ranks when clipping.
            None: detected per gradient (DTensor with a ``Shard`` placement, as FSDP2 makes). True: every
            gradient is a rank's shard (a hand-written ZeRO). False: none is.
        module: Gives parameter names to overflow attribution.
        schedule: A :class:`~lossscale.PrecisionSchedule`; scaling runs only while it is in float16.
        check_when_unscaled: Keep catching inf/NaN (and skipping) while scaling is off (bf16/fp32 phase).
        underflow_stride: Turn on the underflow meter (``StepResult.underflow``): sample every n-th value of
            the scaled gradients and report the share float16 would round to zero (reads 1/n of them).

    Policies that observe the gradient maximum (``PredictiveScale``) get it from the overflow pass
    (``aminmax``: one read, replacing the plain check); with global-norm clipping it is one extra read.
    """

    _state = _shared("state")  # HELPER-CHANGE
    _window = _shared("window")  # HELPER-CHANGE

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        policy: Policy | None = None,
        overflow_mode: OverflowMode = "inf_nan",
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        accumulation_steps: int = 1,
        ema: EMA | None = None,
        weight_decay: float | None = None,
        skip_mode: SkipMode = "auto",
        *,
        clip_grad_norm_per_param: float | None = None,
        saturation_dtype: torch.dtype = torch.float16,
        process_group: Any = None,
        sharded_grads: bool | None = None,
        module: torch.nn.Module | None = None,
        schedule: Any = None,
        check_when_unscaled: bool = True,
        underflow_stride: int | None = None,
    ) -> None:
        call = "LossScaleOptimizer"
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"{call}(inner={type(inner).__name__}): inner must be a torch.optim.Optimizer.")
        if isinstance(inner, LossScaleOptimizer):
            raise TypeError(f"{call}(inner=LossScaleOptimizer): wrap the inner optimizer once, not a wrapper.")
        policy = DynamicScale() if policy is None else policy
        if not isinstance(policy, Policy):
            raise TypeError(f"{call}(policy={policy!r}): policy must have init(device) and update(state, found_inf).")
        check_mode(call, overflow_mode)
        for name, value in [("clip_grad_norm", clip_grad_norm), ("clip_grad_value", clip_grad_value),
                            ("clip_grad_norm_per_param", clip_grad_norm_per_param)]:
            _positive(call, name, value)
        clips = [n for n, v in [("clip_grad_norm", clip_grad_norm), ("clip_grad_value", clip_grad_value),
                                ("clip_grad_norm_per_param", clip_grad_norm_per_param)] if v is not None]
        if len(clips) > 1:
            raise ValueError(f"{call}({', '.join(clips)}): set at most one way of clipping (as Keras requires); "
                             f"got {len(clips)}.")
        check_int_at_least(call, "accumulation_steps", accumulation_steps, 1)
        if ema is not None and not isinstance(ema, EMA):
            raise TypeError(f"{call}(ema={ema!r}): ema must be a lossscale.EMA or None.")
        if weight_decay is not None and (isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float))
                                         or not (0 <= weight_decay < float("inf"))):
            raise ValueError(f"{call}(weight_decay={weight_decay!r}): weight_decay must be None or a finite "
                             f"number >= 0; got {weight_decay!r}.")
        check_choice(call, "skip_mode", skip_mode, ("auto", "fused", "host", "masked"))
        check_choice(call, "check_when_unscaled", check_when_unscaled, (True, False))
        if underflow_stride is not None:
            check_int_at_least(call, "underflow_stride", underflow_stride, 1)
        fusable = bool(getattr(inner, "_step_supports_amp_scaling", False))
        needs_written_grads = clip_grad_value is not None or clip_grad_norm_per_param is not None
        if skip_mode == "fused" and not fusable:
            raise ValueError(f"{call}(skip_mode='fused'): {type(inner).__name__} does not take grad_scale/found_inf; "
                             f"use a fused optimizer (e.g. AdamW(fused=True)) or skip_mode='host' or 'masked'.")
        if skip_mode == "auto":
            skip_mode = "fused" if fusable and not needs_written_grads else "host"

        self._shared_state: dict[str, Any] = {}  # HELPER-CHANGE
        self.inner = inner
        self.policy = policy
        self.overflow_mode = overflow_mode
        self.clip_grad_norm = clip_grad_norm
        self.clip_grad_value = clip_grad_value
        self.clip_grad_norm_per_param = clip_grad_norm_per_param
        self.accumulation_steps = accumulation_steps
        self.ema = ema
        self.weight_decay = weight_decay
        self.skip_mode: str = skip_mode
        self.process_group = process_group
        self.sharded_grads = sharded_grads
        self.module = module
        self.schedule = None
        self.check_when_unscaled = check_when_unscaled
        self.underflow_stride = underflow_stride
        self._threshold = saturation_threshold(saturation_dtype)
        self._explicit_unscale = skip_mode != "fused" or needs_written_grads
        self._masked = MaskedSkip()
        params = [p for g in inner.param_groups for p in g["params"]]
        self._device = params[0].device if params else torch.device("cpu")
        self._state = policy.init(self._device)
        self._micro = 0
        self._boundaries = 0
        self._unscaled_by: torch.Tensor | None = None
        self._window: tuple[bool, str | None] | None = None  # (scaled?, precision) fixed at a window's first loss
        self.last_result: StepResult | None = None
        if ema is not None:
            ema.bind(params)
        if schedule is not None:
            self.attach_schedule(schedule)

    # --- what users read ---------------------------------------------------------------------

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale, a 0-d float32 tensor on the parameters' device (no host read)."""
        return self._state.scale

    @property
    def scale_state(self) -> Any:
        """The policy's whole state record."""
        return self._state

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        """Set the loss scale (a finite float > 0 or a 1-element tensor); the policy's counters carry on.
        No host read for a tensor."""
        self._state = with_scale(self._state, new_scale, "LossScaleOptimizer.set_scale")

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

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
        if self._window is None:
            self._window = (self.scaling_active, self._precision())
        if not self._window[0] and self.accumulation_steps == 1:
            return loss
        factor = self._state.scale if self._window[0] else torch.ones_like(self._state.scale)
        if self.accumulation_steps > 1:
            factor = factor / self.accumulation_steps
        return loss * factor.to(loss.device, non_blocking=True)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``scale_loss(loss).backward(**kwargs)``."""
        self.scale_loss(loss).backward(**kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients at the start of an accumulation window; a no-op in the middle of one."""
        if self._micro == 0:
            self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.inner.add_param_group(param_group)

    def step(self, closure: Any = None) -> StepResult:  # type: ignore[override]
        """Count a micro-batch; at an accumulation boundary run the pipeline and return its decision."""
        if closure is not None:
            raise RuntimeError("LossScaleOptimizer.step(closure=...): closures are not supported; call "
                               "opt.backward(loss) and then opt.step().")
        self._micro += 1
        if self._micro < self.accumulation_steps:
            false = torch.zeros((), dtype=torch.bool, device=self._device)
            result = StepResult(stepped=false, found_inf=false, scale=self._state.scale,
                                next_scale=self._state.scale, accumulating=True, step=self._boundaries,
                                precision=self._precision() if self._window is None else self._window[1])
            self.last_result = result
            return result
        self._micro = 0
        result = self._boundary_step()
        self.last_result = result
        return result

    # --- the pipeline --------------------------------------------------------------------------

    def _raw_grads(self) -> list[torch.Tensor]:
        return [p.grad for g in self.inner.param_groups for p in g["params"] if p.grad is not None]

    def _grads(self) -> dict:
        # The local shards of DTensor gradients (FSDP2): checked and unscaled in place, found_inf reduced below.
        return group_by_device_and_dtype(_dist.local_shard(g) for g in self._raw_grads())

    def _boundary_step(self) -> StepResult:
        scale = self._state.scale
        active, precision = (self.scaling_active, self._precision()) if self._window is None else self._window
        self._window = None
        checking = active or self.check_when_unscaled
        groups = self._grads()
        found = torch.zeros((), dtype=torch.float32, device=self._device)

        # measure: one read pass (or folded into the unscale pass below)
        norm_sq = amax = underflow = None
        observes = active and bool(getattr(self.policy, "observes_amax", False))
        if active and self.underflow_stride:
            underflow = underflow_share([g for grads in groups.values() for g in grads], self.underflow_stride)
        if observes:  # the overflow pass also yields the largest scaled magnitude (aminmax: one read)
            sink = found if checking else torch.zeros_like(found)
            amax = torch.stack([check_with_amax_(grads, sink, self.overflow_mode, self._threshold).to(self._device)
                                for grads in groups.values()]).max() if groups else torch.zeros(())
            if _dist.active(self.process_group):
                torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=self.process_group)
        elif checking and self.overflow_mode == "saturation" and active:
            for grads in groups.values():
                check_(grads, found, "saturation", self._threshold)
        if self.clip_grad_norm is not None:
            norm_sq = global_norm_squared(self._raw_grads(), self.process_group, self.sharded_grads, self._device)
            if checking:
                found += (~torch.isfinite(norm_sq)).float()
        detected = norm_sq is not None or (self.overflow_mode == "saturation" and active) or observes
        if checking and not detected and not self._explicit_unscale:
            for grads in groups.values():
                check_(grads, found, "inf_nan")
            detected = True

        # unscale (+ clip), folded into one coefficient
        inv = scale.double().reciprocal().float() if active else torch.ones_like(scale)
        grad_norm = clip = None
        coef = inv
        if norm_sq is not None:
            grad_norm = norm_sq.sqrt() * inv
            clip = global_clip_coefficient(grad_norm, self.clip_grad_norm)
            coef = inv * clip
        self._unscaled_by = None
        if self._explicit_unscale:
            for grads in groups.values():
                device_coef = coef.to(grads[0].device)
                if checking and not detected:  # the unscale pass is also the check (no clip here)
                    if active:
                        unscale_and_check_(grads, found, device_coef)
                    else:
                        check_(grads, found, "inf_nan")
                elif active or clip is not None:
                    torch._foreach_mul_(grads, device_coef)
            self._unscaled_by = scale if active else None

        # agree
        found = _dist.reduce_found_inf(found, self.process_group)
        overflow = found > 0
        stepped = ~overflow

        if self._explicit_unscale:
            if self.clip_grad_value is not None:
                for grads in groups.values():
                    torch._foreach_clamp_min_(grads, -self.clip_grad_value)
                    torch._foreach_clamp_max_(grads, self.clip_grad_value)
            if self.clip_grad_norm_per_param is not None:
                clip_per_tensor_(self._raw_grads(), self.clip_grad_norm_per_param, self.process_group,
                                 self.sharded_grads)

        # apply
        fused_divisor = None
        if not self._explicit_unscale and (active or clip is not None):
            fused_divisor = scale if clip is None else (scale if active else torch.ones_like(scale)) / clip
        self._apply(found, overflow, stepped, fused_divisor)

        # advance
        self._boundaries += 1
        if self.ema is not None:
            self.ema.update(stepped, self._boundaries)
        state = self._state
        if active:
            self._state = self.policy.update(state, found, amax=amax) if observes else self.policy.update(state, found)
            try:
                check_floor(self.policy, self._state)
            except FloorError as err:
                raise FloorError(f"LossScaleOptimizer step {self._boundaries}: {err}") from None
        return StepResult(stepped=stepped, found_inf=overflow, scale=state.scale if active else torch.ones_like(scale),
                          next_scale=self._state.scale, grad_norm=grad_norm, step=self._boundaries - 1,
                          precision=precision, switched=self._consume_switch(precision), underflow=underflow)

    def _apply(self, found: torch.Tensor, overflow: torch.Tensor, stepped: torch.Tensor,
               fused_divisor: torch.Tensor | None) -> None:
        mode = self.skip_mode
        if mode == "masked" and not self._masked.ready(self.inner):
            mode = "host"  # the first step creates the optimizer's state: decide it on the host once
        if mode == "host":
            if not bool(overflow):
                self._decay(None)
                self.inner.step()
            return
        self._decay(stepped)
        if mode == "masked":
            self._masked.step(self.inner, overflow)
            return
        # fused: the kernel divides by grad_scale and skips where found_inf
        self.inner.grad_scale = fused_divisor
        self.inner.found_inf = found
        try:
            self.inner.step()
        finally:
            del self.inner.grad_scale
            del self.inner.found_inf

    @torch.no_grad()
    def _decay(self, stepped: torch.Tensor | None) -> None:
        """Decoupled weight decay ``p *= 1 - lr * wd``, exactly 1 where the step is skipped."""
        if not self.weight_decay:
            return
        for group in self.inner.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            rate = group["lr"] * self.weight_decay
            if stepped is None:
                torch._foreach_mul_(params, 1.0 - rate)
            else:
                factor = 1.0 - stepped.to(torch.float32) * rate
                torch._foreach_mul_(params, factor.to(params[0].device))

    # --- schedule hooks (filled in by attach_schedule) ---------------------------------------------

    def attach_schedule(self, schedule: Any) -> None:
        """Scale only while ``schedule`` is in float16; refuse parameters already in low precision."""
        from lossscale.schedule import check_attachable

        check_attachable(schedule, [p for g in self.inner.param_groups for p in g["params"]])
        self.schedule = schedule
        self._seen_switch = schedule.switched

    def _precision(self) -> str | None:
        if self.schedule is None:
            return None
        dtype = self.schedule.dtype
        return "float32" if dtype is None else str(dtype).replace("torch.", "")

    def _consume_switch(self, precision: str | None) -> bool:
        """True once: on the first boundary whose step ran in the original precision."""
        if self.schedule is None or self._seen_switch or precision in ("float16", "bfloat16"):
            return False
        self._seen_switch = True
        return True

    # --- attribution, checkpoints ------------------------------------------------------------------

    def overflowing_parameters(self) -> list[str]:
        """Names of the parameters whose gradients overflowed in the last step (before ``zero_grad``).

        Cost: one read of the gradients and one host read; call it after a skipped step, when asked."""
        names = {id(p): n for n, p in self.module.named_parameters()} if self.module is not None else {}
        named = ((names.get(id(p), f"param_groups[{i}][{j}]"), _dist.local_shard(p.grad))
                 for i, g in enumerate(self.inner.param_groups) for j, p in enumerate(g["params"]))
        divided = 1.0 if self._unscaled_by is None else float(self._unscaled_by)
        return overflowing(named, self.overflow_mode, self._threshold, unscaled_by=divided)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Inner optimizer, policy state, accumulation position (with the gradients accumulated so far
        when saved mid-window), EMA and schedule in one dict."""
        out: dict[str, Any] = {
            "inner": self.inner.state_dict(),
            "policy_state": state_to_dict(self._state),
            "micro_step": self._micro,
            "boundaries": self._boundaries,
        }
        if self._micro:  # mid-window: the gradients accumulated so far are part of the position
            out["accumulated_grads"] = [None if p.grad is None else p.grad.detach().clone()
                                        for g in self.inner.param_groups for p in g["params"]]
            out["window"] = self._window
        if self.ema is not None:
            out["ema"] = self.ema.state_dict()
        if self.schedule is not None:
            out["schedule"] = self.schedule.state_dict()
            out["seen_switch"] = self._seen_switch
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore everything :meth:`state_dict` saved."""
        self.inner.load_state_dict(state_dict["inner"])
        self._state = state_from_dict(self._state, state_dict["policy_state"])
        self._micro = int(state_dict["micro_step"])
        self._boundaries = int(state_dict["boundaries"])
        params = [p for g in self.inner.param_groups for p in g["params"]]
        for p, grad in zip(params, state_dict.get("accumulated_grads", [None] * len(params))):
            p.grad = None if grad is None else grad.to(p.device).clone()
        self._window = state_dict.get("window")
        if self.ema is not None and "ema" in state_dict:
            self.ema.load_state_dict(state_dict["ema"])
        if self.schedule is not None and "schedule" in state_dict:
            self.schedule.load_state_dict(state_dict["schedule"])
            self._seen_switch = bool(state_dict.get("seen_switch", self.schedule.switched))

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("LossScaleOptimizer is not pickled directly; save opt.state_dict() with torch.save.")
