"""``heal``: make a model float16-safe on one batch before a long run, by the same loop a healing front end runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from lossscale.diagnosis.addon import healing_precision
from lossscale.diagnosis.find import find_overflow
from lossscale.diagnosis.float32 import Float32Forward, keep_float32
from lossscale.diagnosis.report import OverflowReport
from lossscale.validation import validate_int_at_least


@dataclass
class HealReport:
    """What :func:`heal` did: the modules it kept and the report of each round.

    Attributes:
        kept: The modules kept, by name, and the precision each now runs in (in the order they were kept).
        reports: One :class:`~lossscale.OverflowReport` per round of the loop, the last one what the batch gives now
            (``"none"`` where the model is float16-safe on it).
    """

    kept: dict[str, torch.dtype] = field(default_factory=dict)
    reports: list[OverflowReport] = field(default_factory=list)
    _handles: list[Float32Forward] = field(default_factory=list, repr=False)

    @property
    def healed(self) -> bool:
        """Whether the last round found nothing non-finite."""
        return bool(self.reports) and self.reports[-1].kind == "none"

    def undo(self) -> None:
        """Return every kept module to autocast (its forward as before)."""
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()
        self.kept.clear()


def heal(
    model: nn.Module,
    closure: Callable[[], torch.Tensor],
    *,
    scale: float | None = None,
    max_healed: int = 8,
    precision: torch.dtype = torch.float32,
) -> HealReport:
    """Trace ``closure()`` on ``model`` (:func:`~lossscale.find_overflow`) and keep the module a forward fault names in
    ``precision``, its outputs in float32, until the batch runs clean: a model made float16-safe before a long run.

    The loop::

        report = find_overflow(model, closure, scale=scale)
        while report.kind == "forward" and its module is not kept yet, nor the model itself, and fewer than
                max_healed modules are kept:
            keep_float32(model.get_submodule(report.module), outputs="float32", precision=precision)
            report = find_overflow(model, closure, scale=scale)     # the overflow may have moved on: heal that too

    It heals no ``"input"`` (the data), ``"loss"`` (the loss computation) or ``"backward"`` fault: their reports
    say what to do. The model is otherwise left as found (:func:`~lossscale.find_overflow`); :meth:`HealReport.undo`
    returns the kept modules to autocast. Host reads: several (a diagnostic, not a training step).

    Args:
        model: The module whose calls are traced and whose modules are kept.
        closure: Runs the forward under the caller's own autocast and returns the loss (it must not call
            ``backward()``).
        scale: The loss scale of the traced backward; default 2**16 (torch's initial scale).
        max_healed: Modules kept at most (>= 1).
        precision: ``torch.float32`` (default) or ``torch.bfloat16``, what kept modules run in.

    Returns:
        A :class:`HealReport`.

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 1))
        >>> with torch.no_grad():
        ...     _ = model[0].weight.mul_(1e5)  # its float16 output passes 65504
        >>> x = torch.randn(8, 4)
        >>> def closure():
        ...     with torch.autocast("cpu", dtype=torch.float16):
        ...         return model(x).float().pow(2).mean()
        >>> result = heal(model, closure, scale=1024)
        >>> list(result.kept), result.reports[-1].kind
        (['0'], 'none')
        >>> result.undo()
    """
    call = (
        f"heal(model={type(model).__name__}, closure, scale={scale!r}, max_healed={max_healed!r}, "
        f"precision={precision})"
    )
    validate_int_at_least(call, "max_healed", max_healed, 1)
    dtype = healing_precision(call, precision, model)
    assert dtype is not None  # a precision, not False: validated above
    result = HealReport()
    report = find_overflow(model, closure, scale=scale)
    result.reports.append(report)
    while (
        report.kind == "forward"
        and report.module not in (None, "")
        and report.module not in result.kept
        and len(result.kept) < max_healed
    ):
        assert report.module is not None  # checked just above
        result._handles.append(keep_float32(model.get_submodule(report.module), outputs="float32", precision=dtype))
        result.kept[report.module] = dtype
        report = find_overflow(model, closure, scale=scale)
        result.reports.append(report)
    return result
