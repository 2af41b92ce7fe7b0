"""The boundary step of :class:`~lossscale.LossScaleOptimizer`, as the list of stages of :mod:`lossscale.step`.

Passes over the gradients, by configuration (inf_nan mode):

=====================================  ======================================================
fused optimizer, no clipping           1 read (the check); unscale in the kernel
fused optimizer, global-norm clipping  1 read (norm = check); unscale x clip in the kernel
host/masked, no clipping               1 read+write (unscale and check fused)
host/masked, global-norm clipping      1 read (norm = check) + 1 read+write (unscale x clip)
=====================================  ======================================================

"1 read" for the check: gradients under 128K elements (32K with one torch thread) are checked together in
one fused C++ call that writes them back unchanged (``x * 1.0``), faster there than a Python call per
tensor (:func:`lossscale.overflow.sum_min_numel`); the norm is one ``_foreach_norm`` call (``dot`` per
large tensor on AVX-512 CPUs or with several torch threads). Over many small CPU tensors (8M elements under
ATen's grain) the check, the norm and the unscale run on two threads (:mod:`lossscale._two_threads`). The fused
kernel writes the unscaled gradients back when given ``grad_scale`` (torch's kernel; 0.03-1.0 of a read pass
on a 2-core AVX2 EPYC, benchmarks/RESULTS.md "kernel unscale floors").

Saturation mode adds one read (``aminmax``) before unscaling; so does a policy that observes amax
when clipping (without clipping its ``aminmax`` read is the check). No host read except the host skip.
"""

from __future__ import annotations

import math

from typing import Any

import torch

from lossscale import _two_threads
from lossscale import step as stages
from lossscale.clip import global_clip_coefficient, global_norm_squared, grouped_norm_squared
from lossscale.overflow import check_, unscale_and_check_
from lossscale.policy import FloorError
from lossscale.result import StepResult
from lossscale.underflow import underflow_share

__all__ = ["run_boundary"]


def run_boundary(opt: Any, loss: Any) -> StepResult:
    """One optimizer step: measure, unscale (+clip), agree, apply, advance (the policy's next state computed
    before apply, installed after: :func:`_advance`). See the module docstring."""
    run, options, owner = opt._run, opt.options, opt._owner
    active, precision = (opt.scaling_active, opt._precision()) if run.window is None else run.window
    run.window = None
    checking = active or options.check_when_unscaled
    groups = stages.grouped_gradients(opt.inner, "LossScaleOptimizer.step()")
    scale = owner.scale
    found = stages.guarded_found(scale, opt._device) if active else torch.zeros(
        (), dtype=torch.float32, device=opt._device)

    layers = run.layers if active else None
    underflow = _underflow(groups, options.underflow_stride) if active else None
    if layers is None:
        inv, layer_obs = _inverse(opt, scale, found, active), None  # the guard's verdict alone: before any check
        amax, norm_sq, detected = _measure(opt, groups, found, active, checking)
    else:  # per-layer scales: each unit unscaled by scale * 2**e[unit] and checked in one pass
        layer_obs, amax, norm_sq = _measure_layers(opt, layers, found, scale)
        inv, detected, layer_scales = torch.ones_like(scale), True, layers.layer_scales(scale)
    grad_norm = clip = None
    if norm_sq is not None:
        grad_norm = norm_sq.sqrt() * inv
        clip = global_clip_coefficient(grad_norm, options.clip_grad_norm)
    coef = inv if clip is None else inv * clip  # None: only the fused kernel unscales (by the scale)
    _unscale(opt, groups, found, coef, active and layers is None, checking and not detected, clip is not None)
    found = stages.agree_(found, options.process_group, is_flag=True)  # born 0/1, only ever set to 1
    overflow = found.bool()
    stepped = ~overflow
    _transform_unscaled(opt, groups)
    divisor = _fused_divisor(opt, scale, active, clip)  # a tensor of its own, formed before the policy runs
    mode, applies = _skip_decision(opt, overflow)
    # the policy's next state now, while the 0-d tensors are in cache; installed after the step (_advance)
    pending = owner.next_state(found, amax, run.loss_finite, clean_on_host=applies is True) if (
        active and layers is None) else None
    _apply(opt, mode, applies, found, overflow, stepped, divisor)

    run.boundaries += 1
    if run.schedule is not None:  # the schedule warns once when it is never fed
        run.schedule.note_optimizer_step()
    if options.ema is not None:
        options.ema.update(stepped, run.boundaries)
    if active:
        _advance(opt, pending, layers, layer_obs, amax, scale)
    run.loss_finite = None
    return StepResult(stepped=stepped, found_inf=overflow, scale=scale if active else torch.ones_like(scale),
                      next_scale=owner.scale, grad_norm=grad_norm, step=run.boundaries - 1, precision=precision,
                      switched=opt._consume_switch(precision), underflow=underflow, loss=loss,
                      layer_scales=None if layers is None else layer_scales)


def _inverse(opt: Any, scale: torch.Tensor, found: torch.Tensor, active: bool) -> torch.Tensor | None:
    """1/scale (1 where the guard refused the scale: ``found`` as the guard made it) where gradients or
    their norm are multiplied by it (explicit unscaling, clipping); None where only a fused kernel divides by
    the scale (found_inf was born with the guard's verdict, so the kernel skips a refused scale)."""
    if not active:
        return torch.ones_like(scale)
    if opt._explicit_unscale or opt.options.clip_grad_norm is not None:
        return stages.inverse_(scale, found)
    return None


def _measure_layers(opt: Any, layers: Any, found: torch.Tensor, scale: torch.Tensor
                    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """Per-layer unscale and check (one read + one write pass), agreed over ranks (one MAX all-reduce of
    [2, units]); the clip norm, when clipping, of the unscaled gradients (one read). No host read."""
    options = opt.options
    found_u, amax_u = layers.unscale_(scale)
    observed = stages.agree_amax_(torch.stack([found_u.float(), amax_u.float()]), options.process_group)
    found_u, amax_u = observed[0] > 0, observed[1]
    found.logical_or_(found_u.any().to(found.device))
    norm_sq = None
    if options.clip_grad_norm is not None:
        raw = [p.grad for g in opt.inner.param_groups for p in g["params"] if p.grad is not None]
        norm_sq = global_norm_squared(raw, options.process_group, options.sharded_grads, opt._device)
        found.logical_or_(~(norm_sq < math.inf))  # inf or NaN (never negative): 2 ops; isfinite is 5
    return (found_u, amax_u), amax_u.max().to(scale.device), norm_sq


def _underflow(groups: stages.Groups, stride: int | None) -> torch.Tensor | None:
    """The underflow meter: reads every ``stride``-th value (None when off)."""
    if not stride:
        return None
    return underflow_share([g for grads in groups.values() for g in grads], stride)


def _measure(opt: Any, groups: stages.Groups, found: torch.Tensor, active: bool,
             checking: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """The read pass(es) before unscaling: (amax, squared norm, whether overflow was already checked).

    amax (policies that observe it): ``aminmax``, which is also the check. Saturation: ``aminmax`` on the
    scaled values. Clip: the norm, whose non-finiteness is the inf/NaN check. Otherwise, with a fused
    optimizer, a read-only check; with explicit unscaling, nothing here (the unscale pass checks)."""
    options = opt.options
    observes = active and opt.policy.observes_amax
    amax = norm_sq = None
    if observes:
        sink = found if checking else torch.zeros_like(found)
        amax = stages.measure_(groups, sink, options.overflow_mode, options.threshold, amax=True)
        stages.agree_amax_(amax, options.process_group)
    elif checking and active and options.overflow_mode == "saturation":
        stages.measure_(groups, found, "saturation", options.threshold, amax=False)
    if options.clip_grad_norm is not None:
        norm_sq = _norm_squared(opt, groups)
        if checking:
            found.logical_or_(~(norm_sq < math.inf))  # inf or NaN (never negative): 2 ops; isfinite is 5
    detected = norm_sq is not None or (options.overflow_mode == "saturation" and active) or observes
    if checking and not detected and not opt._explicit_unscale:
        stages.measure_(groups, found, "inf_nan", options.threshold, amax=False)
        detected = True
    return amax, norm_sq, detected


def _norm_squared(opt: Any, groups: stages.Groups) -> torch.Tensor:
    """The squared global norm of the scaled gradients: one read (:mod:`lossscale.clip`). Plain dense
    gradients (no DTensor, no sparse, not declared sharded) are read straight from ``groups``; anything
    else takes :func:`~lossscale.clip.global_norm_squared`'s shard-aware path. No host read."""
    options = opt.options
    if options.sharded_grads is not True and getattr(groups, "plain", False):
        return grouped_norm_squared(groups, opt._device)
    raw = [p.grad for g in opt.inner.param_groups for p in g["params"] if p.grad is not None]
    return global_norm_squared(raw, options.process_group, options.sharded_grads, opt._device)


def _unscale(opt: Any, groups: stages.Groups, found: torch.Tensor, coef: torch.Tensor | None, active: bool,
             check_here: bool, clipping: bool) -> None:
    """Explicit unscaling (host/masked skip, or a stage that needs written gradients): one read+write pass
    that multiplies by ``coef`` (1/scale x clip) and, where nothing checked yet, checks too (setting
    found_inf to 1.0 on an overflow, as every check does)."""
    opt._run.unscaled_by = None
    if not opt._explicit_unscale:
        return
    for grads in groups.values():
        device_coef = coef.to(grads[0].device)
        if check_here:
            if active:
                unscale_and_check_(grads, found, device_coef)
            else:
                check_(grads, found, "inf_nan")
        elif active or clipping:
            _two_threads.foreach_mul_(grads, device_coef)
    opt._run.unscaled_by = opt._owner.scale if active else None


def _transform_unscaled(opt: Any, groups: stages.Groups) -> None:
    """Value clipping and ``transform_unscaled`` on the unscaled gradients (explicit unscaling only)."""
    options = opt.options
    if not opt._explicit_unscale:
        return
    if options.clip_grad_value is not None:
        for grads in groups.values():
            torch._foreach_clamp_min_(grads, -options.clip_grad_value)
            torch._foreach_clamp_max_(grads, options.clip_grad_value)
    if options.transform_unscaled is not None:
        raw = [p.grad for g in opt.inner.param_groups for p in g["params"] if p.grad is not None]
        options.transform_unscaled(raw, process_group=options.process_group, sharded=options.sharded_grads)


def _fused_divisor(opt: Any, scale: torch.Tensor, active: bool, clip: torch.Tensor | None) -> torch.Tensor | None:
    """What the fused kernel divides the gradients by: scale / clip (None when there is nothing to divide),
    always a tensor of its own (as torch hands it), so no optimizer ever holds the owner's scale."""
    if opt._explicit_unscale or not (active or clip is not None):
        return None
    if clip is None:
        return scale.clone()
    return (scale if active else torch.ones_like(scale)) / clip


def _skip_decision(opt: Any, overflow: torch.Tensor) -> tuple[str, bool | None]:
    """How this step is skipped (``"fused"``, ``"host"`` or ``"masked"``), and for the host skip whether it
    applies: the one host read (found_inf); None where the device decides (the fused kernel, the masked
    step)."""
    mode = opt.skip_mode
    if mode == "masked" and not opt._masked.ready(opt.inner):
        mode = "host"  # the first step creates the optimizer's state: decide it on the host once
    return mode, stages.applies_on_host(overflow) if mode == "host" else None


def _advance(opt: Any, pending: Any, layers: Any, layer_obs: Any, amax: torch.Tensor | None,
             scale: torch.Tensor) -> None:
    """Install the policy's next state (computed before the inner step, see below), or with per-layer scales
    move the units' exponents and update the policy from what they leave (an overflow a unit's own factor
    caused lowers that unit alone). Raises the policy's FloorError, naming the step.

    Why the global policy's next state is computed before the step: it reads only this step's verdict
    (found_inf, amax, the loss's finiteness), never what the step writes, and it is pure, so computing it
    early changes nothing; after a kernel that streamed every parameter and its state, its ~9 0-d ops cost
    3-4x as much (3.5-6% of a 1M-parameter fused AdamW step on a 2-core AVX2 EPYC). Installing it here keeps
    every effect in its order: an inner step that raises leaves the scale as it was."""
    owner, run = opt._owner, opt._run
    try:
        if layers is None:
            owner.commit(pending)
        else:
            owner.update(layers.update(*layer_obs, scale), amax, run.loss_finite)
    except FloorError as err:
        raise FloorError(f"LossScaleOptimizer step {run.boundaries}: {err}") from None


def _apply(opt: Any, mode: str, applies: bool | None, found: torch.Tensor, overflow: torch.Tensor,
           stepped: torch.Tensor, fused_divisor: torch.Tensor | None) -> None:
    """The inner step, skipped where found_inf: in the fused kernel, on the host (``applies``, the host's
    reading), or masked."""
    if mode == "host":
        if applies:
            _decay(opt, None)
            opt.inner.step()
        return
    _decay(opt, stepped)
    if mode == "masked":
        opt._masked.step(opt.inner, overflow)
    else:
        stages.fused_step_(opt.inner, fused_divisor, found)


def _decay(opt: Any, stepped: torch.Tensor | None) -> None:
    """Decoupled weight decay ``p *= 1 - lr * wd``, exactly 1 where the step is skipped. Without it, nothing
    (not even a no_grad context: 5-10 us a step)."""
    if opt.options.weight_decay:
        _decay_params(opt, stepped, opt.options.weight_decay)


@torch.no_grad()
def _decay_params(opt: Any, stepped: torch.Tensor | None, wd: float) -> None:
    for group in opt.inner.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        rate = group["lr"] * wd
        if stepped is None:
            torch._foreach_mul_(params, 1.0 - rate)
        else:
            factor = 1.0 - stepped.to(torch.float32) * rate
            torch._foreach_mul_(params, factor.to(params[0].device))
