"""What a step decided and how to read it: the step records, a CSV/TensorBoard logger, and the one way the library
writes a file (``atomic_write``)."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import math
import os
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["COLUMNS", "EventFields", "ScalerStep", "StepLogger", "StepOutcome", "StepResult", "step_record"]


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yield a temporary path beside ``path``; when the block ends without an exception, it replaces ``path``.

    The rule: write the whole file under a hidden temporary name in the same directory, flush it to disk, then
    ``os.replace`` it onto ``path`` (one rename). A process killed at any point leaves ``path`` as it was before
    (or absent if it never existed) or as the complete new file, never a part of one. An exception in the block
    removes the temporary file and leaves ``path`` untouched.

    Example:
        >>> import json, os, tempfile
        >>> target = os.path.join(tempfile.mkdtemp(), "results.json")
        >>> with atomic_write(target) as tmp:
        ...     with open(tmp, "w") as f:
        ...         json.dump({"skipped": 2}, f)
        >>> with open(target) as f:
        ...     json.load(f)
        {'skipped': 2}
    """
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".partial" + os.path.splitext(name)[1], dir=directory)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def read_scalars(values: Mapping[str, object]) -> dict[str, Any]:
    """``values`` with every one-element tensor replaced by a Python bool/int/float, read in one sync (a record:
    the caller reads its values by name)."""
    tensors = [(k, v) for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = dict(values)
    if tensors:
        device = tensors[0][1].device
        read = torch.stack([v.detach().reshape(()).to(device, torch.float64) for _, v in tensors]).tolist()
        for (k, v), x in zip(tensors, read):
            out[k] = bool(x) if v.dtype == torch.bool else (int(x) if not v.is_floating_point() else x)
    return out


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step decided, as device tensors (no host read): what an add-on's ``after_step`` sees.

    Attributes:
        stepped: 0-d bool, True where the inner optimizer's update was applied
            (``not (found_inf or forward_fault)``).
        found_inf: 0-d bool, True where the gradients overflowed.
        scale: 0-d float32, the loss scale the step's gradients carried (1 where its losses were not scaled).
        next_scale: 0-d float32, the scale after the policy's update.
        step: The number of optimizer steps before this one (0 for the first), skipped ones included.
        forward_fault: 0-d bool, True where a loss of the step was non-finite (a forward fault: the step is
            skipped and the policy does not see it), where a front end finds forward faults (``heal=True``); else
            None.
        loss_scaled: Whether the step's losses were scaled (False in a precision schedule's bfloat16 or float32
            phase).
    """

    stepped: torch.Tensor
    found_inf: torch.Tensor
    scale: torch.Tensor
    next_scale: torch.Tensor
    step: int = 0
    forward_fault: torch.Tensor | None = None
    loss_scaled: bool = dataclasses.field(default=True, metadata={"column": False})

    @property
    def skipped(self) -> torch.Tensor:
        """0-d bool, True where the step was skipped."""
        return ~self.stepped


@dataclass(frozen=True)
class StepResult(StepOutcome):
    """The decision of one ``LossScaleOptimizer.step()``: a :class:`StepOutcome`, with what only the optimizer
    knows; tensors stay on the device until the caller reads them.

    Attributes:
        stepped: 0-d bool, True where the inner optimizer's update was applied (``not (found_inf or
            forward_fault)``); False while accumulating.
        found_inf: 0-d bool, True where the gradients overflowed (inf/NaN, or saturation in ``"saturation"``
            overflow mode); False while accumulating.
        scale: 0-d float32, the loss scale the step's gradients carried (1 where its losses were not scaled).
        next_scale: 0-d float32, the scale after the policy's update: the one the next losses are multiplied by
            (while accumulating, the scale in use).
        step: The number of optimizer steps before this one (0 for the first), skipped ones included; while
            accumulating, the number of the step the window will make.
        forward_fault: 0-d bool, True where a loss of the step was non-finite (a forward fault: the step is
            skipped and the policy does not see it), where the optimizer finds forward faults (``heal=True``); else
            None.
        loss_scaled: Whether the step's losses were scaled (False in a precision schedule's bfloat16 or float32
            phase); not a column.
        grad_norm: 0-d float32, the unscaled global gradient norm when it was computed (``clip_grad_norm``), else
            None.
        underflow: 0-d float32 share of gradient values float16 would flush to zero (``underflow_stride``), else
            None.
        accumulating: True between accumulation boundaries (nothing was applied or checked).
        loss: What the closure passed to ``step(closure)`` returned (None without a closure); not a column.
        fields: What the add-ons and the front end added (name -> value): ``precision`` and ``switched`` of a
            :class:`~lossscale.PrecisionSchedule`, ``overflow_kind``/``overflow_module`` of a diagnosis,
            ``layer_scales`` of per-layer scales. Each is also an attribute (``result.precision``). Filled once, by
            the step that makes the result.
    """

    grad_norm: torch.Tensor | None = None
    underflow: torch.Tensor | None = None
    accumulating: bool = False
    loss: object = dataclasses.field(default=None, metadata={"column": False})
    fields: dict[str, Any] = dataclasses.field(default_factory=dict, metadata={"column": False})

    @property
    def skipped(self) -> torch.Tensor:
        """0-d bool, True where the step was skipped at a boundary (never while accumulating)."""
        return ~self.stepped if not self.accumulating else torch.zeros_like(self.stepped)

    def __getattr__(self, name: str) -> Any:
        """An added field by its name (``result.precision``, ``result.layer_scales``)."""
        fields = self.__dict__.get("fields")
        if fields is not None and name in fields:
            return fields[name]
        added = f" (the added fields are {sorted(fields)})" if fields else ""
        raise AttributeError(f"'StepResult' object has no attribute {name!r}{added}")

    def as_dict(self) -> dict[str, Any]:
        """Every column (and ``loss``) as plain Python values (reads the tensors on the host: one sync)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("column", True)}
        values.update((k, v) for k, v in self.fields.items() if _is_column_value(v))
        if isinstance(self.loss, torch.Tensor) and self.loss.numel() == 1:
            values["loss"] = self.loss.detach()
        return read_scalars(values)


@dataclass(frozen=True)
class ScalerStep:
    """What ``GradScaler.step`` decided.

    Attributes:
        found_inf: 0-d bool tensor, True where the gradients overflowed.
        value: What ``optimizer.step()`` returned (None when it was skipped without calling it).
        forward_fault: 0-d bool tensor, True where a loss scaled this iteration was non-finite (the step is skipped
            and the scale left as it was), where the scaler finds forward faults (``heal=True``); else None.

    No host read.
    """

    found_inf: torch.Tensor
    value: object = None
    forward_fault: torch.Tensor | None = None

    @property
    def stepped(self) -> torch.Tensor:
        """0-d bool tensor, True where the optimizer's update was applied: ``not (found_inf or forward_fault)``."""
        return ~self.found_inf if self.forward_fault is None else ~(self.found_inf | self.forward_fault)


def _is_column_value(value: object) -> bool:
    """Whether an added field is written as a column: None, a number, a bool, a string, a one-element tensor."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return value is None or isinstance(value, (bool, int, float, str))


#: The columns every row has, in order: ``step``, the step's other fields, ``skipped`` and the running counts of
#: skipped steps and forward faults. The fields the add-ons add follow them, then the caller's extras.
COLUMNS: tuple[str, ...] = (
    ("step",)
    + tuple(f.name for f in dataclasses.fields(StepResult) if f.name != "step" and f.metadata.get("column", True))
    + ("skipped", "skipped_steps", "forward_faults")
)


class EventFields:
    """The added fields of a front end's steps, for a logger that writes at its own cadence (every N steps): each
    value that is not None, taken once, at the first :meth:`take` after the step that made it (a later one of the same
    name replaces it). No host read.

    Example:
        >>> events = EventFields()
        >>> events.add({"overflow_kind": None})
        >>> events.add({"overflow_kind": "forward", "overflow_module": "0"})
        >>> events.take(), events.take()
        ({'overflow_kind': 'forward', 'overflow_module': '0'}, {})
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] = {}

    def add(self, fields: Mapping[str, Any]) -> None:
        """Keep the fields of one step that are not None."""
        self._pending.update((k, v) for k, v in fields.items() if v is not None)

    def take(self) -> dict[str, Any]:
        """The fields kept since the last take, and forget them."""
        taken, self._pending = self._pending, {}
        return taken


def step_record(result: StepResult, **extra: object) -> dict[str, Any]:
    """Every column of ``result`` as plain Python values (:data:`COLUMNS` but the running counts, then the fields the
    add-ons added), plus ``skipped`` and ``extra``, with one host read.

    Args:
        result: The :class:`StepResult` of one ``LossScaleOptimizer.step()``.
        **extra: Further values to record by name (the loss, the learning rate): plain Python values or one-element
            tensors (read in the same host read); a name that is a column or an added field raises a ValueError. An
            extra ``loss`` replaces the closure's.

    >>> import torch
    >>> from lossscale import StepResult
    >>> t, f = torch.tensor(True), torch.tensor(False)
    >>> r = StepResult(stepped=f, found_inf=t, scale=torch.tensor(8.0), next_scale=torch.tensor(4.0), step=3)
    >>> rec = step_record(r, loss=torch.tensor(2.5))
    >>> rec["skipped"], rec["scale"], rec["next_scale"], rec["loss"], rec["grad_norm"]
    (True, 8.0, 4.0, 2.5, None)
    """
    added = {k: v for k, v in result.fields.items() if _is_column_value(v)}
    clash = [k for k in extra if k in COLUMNS or k in added]
    if clash:
        whose = "a StepResult column" if clash[0] in COLUMNS else "a field the step's add-ons added"
        raise ValueError(
            f"step_record(..., {clash[0]}=...): {clash[0]!r} is {whose}; name the extra value differently."
        )
    values: dict[str, object] = {
        f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.metadata.get("column", True)
    }
    values["skipped"] = result.skipped
    values.update(added)
    if isinstance(result.loss, torch.Tensor) and "loss" not in extra:  # a closure's loss, when step(closure) ran
        values["loss"] = result.loss.detach()
    values.update(extra)
    tensors = [(k, v) for k, v in values.items() if isinstance(v, torch.Tensor)]
    for k, v in tensors:
        if v.numel() != 1:
            raise ValueError(
                f"step_record(..., {k}=tensor of shape {tuple(v.shape)}): values must be numbers or "
                f"one-element tensors."
            )
    return read_scalars(values)


class StepLogger:
    """Writes one row per optimizer step to a CSV file and, if asked, to TensorBoard.

    Rows have :data:`COLUMNS` (``skipped_steps`` and ``forward_faults``: the counts of skipped steps and of forward
    faults so far), then the fields the step's add-ons added (a :class:`~lossscale.PrecisionSchedule`'s
    ``precision`` and ``switched``; a diagnosis's ``overflow_kind`` and ``overflow_module``, empty except in the row
    of the step whose trace made a report), then the extra names of the first row logged. Accumulation micro-steps
    are not logged. TensorBoard gets the numeric columns as ``lossscale/<column>`` (extras under their own names)
    at ``global_step=step``, and the text ones (the diagnosis's) as text.

    The CSV survives a killed process: a file already at ``path_csv`` stays as it was until the new log has its
    header and first row (they are written to a temporary file that then replaces it, as ``atomic_write``
    does); after that each row goes to the file in one ``write`` of a whole line, so the file a kill leaves ends
    with the last row written (readers such as ``csv.DictReader`` and ``pandas.read_csv`` read it as it is).

    Args:
        path_csv: CSV file to write (replaced at the first row); None for no CSV.
        tensorboard_dir: Directory for a ``torch.utils.tensorboard.SummaryWriter``; None for none.
            Needs the ``tensorboard`` package.
        diagnosis: No longer needed (the diagnosis's columns come with each result) and ignored, with a
            FutureWarning; it will be removed.
    """

    def __init__(
        self,
        path_csv: str | os.PathLike[str] | None = None,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        *,
        diagnosis: object = None,
    ) -> None:
        if diagnosis is not None:
            warnings.warn(
                "StepLogger(diagnosis=...) is no longer needed: the overflow_kind and overflow_module columns come "
                "with each StepResult of a front end built with diagnose=...; the argument is ignored and will be "
                "removed. Leave it out.",
                FutureWarning,
                stacklevel=2,
            )
        self._path = None if path_csv is None else os.fspath(path_csv)
        self._file: IO[bytes] | None = None
        self._columns: tuple[str, ...] | None = None
        self._added: set[str] = set()  # the names the step's add-ons added: tagged lossscale/<name>, as COLUMNS
        if self._path is not None:  # fail here, not at the first row, if the file cannot be written
            directory = os.path.dirname(os.path.abspath(self._path))
            if not os.access(directory, os.W_OK):
                raise OSError(f"StepLogger(path_csv={self._path!r}): cannot write in directory {directory!r}.")
        self._writer: SummaryWriter | None = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError(
                    f"StepLogger(tensorboard_dir={os.fspath(tensorboard_dir)!r}): TensorBoard logging "
                    f"needs the tensorboard package ({err}); pip install tensorboard, or leave "
                    f"tensorboard_dir out."
                ) from None
            self._writer = SummaryWriter(os.fspath(tensorboard_dir))
        self.skipped_steps = 0
        self.forward_faults = 0
        self.rows = 0

    def log(self, result: StepResult, **extra: object) -> dict[str, Any] | None:
        """Read ``result`` (one host read) and write its row; None for an accumulation micro-step."""
        if result.accumulating:
            return None
        self._added.update(k for k, v in result.fields.items() if _is_column_value(v))
        return self.write(step_record(result, **extra))

    def write(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Write a record that :func:`step_record` made; return it with the running counts filled in."""
        row = dict(record)
        self.skipped_steps += bool(row.get("skipped"))
        self.forward_faults += bool(row.get("forward_fault"))
        row["skipped_steps"] = self.skipped_steps
        row["forward_faults"] = self.forward_faults
        first = self._columns is None
        if self._columns is None:
            self._columns = COLUMNS + tuple(k for k in row if k not in COLUMNS)
        unknown = [k for k in row if k not in self._columns]
        if unknown:
            raise ValueError(
                f"StepLogger.log(..., {unknown[0]}=...): the CSV's columns were fixed by the first row "
                f"({', '.join(self._columns[len(COLUMNS) :]) or 'no extras'}); log the same extra "
                f"names every step."
            )
        if self._path is not None:
            line = _csv_line(["" if row.get(c) is None else row[c] for c in self._columns])
            if first:
                self._start_csv(_csv_line(self._columns) + line)
            else:
                self._append(line)
        if self._writer is not None:
            step = int(row.get("step") or 0)
            for name in self._columns:
                value = row.get(name)
                tag = f"lossscale/{name}" if name in COLUMNS or name in self._added else name
                if isinstance(value, (bool, int, float)) and math.isfinite(float(value)) and name != "step":
                    self._writer.add_scalar(tag, float(value), global_step=step)
                elif isinstance(value, str):
                    self._writer.add_text(tag, value, global_step=step)
        self.rows += 1
        return row

    def _start_csv(self, head: str) -> None:
        """Write the header and first row under a temporary name, move it onto the path, keep it open to append."""
        assert self._path is not None  # called only with a path
        with atomic_write(self._path) as tmp:
            with open(tmp, "w", encoding="utf-8", newline="") as f:
                f.write(head)
        self._file = open(self._path, "ab", buffering=0)  # unbuffered: a row is one write() of a whole line

    def _append(self, line: str) -> None:
        assert self._file is not None  # opened by the first row
        data = line.encode("utf-8")
        while data:  # a regular file takes it whole; the loop is for a rare short write
            data = data[self._file.write(data) :]

    def close(self) -> None:
        """Close the CSV file and the TensorBoard writer."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> StepLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _csv_line(values: Iterable[object]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer).writerow(values)
    return buffer.getvalue()
