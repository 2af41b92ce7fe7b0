"""The demo's figure: loss, loss scale per step with the skipped steps marked, and the measured underflow."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lossscale.reporting import atomic_write

if TYPE_CHECKING:
    from lossscale.demo.train import RunResult

COLORS = {
    "fp32": "black",
    "fp16-noscale": "tab:red",
    "fp16-dynamic": "tab:blue",
    "fp16-predictive": "tab:orange",
    "bf16": "tab:green",
    "fast|step|0.9": "tab:purple",
}


#: How fp32, the reference, is drawn: a wide light band below the grid and the other curves (``zorder``), so that the
#: runs which match it run through it and it still shows on both sides of them.
REFERENCE_BAND = {"lw": 10.0, "ms": 12.0, "alpha": 0.22, "zorder": 1.0, "solid_capstyle": "round"}


def plot_runs(path: str, runs: list[RunResult], title: str, metadata: dict[str, str] | None = None) -> None:
    """Write :func:`draw_runs` of ``runs`` to ``path`` as a PNG; ``metadata`` goes into the PNG's text chunks (the
    demo writes its command line and configuration there)."""
    fig = draw_runs(runs, title)
    with atomic_write(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png", metadata=metadata)


def draw_runs(runs: list[RunResult], title: str) -> Figure:
    """The three panels of ``runs`` (entries of results.json) on an Agg canvas: loss, loss scale, underflow."""
    fig = Figure(figsize=(10, 10), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, scale_ax, under_ax = fig.subplots(3, 1, sharex=True)
    for run in runs:
        name, curves, color = run["name"], run["curves"], COLORS.get(run["name"], "gray")
        style = REFERENCE_BAND if name == "fp32" else {"lw": 1.5, "ms": 3.0}
        loss_ax.plot(curves["train_loss"], color=color, lw=0.8, alpha=0.4)
        held_steps, held = zip(*curves["heldout_loss"])
        loss_ax.plot(held_steps, held, "o-", color=color, label=f"{name}: held-out {run['heldout_loss']:.3f}", **style)
        scales = curves["scale"][: run["switch_step"]]  # a schedule's float16 steps only: float32 needs no scale
        if any(s != 1.0 for s in scales):  # a schedule repeats fp16-dynamic's steps until it switches: dashed
            if run["switch_step"] is None:  # the line ends at the scale after the last step: the table's final scale
                ends, label = [run["final_scale"]], f"final {power_text(run['final_scale'])} (after the last step)"
            else:
                ends, label = [], f"float32 from step {run['switch_step']}"
            scale_ax.step(
                range(len(scales) + len(ends)),
                scales + ends,
                where="post",
                color=color,
                ls="--" if run["schedule"] else "-",
                label=f"{name}: {run['skipped_steps']} skipped, {label}",
            )
            skipped = [s for s in curves["skipped"] if s < len(scales)]
            scale_ax.plot(skipped, [scales[s] for s in skipped], "x", color=color, ms=8, mew=1.8)
        steps, shares = zip(*curves["underflow"])
        under_ax.plot(steps, [100 * s for s in shares], "o-", color=color, label=name, **style)
        if name.startswith("fp16"):  # the library's own meter, StepResult.underflow
            under_ax.plot([100 * (u or 0.0) for u in curves["underflow_meter"]], "--", color=color, lw=0.8, alpha=0.7)
        if run["switch_step"] is not None:
            for ax in (loss_ax, scale_ax, under_ax):
                ax.axvline(run["switch_step"], color=color, ls=":", lw=1)
    held_values = [v for r in runs for _, v in r["curves"]["heldout_loss"]]
    low = min(held_values + [v for r in runs for v in r["curves"]["train_loss"]])
    loss_ax.set_ylim(low - 0.05, max(held_values) + 0.25)  # training starts at ln(128) = 4.85: zoom in on the end
    loss_ax.set(title="training loss (faint) and held-out loss (dots)", ylabel="loss (nats per character)")
    scale_ax.plot([], [], "x", color="gray", ms=8, mew=1.8, label="skipped step (overflow)")
    scale_ax.set_yscale("log", base=2)
    unscaled = ", ".join(r["name"] for r in runs if all(s == 1.0 for s in r["curves"]["scale"]))
    not_shown = f"; at 1, not shown: {unscaled}" if unscaled else ""
    scale_ax.set(title=f"loss scale at each step (x: skipped step){not_shown}", ylabel="loss scale")
    under_ax.set(
        title="underflow: gradient values nonzero in a float32 backward pass but zero in the run's own\n"
        "(dashed: the library's meter, StepResult.underflow, on the accumulated gradients)",
        ylabel="% flushed to zero",
        xlabel="optimizer step (a skipped step's batch is trained on at the next)",
    )
    for ax in (loss_ax, scale_ax, under_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return fig


def power_text(x: float) -> str:
    """``2^24`` for a power of two, else ``%g``."""
    mantissa, exponent = math.frexp(x)
    return f"2^{exponent - 1}" if mantissa == 0.5 else f"{x:g}"
