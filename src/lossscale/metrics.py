"""Metrics for your own loop: a :class:`~lossscale.StepResult` as one plain dict per step, logged to CSV or TensorBoard.

No dependencies beyond the standard library (TensorBoard only when asked for, through
``torch.utils.tensorboard``). Each step is read on the host once: the result's tensors and any tensor
extras (the loss) are stacked and read together.

Example::

    with StepLogger("steps.csv") as log:
        for x, y in batches:
            opt.backward(loss := loss_fn(model(x), y))
            log.log(opt.step(), loss=loss)   # writes a row at each optimizer step, skips accumulation
            opt.zero_grad()
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from typing import Any, Mapping

import torch

from lossscale._host import read_scalars

from lossscale.result import StepResult

__all__ = ["COLUMNS", "StepLogger", "step_record"]

#: The columns every row has, in order: ``step``, StepResult's other fields, ``skipped`` and the running count.
COLUMNS: tuple[str, ...] = ("step",) + tuple(
    f.name for f in dataclasses.fields(StepResult) if f.name != "step" and f.metadata.get("column", True)) + (
    "skipped", "skipped_steps")


def step_record(result: StepResult, **extra: Any) -> dict[str, Any]:
    """Every field of ``result`` as plain Python values, plus ``skipped`` and ``extra``, with one host read.

    Tensor values (the result's and 0-d tensors in ``extra``) are stacked and read together: one
    device sync per call. ``skipped`` is True where the boundary step was skipped; ``skipped_steps``
    is left to :class:`StepLogger`, which counts.

    >>> import torch
    >>> from lossscale import StepResult
    >>> t, f = torch.tensor(True), torch.tensor(False)
    >>> r = StepResult(stepped=f, found_inf=t, scale=torch.tensor(8.0), next_scale=torch.tensor(4.0), step=3)
    >>> rec = step_record(r, loss=torch.tensor(2.5))
    >>> rec["skipped"], rec["scale"], rec["next_scale"], rec["loss"], rec["grad_norm"]
    (True, 8.0, 4.0, 2.5, None)
    """
    clash = [k for k in extra if k in COLUMNS]
    if clash:
        raise ValueError(f"step_record(..., {clash[0]}=...): {clash[0]!r} is a StepResult column; name the extra "
                         f"value differently.")
    values: dict[str, Any] = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)
                              if f.metadata.get("column", True)}
    values["skipped"] = result.skipped
    if isinstance(result.loss, torch.Tensor) and "loss" not in extra:  # a closure's loss, when step(closure) ran
        values["loss"] = result.loss.detach()
    values.update(extra)
    tensors = [(k, v) for k, v in values.items() if isinstance(v, torch.Tensor)]
    for k, v in tensors:
        if v.numel() != 1:
            raise ValueError(f"step_record(..., {k}=tensor of shape {tuple(v.shape)}): values must be numbers or "
                             f"one-element tensors.")
    return read_scalars(values)


class StepLogger:
    """Writes one row per optimizer step to a CSV file and, if asked, to TensorBoard.

    Rows have :data:`COLUMNS` (``step, stepped, found_inf, scale, next_scale, grad_norm, accumulating,
    precision, switched, underflow, skipped, skipped_steps``: ``scale`` is the scale the step's
    gradients carried, ``skipped_steps`` the count of skipped steps so far) and then the extra names of the first row
    logged, in order. Results of accumulation micro-steps (``accumulating=True``) are not steps and are
    not logged. The CSV is flushed after each row, so a run that dies leaves every row it logged.

    TensorBoard gets the numeric columns as scalars (``lossscale/scale``, ``lossscale/skipped_steps``,
    ``lossscale/grad_norm``, ..., and each extra under its own name) at ``global_step=step``.

    Args:
        path_csv: CSV file to write (created, or truncated); None for no CSV.
        tensorboard_dir: Directory for a ``torch.utils.tensorboard.SummaryWriter``; None for none.
            Needs the ``tensorboard`` package.
    """

    def __init__(self, path_csv: str | os.PathLike[str] | None = None,
                 tensorboard_dir: str | os.PathLike[str] | None = None) -> None:
        self._writer: Any = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError(f"StepLogger(tensorboard_dir={os.fspath(tensorboard_dir)!r}): TensorBoard logging "
                                  f"needs the tensorboard package ({err}); pip install tensorboard, or leave "
                                  f"tensorboard_dir out.") from None
            self._writer = SummaryWriter(os.fspath(tensorboard_dir))
        self._file: Any = None
        self._csv: Any = None
        self._columns: tuple[str, ...] | None = None
        if path_csv is not None:
            self._file = open(path_csv, "w", newline="", encoding="utf-8")
            self._csv = csv.writer(self._file)
        self.skipped_steps = 0
        self.rows = 0

    def log(self, result: StepResult, **extra: Any) -> dict[str, Any] | None:
        """Read ``result`` (one host read) and write its row; None for an accumulation micro-step."""
        if result.accumulating:
            return None
        return self.write(step_record(result, **extra))

    def write(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Write a record that :func:`step_record` (or an earlier :meth:`log`) made; returns it with
        ``skipped_steps`` filled in. For a resumed run, write the rows saved in its checkpoint first."""
        row = dict(record)
        self.skipped_steps += bool(row.get("skipped"))
        row["skipped_steps"] = self.skipped_steps
        if self._columns is None:
            self._columns = COLUMNS + tuple(k for k in row if k not in COLUMNS)
            if self._csv is not None:
                self._csv.writerow(self._columns)
        unknown = [k for k in row if k not in self._columns]
        if unknown:
            raise ValueError(f"StepLogger.log(..., {unknown[0]}=...): the CSV's columns were fixed by the first row "
                             f"({', '.join(self._columns[len(COLUMNS):]) or 'no extras'}); log the same extra "
                             f"names every step.")
        if self._csv is not None:
            self._csv.writerow(["" if row.get(c) is None else row[c] for c in self._columns])
            self._file.flush()
        if self._writer is not None:
            step = int(row.get("step") or 0)
            for name in self._columns:
                value = row.get(name)
                if isinstance(value, (bool, int, float)) and math.isfinite(float(value)) and name != "step":
                    tag = f"lossscale/{name}" if name in COLUMNS else name
                    self._writer.add_scalar(tag, float(value), global_step=step)
        self.rows += 1
        return row

    def close(self) -> None:
        """Close the CSV file and the TensorBoard writer."""
        if self._file is not None:
            self._file.close()
            self._file = None
            self._csv = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> StepLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
