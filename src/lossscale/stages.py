"""The stages of one optimizer step of loss scaling, written once; both front ends compose them.

::

    scale_loss          loss * scale (/ accumulation)                          no pass, no host read
    grouped_gradients   the tensors to check and unscale in place, by device   no pass
    guarded_found       found_inf: 1 where the scale itself is corrupted       0-d ops
    measure_            overflow (+ amax) of the scaled gradients              1 read
    inverse             1/scale (1 where the guard refused the scale)          0-d ops
    clip_norm           the global-norm clip: the unscaled norm (a non-finite  1 read
                        one is an overflow) and torch's coefficient
    unscale_            multiply by 1/scale (x clip), checking in the pass     1 read + 1 write
    clip_value_         clamp each unscaled gradient to [-v, v]                1 read + 1 write
    agree_              found_inf (and forward_fault) over ranks               1 all-reduce
    apply               fused_step_ (flags in the kernel, no host read), applies_on_host (one host read),
                        or ops.masked.MaskedSkip (no host read)
    update              LossScale.update: the policy's rule, then its floor rule   0-d ops
    attribute           overflowing_names: which parameters overflowed         1 read + 1 host read, on demand

found_inf is one form through every stage: a 0-d float32 tensor, 0 or 1, on the scale's device (``guarded_found``
makes it, the checks only ever set it to 1, ``agree_`` keeps it 0/1 across ranks). So is forward_fault where a front
end finds forward faults. The front ends turn them into bools once, for their results.

``GradScaler`` and ``LossScaleOptimizer`` call these and nothing of each other.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from lossscale.ops import distributed as _dist
from lossscale.ops.clip import EPS, global_norm_squared, grouped_norm_squared
from lossscale.ops.overflow import OverflowMode, check_, check_with_amax_, overflowing, unscale_and_check_
from lossscale.validation import FLOAT32_MAX, SMALLEST_NORMAL_FLOAT32, capturing

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class Groups(dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]):
    """(device, dtype) -> the gradients to check and unscale in place; ``plain``: every one is its parameter's
    own dense ``torch.Tensor`` gradient (no DTensor shard, no sparse values)."""

    plain: bool = True


class NoGradientsError(RuntimeError, AssertionError):
    """A step was asked for with no gradient at all (an AssertionError too, as torch's scaler asserts)."""


def validate_loss(call: str, loss: Any) -> None:
    """A TypeError naming ``call`` unless ``loss`` is a tensor (a Python or NumPy scalar has no graph)."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"{call}: loss must be a tensor produced by the forward pass (it is "
            f"backpropagated); got {type(loss).__name__} {loss!r}."
        )


def scale_loss(loss: torch.Tensor, scale: torch.Tensor, divisor: int = 1) -> torch.Tensor:
    """``loss * scale / divisor`` on the loss's device (the front end validated the loss). No pass, no host read."""
    factor = scale if divisor == 1 else scale / divisor
    return loss * factor.to(loss.device, non_blocking=True)


def _writable(param: torch.Tensor) -> torch.Tensor:
    """What of ``param.grad`` is checked and unscaled in place: a DTensor's local shard, a sparse gradient's
    values (float16 ones coalesced first, written back to ``param.grad``, as torch does)."""
    grad = param.grad
    assert grad is not None  # only parameters with a gradient are grouped
    if grad.is_sparse:
        if grad.dtype == torch.float16 and not grad.is_coalesced():
            param.grad = grad = grad.coalesce()
        return grad._values()
    return _dist.local_shard(grad)


def grouped_gradients(
    optimizer: torch.optim.Optimizer, call: str, *, allow_fp16: bool = True, required: bool = True
) -> Groups:
    """The tensors to check and unscale in place, one per parameter with a gradient (a DTensor's local shard, a
    sparse gradient's values), grouped by (device, dtype) in the optimizer's order by torch's own grouping. No pass.

    Raises:
        NoGradientsError: no parameter of ``optimizer`` has a gradient (when ``required``).
        ValueError: a float16 gradient where ``allow_fp16`` is False (unscaling it would underflow).
    """
    grads = [g for group in optimizer.param_groups for p in group["params"] if (g := p.grad) is not None]
    plain = all(type(g) is torch.Tensor and g.layout is torch.strided for g in grads)
    tensors = (
        grads
        if plain
        else [_writable(p) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    )
    by_key = torch._C._group_tensors_by_device_and_dtype([tensors], False) if tensors else {}
    groups = Groups({key: cast("list[torch.Tensor]", lists[0]) for key, (lists, _) in by_key.items()})  # no None given
    groups.plain = plain
    if not allow_fp16 and any(dtype == torch.float16 for _, dtype in groups):
        raise ValueError(
            f"{call}: the optimizer holds float16 gradients, whose unscaled values would "
            f"underflow; keep float32 master parameters (autocast does) and scale the loss."
        )
    if not groups and required:
        raise NoGradientsError(
            f"{call}: No inf checks were recorded for this optimizer: none of its parameters has "
            f"a gradient. Call backward on the scaled loss before stepping; a step with no "
            f"gradients would count as a clean step and grow the scale."
        )
    return groups


def measure_(
    groups: Groups, found_inf: torch.Tensor, mode: OverflowMode, threshold: float, *, amax: bool
) -> torch.Tensor | None:
    """Add overflow to ``found_inf``; with ``amax`` also return the largest scaled magnitude (0-d float32 on
    ``found_inf``'s device; inf/NaN when it overflowed). Passes: one; no host read."""
    maxima = []
    for grads in groups.values():
        if amax:
            maxima.append(check_with_amax_(grads, found_inf, mode, threshold).to(found_inf.device))
        else:
            check_(grads, found_inf, mode, threshold)
    if not amax:
        return None
    if len(maxima) == 1:  # one device and dtype, the usual case: no stack
        return maxima[0]
    return torch.stack(maxima).max() if maxima else torch.zeros((), device=found_inf.device)


def clip_norm(
    groups: Groups,
    grads: Callable[[], list[torch.Tensor]],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    max_norm: float,
    process_group: ProcessGroup | None = None,
    sharded: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global-norm clip, decided on the scaled gradients before anything writes them (torch's
    ``clip_grad_norm_`` on the unscaled ones)::

        norm = sqrt(sum of |g|^2 over every gradient) * inv_scale     (a non-finite norm sets found_inf)
        coefficient = min(1, max_norm / (norm + 1e-6))

    The squares are summed over ``groups`` where they are plain local gradients, else over the parameters' own
    gradients (listed by ``grads()`` only then: shards, by their placement or ``sharded=True``, summed over the ranks
    that hold them). Returns (norm, coefficient), 0-d float32 on ``found_inf``'s device. One read of every gradient;
    no host read."""
    device = found_inf.device
    if sharded is not True and groups.plain:
        norm_squared = grouped_norm_squared(groups, device)
    else:
        norm_squared = global_norm_squared(grads(), process_group, sharded, device)
    found_inf.logical_or_(~(norm_squared < math.inf))
    norm = norm_squared.sqrt() * inv_scale
    return norm, (max_norm / (norm + EPS)).clamp(max=1.0)


def unscale_(
    grads: list[torch.Tensor],
    found_inf: torch.Tensor,
    factor: torch.Tensor | None,
    check: OverflowMode | None,
    threshold: float = 65504.0,
) -> None:
    """One pass over ``grads`` (one device and dtype), in place: multiply by ``factor`` (1/scale, x the clip
    coefficient) and, where ``check`` names a mode, record overflow in ``found_inf`` in the same pass; with
    ``factor`` None only check. One read + one write (a check alone: one read); no host read."""
    if factor is None:
        if check is not None:
            check_(grads, found_inf, check, threshold)
        return
    factor = factor if factor.device == grads[0].device else factor.to(grads[0].device, non_blocking=True)
    if check is not None:
        unscale_and_check_(grads, found_inf, factor, check, threshold)
    else:
        torch._foreach_mul_(grads, factor)


def clip_value_(groups: Groups, value: float) -> None:
    """Clamp every gradient to [-value, value] in place (torch's ``clip_grad_value_``). One read + one write."""
    for grads in groups.values():
        torch._foreach_clamp_min_(grads, -value)
        torch._foreach_clamp_max_(grads, value)


def fused_scaling(optimizer: torch.optim.Optimizer) -> Literal["flags", "scaler"] | None:
    """How ``optimizer.step`` takes the loss scale and skips in its kernel: ``"flags"`` (torch's fused
    Adam/AdamW/SGD read ``grad_scale``/``found_inf``, ``_step_supports_amp_scaling``), ``"scaler"`` (an older one
    whose step takes the whole scaler, ``grad_scaler=``), or None (it does not)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    try:
        takes_scaler = "grad_scaler" in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        takes_scaler = False
    return "scaler" if takes_scaler else "flags"


def guarded_found(scale: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """A step's first found_inf: 0-d float32 on ``device`` (default the scale's), 1 where ``scale`` is not a
    number in [2**-126, FLOAT32_MAX] (NaN, inf, 0, a negative: corrupted in memory), else 0. 2 0-d ops, no host
    read."""
    found = scale.clamp(min=SMALLEST_NORMAL_FLOAT32, max=FLOAT32_MAX).ne_(scale)
    if found.dtype != torch.float32 or (device is not None and found.device != torch.device(device)):
        found = found.to(device=found.device if device is None else device, dtype=torch.float32)
    return found


def inverse(scale: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` rounded once to float32, and 1 where :func:`guarded_found` refused the scale (``found``,
    its flag before any check sets it). 3 0-d ops, no host read."""
    inv = scale.reciprocal() if scale.dtype == torch.float32 else scale.double().reciprocal().float()
    return inv.masked_fill_(found.to(device=inv.device, dtype=torch.bool), 1.0)  # inv is new: in place


def agree_(
    found_inf: torch.Tensor,
    forward_fault: torch.Tensor | None = None,
    process_group: ProcessGroup | None = None,
    *,
    is_flag: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """found_inf, and forward_fault where given, as the group's 0/1 flags, in one reduction::

        found_inf = max over ranks of min(found_inf, 1)       (no min where ``is_flag``: already 0 or 1)
        forward_fault = max over ranks of forward_fault

    One all-reduce under torch.distributed (every rank of the group calls it), else nothing (a 0-d clamp for a
    count); no host read."""
    if not is_flag:
        found_inf.clamp_(max=1.0)
    if not _dist.active(process_group):
        return found_inf, forward_fault
    if forward_fault is None:
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX, group=process_group)
        return found_inf, None
    both = torch.stack([found_inf, forward_fault.to(found_inf.device)])
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=process_group)
    return both[0], both[1]


def agree_amax_(amax: torch.Tensor, process_group: ProcessGroup | None = None) -> torch.Tensor:
    """amax as the group's maximum, in place. One all-reduce under torch.distributed; no host read."""
    if _dist.active(process_group):
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=process_group)
    return amax


def fused_step_(
    optimizer: torch.optim.Optimizer,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Run a fused optimizer's step with ``grad_scale``/``found_inf`` set: the kernel divides the gradients
    by ``grad_scale`` and skips where ``found_inf == 1``. No pass of ours, no host read."""
    fused: Any = optimizer  # torch's fused optimizers read these two attributes, which Optimizer does not declare
    fused.grad_scale = grad_scale
    fused.found_inf = found_inf
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del fused.grad_scale
        del fused.found_inf


def applies_on_host(skip: torch.Tensor, call: str = "step()") -> bool:
    """Whether a step skipped on the host applies: ``not skip`` (a flag or a count), the one host read.

    Raises:
        RuntimeError: naming ``call``, under CUDA graph capture (a graph cannot capture a host read).
    """
    if capturing(skip):
        raise RuntimeError(
            f"{call} under CUDA graph capture: this step is skipped on the host, which reads found_inf there, and a "
            f"graph cannot capture a host read. Capture a fused optimizer built with capturable=True (e.g. "
            f"torch.optim.AdamW(params, fused=True, capturable=True): skipped in its kernel), or use "
            f"LossScaleOptimizer(skip_mode='masked') over an optimizer built with capturable=True."
        )
    return not bool(skip)


def warn_grad_scaler_deprecated() -> None:
    """torch's FutureWarning for optimizers that take ``grad_scaler=``."""
    warnings.warn(
        "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer. "
        "In the near future GradScaler registers `grad_scale: Tensor` and `found_inf: Tensor` to the "
        "passed optimizer and let the optimizer use them directly.",
        FutureWarning,
        stacklevel=3,
    )


def overflowing_names(
    optimizer: torch.optim.Optimizer, names: dict[int, str], mode: OverflowMode, threshold: float, unscaled_by: float
) -> list[str]:
    """Names of ``optimizer``'s parameters whose gradients overflowed (``param_groups[i][j]`` without a name).
    One read of the gradients and one host read."""
    named: Sequence[tuple[str, torch.Tensor | None]] = [
        (names.get(id(p), f"param_groups[{i}][{j}]"), None if p.grad is None else _dist.local_shard(p.grad))
        for i, group in enumerate(optimizer.param_groups)
        for j, p in enumerate(group["params"])
    ]
    return overflowing(named, mode, threshold, unscaled_by=unscaled_by)
