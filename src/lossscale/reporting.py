"""What a step decided and how to read it: the step records, a CSV/TensorBoard logger, host-read counting,
and the one way the library writes a file (:func:`atomic_write`)."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch.utils.tensorboard import SummaryWriter

    from lossscale.diagnosis.addon import OverflowDiagnosis

__all__ = [
    "COLUMNS",
    "DIAGNOSIS_COLUMNS",
    "DiagnosisLog",
    "HostReadCounter",
    "ScalerStep",
    "StepLogger",
    "StepResult",
    "atomic_write",
    "overflow_diagnosis",
    "read_scalars",
    "step_record",
]


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
class StepResult:
    """The decision of one ``step()``; tensors stay on the device until the caller reads them.

    Attributes:
        stepped: 0-d bool, True where the inner optimizer's update was applied.
        found_inf: 0-d bool, True where the gradients overflowed (and the step was skipped).
        scale: 0-d float32, the loss scale the gradients of this step carried.
        next_scale: 0-d float32, the scale after the policy's update.
        grad_norm: 0-d float32, the unscaled global gradient norm when it was computed, else None.
        accumulating: True between accumulation boundaries (nothing was applied or checked).
        step: Index of this accumulation boundary (optimizer step attempts so far, skipped included).
        precision: ``"float16"``, ``"bfloat16"`` or ``"float32"`` under a schedule, else None.
        switched: True on the boundary where a precision schedule switched back to full precision.
        underflow: 0-d float32 share of gradient values float16 would flush to zero (the meter on), else None.
        loss: What the closure passed to ``step(closure)`` returned (None without a closure); not a column.
        layer_scales: Per-layer scales by module name when per-layer scaling is on; else None.
    """

    stepped: torch.Tensor
    found_inf: torch.Tensor
    scale: torch.Tensor
    next_scale: torch.Tensor
    grad_norm: torch.Tensor | None = None
    accumulating: bool = False
    step: int = 0
    precision: str | None = None
    switched: bool = False
    underflow: torch.Tensor | None = None
    loss: object = dataclasses.field(default=None, metadata={"column": False})
    layer_scales: dict[str, torch.Tensor] | None = dataclasses.field(default=None, metadata={"column": False})

    @property
    def skipped(self) -> torch.Tensor:
        """0-d bool, True where the step was skipped at a boundary (never while accumulating)."""
        return ~self.stepped if not self.accumulating else torch.zeros_like(self.stepped)

    def as_dict(self) -> dict[str, Any]:
        """Every column field (and ``loss``) as plain Python values (reads the tensors on the host: one sync)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("column", True)}
        if isinstance(self.loss, torch.Tensor) and self.loss.numel() == 1:
            values["loss"] = self.loss.detach()
        return read_scalars(values)


@dataclass(frozen=True)
class ScalerStep:
    """What ``GradScaler.step`` decided.

    Attributes:
        found_inf: 0-d bool tensor, True where the gradients overflowed.
        stepped: 0-d bool tensor, True where the optimizer's update was applied (``~found_inf``).
        value: What ``optimizer.step()`` returned (None when it was skipped without calling it).

    No host read.
    """

    found_inf: torch.Tensor
    value: object = None

    @property
    def stepped(self) -> torch.Tensor:
        return ~self.found_inf


#: The columns every row has, in order: ``step``, StepResult's other fields, ``skipped`` and the running count.
COLUMNS: tuple[str, ...] = (
    ("step",)
    + tuple(f.name for f in dataclasses.fields(StepResult) if f.name != "step" and f.metadata.get("column", True))
    + ("skipped", "skipped_steps")
)


#: The columns a :class:`StepLogger` given a diagnosis adds after :data:`COLUMNS`: the report's kind and module name.
DIAGNOSIS_COLUMNS: tuple[str, ...] = ("overflow_kind", "overflow_module")


def overflow_diagnosis(call: str, source: object) -> OverflowDiagnosis:
    """``source`` when it is an :class:`~lossscale.OverflowDiagnosis`, else the one among ``source.add_ons`` (a
    LossScaleOptimizer's or GradScaler's, built with ``diagnose=model``).

    Raises:
        TypeError: ``source`` is neither, or carries no diagnosis.
    """
    from lossscale.diagnosis.addon import OverflowDiagnosis

    if isinstance(source, OverflowDiagnosis):
        return source
    add_ons = getattr(source, "add_ons", None)
    found = next((a for a in add_ons if isinstance(a, OverflowDiagnosis)), None) if add_ons is not None else None
    if found is None:
        carries = " built without diagnose=" if add_ons is not None else ""
        raise TypeError(
            f"{call}: diagnosis must be a lossscale.OverflowDiagnosis, or a LossScaleOptimizer or GradScaler built "
            f"with diagnose=model; got a {type(source).__name__}{carries}."
        )
    return found


class DiagnosisLog:
    """Hands a logger the :data:`DIAGNOSIS_COLUMNS` of each new report of an overflow diagnosis, once: in the row or
    log of the step whose trace made it (or the first one written after). No host read.

    Example:
        >>> import torch
        >>> from lossscale import OverflowDiagnosis
        >>> log = DiagnosisLog(OverflowDiagnosis(torch.nn.Linear(2, 2)))
        >>> log.new_fields() is None  # no report yet
        True
    """

    def __init__(self, diagnosis: OverflowDiagnosis) -> None:
        self.diagnosis = diagnosis
        self._seen = diagnosis.last_report  # a report made before the logger existed belongs to no row of its

    def new_fields(self) -> dict[str, str | None] | None:
        """``{"overflow_kind": ..., "overflow_module": ...}`` of a report not handed out before, else None."""
        report = self.diagnosis.last_report
        if report is None or report is self._seen:
            return None
        self._seen = report
        return report.log_fields()


def step_record(result: StepResult, **extra: object) -> dict[str, Any]:
    """Every field of ``result`` as plain Python values, plus ``skipped`` and ``extra``, with one host read.

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
        raise ValueError(
            f"step_record(..., {clash[0]}=...): {clash[0]!r} is a StepResult column; name the extra value differently."
        )
    values: dict[str, object] = {
        f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.metadata.get("column", True)
    }
    values["skipped"] = result.skipped
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

    Rows have :data:`COLUMNS` (``skipped_steps``: the count of skipped steps so far), then the extra names of
    the first row logged. Accumulation micro-steps are not logged. TensorBoard gets the numeric columns as
    ``lossscale/<column>`` (extras under their own names) at ``global_step=step``.

    The CSV survives a killed process: a file already at ``path_csv`` stays as it was until the new log has its
    header and first row (they are written to a temporary file that then replaces it, as :func:`atomic_write`
    does); after that each row goes to the file in one ``write`` of a whole line, so the file a kill leaves ends
    with the last row written (readers such as ``csv.DictReader`` and ``pandas.read_csv`` read it as it is).

    With ``diagnosis``, every row also has :data:`DIAGNOSIS_COLUMNS` right after :data:`COLUMNS`:
    ``overflow_kind`` and ``overflow_module``, empty except in the row of the step whose trace made a new report
    (the step the :class:`~lossscale.OverflowWarning` came with), where they are the report's kind and module name
    (``overflow_module`` empty where the report names none). TensorBoard gets them as text.

    Args:
        path_csv: CSV file to write (replaced at the first row); None for no CSV.
        tensorboard_dir: Directory for a ``torch.utils.tensorboard.SummaryWriter``; None for none.
            Needs the ``tensorboard`` package.
        diagnosis: An :class:`~lossscale.OverflowDiagnosis`, or the LossScaleOptimizer or GradScaler built with
            ``diagnose=model`` that carries one; None for no diagnosis columns.

    Raises:
        TypeError: ``diagnosis`` is none of those.
    """

    def __init__(
        self,
        path_csv: str | os.PathLike[str] | None = None,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        *,
        diagnosis: object = None,
    ) -> None:
        self._reports = (
            None if diagnosis is None else DiagnosisLog(overflow_diagnosis("StepLogger(diagnosis=...)", diagnosis))
        )
        self._path = None if path_csv is None else os.fspath(path_csv)
        self._file: IO[bytes] | None = None
        self._columns: tuple[str, ...] | None = None
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
        self.rows = 0

    def log(self, result: StepResult, **extra: object) -> dict[str, Any] | None:
        """Read ``result`` (one host read) and write its row; None for an accumulation micro-step."""
        if result.accumulating:
            return None
        return self.write(step_record(result, **extra))

    def write(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Write a record that :func:`step_record` made; return it with ``skipped_steps`` filled in."""
        row = dict(record)
        self.skipped_steps += bool(row.get("skipped"))
        row["skipped_steps"] = self.skipped_steps
        fixed = COLUMNS
        if self._reports is not None:
            taken = [k for k in DIAGNOSIS_COLUMNS if k in record]
            if taken:
                raise ValueError(
                    f"StepLogger.log(..., {taken[0]}=...): {taken[0]!r} is a column of the logger's diagnosis "
                    f"(StepLogger(diagnosis=...)); name the extra value differently."
                )
            row.update(self._reports.new_fields() or dict.fromkeys(DIAGNOSIS_COLUMNS))
            fixed = COLUMNS + DIAGNOSIS_COLUMNS
        first = self._columns is None
        if self._columns is None:
            self._columns = fixed + tuple(k for k in row if k not in fixed)
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
                tag = f"lossscale/{name}" if name in COLUMNS or name in DIAGNOSIS_COLUMNS else name
                if isinstance(value, (bool, int, float)) and math.isfinite(float(value)) and name != "step":
                    self._writer.add_scalar(tag, float(value), global_step=step)
                elif name in DIAGNOSIS_COLUMNS and isinstance(value, str):
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


class HostReadCounter(TorchDispatchMode):
    """Context manager counting scalar host reads while active: calls of ``aten._local_scalar_dense``, the op
    behind ``.item()``, ``bool(t)``, ``float(t)`` and ``int(t)`` (on CUDA each one waits for the device).

    Example:
        >>> import torch
        >>> with HostReadCounter() as reads:
        ...     _ = torch.ones(()).item()
        >>> reads.count
        1
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))
