"""The demo's figure: loss curves, the scale trajectory with skipped steps marked, and the measured underflow.

Drawn with matplotlib (the ``demo`` extra) through its object API and the Agg canvas, so no global
backend is touched. Without matplotlib, a plain chart of the same three panels without text is drawn
by :mod:`lossscale.demo._png`.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

from lossscale.demo.config import power_text

__all__ = ["have_matplotlib", "plot_runs"]

_COLORS = {"fp32": (0, 0, 0), "fp16-noscale": (214, 39, 40), "fp16-dynamic": (31, 119, 180),
           "fp16-predictive": (255, 127, 14), "bf16": (44, 160, 44), "fast|step|0.9": (148, 103, 189)}
_OTHER = [(140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34)]


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _color(name: str, i: int) -> tuple[int, int, int]:
    return _COLORS.get(name, _OTHER[i % len(_OTHER)])


def _scales(run: dict[str, Any]) -> bool:
    """Whether the run's loss scale ever differs from 1 (runs without scaling are left off the scale panel)."""
    return any(s != 1.0 for s in run["scale"])


def _plot_underflow(ax: Any, run: dict[str, Any], color: tuple[float, ...]) -> None:
    """The run's measured underflow (dots) and, for float16 runs, the library's per-step meter (dashed)."""
    samples = run["underflow_samples"]
    ax.plot([s for s, _ in samples], [100 * v for _, v in samples], "o-", color=color, ms=3, label=run["name"])
    meter = [(s, v) for s, v in enumerate(run.get("underflow_meter") or []) if v is not None]
    if meter and _float16(run):  # StepResult.underflow: what float16 would flush of the accumulated gradients
        ax.plot([s for s, _ in meter], [100 * v for _, v in meter], "--", color=color, lw=0.8, alpha=0.7)


def _float16(run: dict[str, Any]) -> bool:
    """Whether the run computes in float16 (the underflow meter counts what float16 would flush)."""
    return run["name"].startswith("fp16") or "float16" in (run.get("precision") or [])


def plot_runs(path: str, runs: list[dict[str, Any]], title: str) -> str:
    """Write the figure to ``path``; returns ``"matplotlib"`` or ``"plain"`` (the fallback that was used)."""
    if have_matplotlib():
        _plot_matplotlib(path, runs, title)
        return "matplotlib"
    _plot_plain(path, runs)
    return "plain"


def _plot_matplotlib(path: str, runs: list[dict[str, Any]], title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 10), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, scale_ax, under_ax = fig.subplots(3, 1, sharex=True)
    for i, r in enumerate(runs):
        color = tuple(c / 255 for c in _color(r["name"], i))
        steps = range(len(r["train_loss"]))
        loss_ax.plot(steps, r["train_loss"], color=color, lw=0.8, alpha=0.45)
        held = r["heldout_loss"]
        reference = r["name"] == "fp32"  # a wide band under the others: runs that match it run through it
        loss_ax.plot([s for s, _ in held], [v for _, v in held], "o-", color=color, ms=6 if reference else 3,
                     lw=4 if reference else 1.5, alpha=0.35 if reference else 1.0, zorder=1 if reference else 2,
                     label=f"{r['name']}  held-out {r['final_loss']:.3f}")
        if _scales(r):
            scale_ax.step(steps, r["scale"], where="post", color=color, lw=1.4,
                          label=f"{r['name']}: {r['skipped_steps']} skipped, final {power_text(r['final_scale'])}")
        if r["skipped"]:
            scale_ax.plot(r["skipped"], [r["scale"][s] for s in r["skipped"]], "x", color=color, ms=8, mew=1.8)
        _plot_underflow(under_ax, r, color)
        if r.get("switch_step") is not None:
            for ax in (loss_ax, scale_ax, under_ax):
                ax.axvline(r["switch_step"], color=color, ls=":", lw=1)
    held_values = [v for r in runs for _, v in r["heldout_loss"]]
    train_values = [v for r in runs for v in r["train_loss"]]
    if held_values and train_values:  # the first steps fall from ln(128) = 4.85: show the part where runs differ
        loss_ax.set_ylim(min(train_values + held_values) - 0.05, max(held_values) + 0.25)
    loss_ax.set_ylabel("loss (nats/char)")
    loss_ax.set_title("training loss (faint) and held-out loss (dots)")
    loss_ax.legend(fontsize=8)
    scale_ax.plot([], [], "x", color="gray", ms=8, mew=1.8, label="skipped step: overflow, scale halved")
    scale_ax.set_yscale("log", base=2)
    scale_ax.set_ylabel("loss scale (log2)")
    unscaled = ", ".join(r["name"] for r in runs if not _scales(r))
    scale_ax.set_title("loss scale used at each step (x = skipped step: overflow, parameters untouched)"
                       + (f"; not shown, no scaling: {unscaled}" if unscaled else ""), fontsize=10)
    scale_ax.legend(fontsize=8)
    under_ax.set_ylabel("% flushed to zero")
    under_ax.set_xlabel("optimizer step (a skipped step's batch is trained on at the next step)")
    under_ax.set_title("measured underflow: gradient values nonzero in float32 but zero in the run's backward\n"
                       "(dashed: the underflow meter, StepResult.underflow: sampled scaled gradients <= 2^-25)",
                       fontsize=10)
    fig.suptitle("\n".join(textwrap.wrap(title, 120)), fontsize=9)
    fig.savefig(path, dpi=100)


def _plot_plain(path: str, runs: list[dict[str, Any]]) -> None:
    from lossscale.demo._png import Panel, Series, write_chart

    loss, scale, under = Panel(), Panel(), Panel()
    for i, r in enumerate(runs):
        color = _color(r["name"], i)
        steps = list(range(len(r["train_loss"])))
        loss.series.append(Series(steps, r["train_loss"], color))
        log_scale = [math.log2(s) for s in r["scale"]]
        scale.series.append(Series(steps, log_scale, color))
        if r["skipped"]:
            scale.series.append(Series(r["skipped"], [log_scale[s] for s in r["skipped"]], color, crosses=True))
        samples = r["underflow_samples"]
        under.series.append(Series([s for s, _ in samples], [v for _, v in samples], color))
    write_chart(path, [loss, scale, under])
