"""What a diagnosis found: :class:`OverflowReport` (the kind, the module, the advice, the per-module table) and
:class:`OverflowWarning`, the warning the automatic diagnosis issues with a report attached."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

#: The largest finite float16 value; a magnitude past it is inf in float16.
FLOAT16_MAX = 65504.0

Kind = Literal["input", "forward", "loss", "backward", "none"]


@dataclass(frozen=True)
class ModuleRecord:
    """One call of one module in a traced forward, with the largest magnitudes seen there.

    Attributes:
        module: Qualified name as in ``model.named_modules()`` (``""`` is the model itself).
        type: The module's class name.
        call: 0-based index of this call among the module's calls in the forward (a recomputation by activation
            checkpointing is not a call).
        input_max: Largest ``|x|`` over the call's floating-point inputs (inf or nan where one was non-finite);
            None where it had none.
        output_max: Largest ``|y|`` over its floating-point outputs; None where it had none.
        output_dtype: The dtype of its first floating-point output (``"float16"``), or None.
        grad_max: Largest ``|dL/dy|`` over its outputs' gradients in the scaled backward, or None where none was
            computed (no backward, or outputs that do not require grad).
    """

    module: str
    type: str
    call: int
    input_max: float | None
    output_max: float | None
    output_dtype: str | None
    grad_max: float | None


class OverflowWarning(UserWarning):
    """The automatic diagnosis found why the loss scale collapsed; ``.report`` is the :class:`OverflowReport`.

    Args:
        message: The warning's text: what fired the diagnosis and the report, printed.
        report: The :class:`OverflowReport` of the traced step, kept as ``.report`` (a report of kind ``"none"``
            where no step was traced yet).
    """

    def __init__(self, message: str, report: OverflowReport) -> None:
        super().__init__(message)
        self.report = report

    def __reduce__(self) -> tuple[type[OverflowWarning], tuple[str, OverflowReport]]:
        return type(self), (str(self), self.report)  # pickles (across processes) with its report


class HealWarning(OverflowWarning):
    """Healing changed the model (a module now runs in float32 or bfloat16), or stopped because it cannot fix this
    run; ``.report`` is the :class:`OverflowReport` that named the module, ``.healed`` the modules kept so far (name
    to the precision each runs in).

    Args:
        message: The warning's text: what healing did or why it stopped, and the report, printed.
        report: The :class:`OverflowReport` that named the module, kept as ``.report``.
        healed: The modules kept so far, each qualified name (as in ``named_modules()``) to the ``torch.dtype`` it
            runs in; copied into a dict as ``.healed`` (None: empty).
    """

    def __init__(self, message: str, report: OverflowReport, healed: Mapping[str, object] | None = None) -> None:
        super().__init__(message, report)
        self.healed = dict(healed or {})

    def __reduce__(self) -> tuple[type[OverflowWarning], tuple[str, OverflowReport]]:
        return type(self), (str(self), self.report, self.healed)  # type: ignore[return-value]  # three, as __init__ takes


class HealError(RuntimeError):
    """A run that heals kept skipping with nothing left to heal (``give_up_after`` skipped steps in a row): raised on
    every rank at the same step, with the diagnosis's reports (``.reports``, the last one last).

    Args:
        message: The error's text: how many steps were skipped, why healing could not help, and the last report.
        reports: The diagnosis's reports, one per traced step, oldest first; copied into a list as ``.reports``.
    """

    def __init__(self, message: str, reports: list[OverflowReport]) -> None:
        super().__init__(message)
        self.reports = list(reports)

    def __reduce__(self) -> tuple[type[HealError], tuple[str, list[OverflowReport]]]:
        return type(self), (str(self), self.reports)


@dataclass(frozen=True)
class OverflowReport:
    """Where the first non-finite value of a forward and scaled backward appeared, and what fixes it.

    Attributes:
        kind: ``"input"`` (the model received a non-finite tensor), ``"forward"`` (``module``'s own code made a
            non-finite output from finite inputs), ``"loss"`` (every module's output was finite, the loss was not),
            ``"backward"`` (forward and loss finite; the scaled backward made a non-finite gradient first at
            ``module``; None there means the loss's own backward), ``"none"`` (nothing was non-finite).
        module: Qualified name as in ``named_modules()`` (``""``: the model itself), or None.
        call: Which call of ``module`` (0-based) where it was called more than once in the forward, else None.
        calls: How many times ``module`` was called in the forward (None without a module).
        nan: True where the first non-finite value was a NaN rather than +-inf.
        scale: The loss scale of the backward.
        max_safe_scale: The largest power of two at which this batch's backward stays finite (below 1 where even
            an unscaled backward overflows); None where the forward or the loss broke, or where it was not measured.
        advice: What fixes this kind of fault, in one or two sentences.
        records: One :class:`~lossscale.diagnosis.ModuleRecord` per module call, in the order the calls started.
        loss: The loss's value (None where unknown).
        rank: The process's rank under torch.distributed, else None.
    """

    kind: Kind
    module: str | None
    call: int | None
    calls: int | None
    nan: bool
    scale: float
    max_safe_scale: float | None
    advice: str
    records: tuple[ModuleRecord, ...] = ()
    loss: float | None = None
    rank: int | None = None

    @property
    def where(self) -> str:
        """The module in words: ``'encoder.ff' (call 2 of 2)``, ``the model itself``, or ``the loss``."""
        if self.module is None:
            return "the loss computation" if self.kind in ("loss", "backward") else "nowhere"
        name = "the model itself" if self.module == "" else repr(self.module)
        typ = next((r.type for r in self.records if r.module == self.module), None)
        name += f" ({typ})" if typ else ""
        if self.call is not None and (self.calls or 0) > 1:
            name += f", call {self.call + 1} of {self.calls}"
        return name

    @property
    def summary(self) -> str:
        """One sentence: what went non-finite where."""
        value = "NaN" if self.nan else "inf"
        if self.kind == "input":
            return f"the model received a non-finite input ({value}) at {self.where}"
        if self.kind == "forward":
            return f"forward overflow: {self.where} produced {value} from finite inputs"
        if self.kind == "loss":
            return f"the loss is {value} while every module's output was finite"
        if self.kind == "backward":
            return (
                f"backward overflow at scale {_num(self.scale)}: the first non-finite gradient ({value}) "
                f"came from {self.where}"
            )
        return f"nothing was non-finite at scale {_num(self.scale)}"

    def __str__(self) -> str:
        lines = [f"OverflowReport: {self.summary}."]
        if self.rank is not None:
            lines[0] = f"[rank {self.rank}] " + lines[0]
        safe = "not measured" if self.max_safe_scale is None else _num(self.max_safe_scale)
        if self.max_safe_scale is None and self.kind in ("input", "forward", "loss"):
            safe = "none (the forward or the loss broke)"
        lines.append(
            f"  kind={self.kind} module={self.module!r} call={self.call} nan={self.nan} "
            f"scale={_num(self.scale)} loss={_num(self.loss)} max_safe_scale={safe}"
        )
        lines.append(f"  advice: {self.advice}")
        lines.extend(self.table())
        return "\n".join(lines)

    def table_row(self) -> int | None:
        """The index in ``records`` of the named module's call (its first call where no call is named)."""
        if self.module is None:
            return None
        return next(
            (
                i
                for i, r in enumerate(self.records)
                if r.module == self.module and (self.call is None or r.call == self.call)
            ),
            None,
        )

    def table(self, limit: int = 40) -> list[str]:
        """The per-module table as lines (at most ``limit`` rows, around the named module)."""
        if not self.records:
            return []
        rows = list(enumerate(self.records))
        hit = self.table_row()
        hit = 0 if hit is None else hit
        if len(rows) > limit:
            start = max(0, min(hit - limit // 2, len(rows) - limit))
            rows = rows[start : start + limit]
        width = max(12, *(len(r.module or "(model)") + r.module.count(".") for _, r in rows))
        width = min(width, 60)
        out = [
            f"  {'module':<{width}} {'type':<18} {'call':>4} {'input max':>10} {'output max':>10} "
            f"{'dtype':>8} {'grad max':>10}"
        ]
        if rows[0][0] > 0:
            out.append(f"  ... {rows[0][0]} earlier calls")
        for i, r in rows:
            name = " " * r.module.count(".") + r.module if r.module else "(model)"
            mark = "  <--" if i == hit and self.module is not None else ""
            out.append(
                f"  {name[:width]:<{width}} {r.type[:18]:<18} {r.call:>4} {_num(r.input_max):>10} "
                f"{_num(r.output_max):>10} {(r.output_dtype or '-'):>8} {_num(r.grad_max):>10}{mark}"
            )
        if rows[-1][0] < len(self.records) - 1:
            out.append(f"  ... {len(self.records) - 1 - rows[-1][0]} later calls (report.records has all)")
        return out

    def log_fields(self) -> dict[str, str | None]:
        """``{"overflow_kind": kind, "overflow_module": module}`` for a logger."""
        return {"overflow_kind": self.kind, "overflow_module": self.module}

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Draw each module call's largest forward and backward magnitudes against float16's range into ``path``
        (any format matplotlib writes, from the file's extension). Needs matplotlib (``pip install matplotlib``, or
        the demo extra in a clone of the lossscale repository: ``pip install '.[demo]'``)."""
        try:
            from matplotlib.figure import Figure
        except ImportError as error:
            raise ImportError(
                f"OverflowReport.plot({os.fspath(path)!r}) needs matplotlib: pip install matplotlib, or the demo "
                f"extra in a clone of the lossscale repository: pip install '.[demo]'."
            ) from error
        fig = Figure(figsize=(min(30.0, max(6.0, 0.18 * len(self.records) + 2)), 4.5), layout="constrained")
        ax = fig.subplots()
        xs = list(range(len(self.records)))
        top = FLOAT16_MAX * 16
        for attr, label, color in (
            ("output_max", "largest |output|", "tab:blue"),
            ("grad_max", f"largest |gradient| at scale {_num(self.scale)}", "tab:orange"),
        ):
            values = [getattr(r, attr) for r in self.records]
            if all(v is None for v in values):
                continue
            # a line broken where a value is missing or non-finite; crosses above the range where it is inf/NaN
            ax.plot(
                xs,
                [v if v is not None and math.isfinite(v) and v > 0 else math.nan for v in values],
                marker="o",
                ms=3,
                lw=1,
                color=color,
                label=label,
            )
            bad = [x for x, v in zip(xs, values) if v is not None and not math.isfinite(v)]
            if bad:
                ax.scatter(bad, [top] * len(bad), marker="x", color=color, s=30, label=f"{label}: inf or NaN")
        ax.axhline(FLOAT16_MAX, color="tab:red", ls="--", lw=1, label="float16 max (65504)")
        hit = self.table_row()
        if hit is not None and self.kind != "none":
            ax.axvline(hit, color="tab:red", lw=6, alpha=0.15, label=f"{self.kind}: {self.where}")
        ax.set_yscale("log")
        names = [(r.module or "(model)") + (f"#{r.call}" if r.call else "") for r in self.records]
        ax.set_xticks(xs, names, rotation=90, fontsize=6)
        ax.set_ylabel("magnitude")
        ax.set_title(self.summary, fontsize=8)
        ax.legend(fontsize=7, loc="upper left")
        fig.savefig(os.fspath(path))


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    if x != 0 and x == 2.0 ** round(math.log2(abs(x))) and abs(math.log2(abs(x))) >= 10:
        return f"2**{round(math.log2(x))}"
    return f"{x:.4g}"
