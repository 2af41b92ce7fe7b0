"""``find_overflow``: one traced forward and scaled backward that says where the first non-finite value appeared."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lossscale.diagnosis.report import OverflowReport
from lossscale.diagnosis.trace import Tracer
from lossscale.validation import ArgumentTypeError, validated_scale

#: The backward passes (the first included) after which the search for ``max_safe_scale`` stops starting a trial;
#: a trial's check of twice its scale may add one.
MAX_SEARCH_RUNS = 12
_LOWEST, _HIGHEST = -126, 127  # the powers of two a float32 scale can take


def find_overflow(
    model: nn.Module, closure: Callable[[], torch.Tensor], *, scale: float | None = None
) -> OverflowReport:
    """Run ``closure()`` once with tracing on ``model``, then the backward of ``loss * scale``, and report the first
    non-finite value: in the input, a module's forward, the loss, or the scaled backward.

    The rule, in the order the values were made::

        input     a module called from outside the model (the model itself) received inf/NaN
        forward   the first call whose output is non-finite while its inputs were finite; a non-finite input
                  inside the model blames the calling module's own code
        loss      every module output finite, the loss is not
        backward  the first non-finite gradient: a parameter's module, or the innermost module that took the
                  tensor as input (module None: the loss's own backward)
        none      nothing was non-finite

    Then, where the forward and the loss were finite, ``max_safe_scale`` is searched: the largest power of two at
    which the backward stays finite, from the gradients' magnitudes and checked by rerunning the backward over the
    retained graph (``MAX_SEARCH_RUNS + 1`` backward passes in all, at most).

    The model is left as found: parameters, each ``.grad`` (None or its accumulated values, the same tensor
    object), buffers (BatchNorm's running statistics), every module's training mode, no hook left; gradients of
    other tensors the loss reaches (outside ``model``) too; the optimizer is never touched. The random number
    generators (CPU and the model's CUDA devices) are restored afterwards: dropout in the closure draws the masks the
    next real forward will draw again, so the diagnosed batch is the one training would see, and training's random
    stream is unchanged. Host reads: several (it is a diagnostic, not a training step).

    Args:
        model: The module whose calls are traced (all its submodules and parameters).
        closure: Runs the forward under the caller's own autocast and returns the loss (a tensor with one element
            that requires grad); it must not call ``backward()``.
        scale: The loss scale of the backward; default 2**16 (torch's initial scale).

    Returns:
        An :class:`~lossscale.diagnosis.report.OverflowReport`.

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        >>> x = torch.randn(8, 4)
        >>> def closure():
        ...     with torch.autocast("cpu", dtype=torch.float16):
        ...         return model(x).float().pow(2).mean()
        >>> find_overflow(model, closure, scale=1024).kind
        'none'
        >>> x[0, 0] = float("inf")
        >>> report = find_overflow(model, closure, scale=1024)
        >>> report.kind, report.module
        ('input', '')
    """
    call = "find_overflow"
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(
            f"{call}(model={model!r:.60}): model must be a torch.nn.Module (the model whose "
            f"forward the closure runs); got {type(model).__name__}."
        )
    if not callable(closure):
        raise ArgumentTypeError(
            f"{call}(closure={closure!r:.60}): closure must be a callable that runs the forward "
            f"pass and returns the loss; got {type(closure).__name__}."
        )
    scale = 2.0**16 if scale is None else validated_scale(f"{call}(scale={scale!r})", scale, name="scale")
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    params = list(model.parameters())
    with _kept_as_found(model, params, devices) as keep:
        tracer = Tracer(model)
        try:
            loss = closure()
            tracer.end_forward(loss if isinstance(loss, torch.Tensor) else None)
            _validate_loss(call, loss, params)
            keep.detach_grads_of(_graph_leaves(loss))
            first = tracer.report(scale)
            if first.kind in ("input", "forward", "loss"):
                return first
            search = _SafeScaleSearch(tracer, loss)
            finite, ratio = search.run(scale)
            safe = search.max_safe(scale, finite, ratio)
            return tracer.report(scale, safe, run=0)
        finally:
            tracer.remove()


class _SafeScaleSearch:
    """Reruns of the backward over the retained graph at other scales (run 0 is the requested scale)."""

    def __init__(self, tracer: Tracer, loss: torch.Tensor) -> None:
        self.tracer, self.loss, self.runs = tracer, loss, 0

    def run(self, scale: float) -> tuple[bool, float]:
        self.tracer.run = self.runs
        self.runs += 1
        (self.loss.float() * scale).backward(retain_graph=True)
        return self.tracer.backward_peak(self.tracer.run)

    def max_safe(self, scale: float, finite: bool, ratio: float) -> float | None:
        if not finite:  # start from an unscaled backward, then far lower ones
            for trial in (1.0, 2.0**-8, 2.0**-16, 2.0**-24):
                finite, ratio = self.run(trial)
                if finite:
                    scale = trial
                    break
            else:
                return None
        exponent = _HIGHEST if math.isinf(ratio) else math.floor(math.log2(scale * ratio))
        exponent = max(_LOWEST, min(_HIGHEST, exponent))
        known_good: int | None = exponent if scale == 2.0**exponent and finite else None
        while self.runs < MAX_SEARCH_RUNS:
            ok, _ = self.run(2.0**exponent)
            if ok:
                known_good = exponent
                if exponent == _HIGHEST or not self.run(2.0 ** (exponent + 1))[0]:
                    return 2.0**exponent
                exponent += 1
            else:
                if exponent == _LOWEST:
                    return None
                exponent -= 1
        return None if known_good is None else 2.0**known_good


def _validate_loss(call: str, loss: Any, params: Sequence[torch.Tensor]) -> None:
    if not isinstance(loss, torch.Tensor):
        raise ArgumentTypeError(f"{call}: closure() must return the loss as a tensor; got {type(loss).__name__}.")
    if loss.numel() != 1:
        raise ValueError(
            f"{call}: closure() must return one loss value (a tensor with one element, e.g. a mean); "
            f"got shape {tuple(loss.shape)}."
        )
    if any(p.grad is not None for p in params):
        raise ValueError(
            f"{call}: closure() must return the loss without calling backward() (find_overflow runs "
            f"the scaled backward itself); the model's gradients changed inside closure()."
        )
    if not loss.requires_grad:
        raise ValueError(
            f"{call}: closure() returned a loss that does not require grad; run the forward with grad "
            f"enabled (not under torch.no_grad() or inference_mode) and return the loss."
        )


def _graph_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors the loss's graph accumulates gradients into."""
    leaves, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


class _Keeper:
    """Takes each gradient away before the traced backward and gives the same tensor object back after it."""

    def __init__(self) -> None:
        self.grads: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def detach_grads_of(self, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            if id(t) not in self.grads:
                self.grads[id(t)] = (t, t.grad)
                t.grad = None

    def restore(self) -> None:
        for t, grad in self.grads.values():
            t.grad = grad


@contextlib.contextmanager
def _kept_as_found(model: nn.Module, params: Sequence[torch.Tensor], cuda_devices: list[int]) -> Iterator[_Keeper]:
    keep = _Keeper()
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.random.fork_rng(devices=cuda_devices, enabled=True):
        keep.detach_grads_of(params)
        try:
            yield keep
        finally:
            keep.restore()
            for m, training in modes:
                m.training = training
            with torch.no_grad():
                for b, saved in buffers:
                    if b.shape == saved.shape:
                        b.copy_(saved)
