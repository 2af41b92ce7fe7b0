"""What the demo reports: one summary per run, the comparison table, and ``results.json``."""

from __future__ import annotations

import json
import os
from typing import Any

from lossscale.demo.config import DemoConfig, power_text
from lossscale.demo.runs import RunSpec
from lossscale.demo.train import RunHistory

__all__ = ["UNDERFLOW_DEFINITION", "summarize", "format_table", "verdict", "write_results"]

UNDERFLOW_DEFINITION = (
    "share of parameter-gradient values that are nonzero in a float32 backward pass of the same micro-batch "
    "on the same weights but exactly zero in the run's own backward pass (autocast precision, loss scale and "
    "accumulation included): the values that flushed to zero. Measured on the first micro-batch of every "
    "measure_every-th step and of the first and last step; 'underflow' is the mean over those samples, "
    "'underflow_peak' the largest.")


def summarize(spec: RunSpec, history: RunHistory) -> dict[str, Any]:
    """The run's entry in ``results.json``: the headline numbers first, then the curves."""
    rows = history.rows
    shares = [share for _, share in history.underflow]
    peak = max(history.underflow, key=lambda s: s[1]) if history.underflow else [None, None]
    return {
        "name": spec.name,
        "final_loss": history.heldout[-1][1] if history.heldout else None,
        "skipped_steps": sum(bool(r["skipped"]) for r in rows),
        "final_scale": _final_scale(rows[-1]) if rows else None,
        "underflow": sum(shares) / len(shares) if shares else None,
        "seconds": history.seconds,
        "summary": spec.summary,
        "steps": len(rows),
        "final_train_loss": rows[-1].get("loss") if rows else None,
        "underflow_peak": peak[1],
        "underflow_peak_step": peak[0],
        "underflow_peak_by_parameter": dict(sorted(history.underflow_peak_by_parameter.items(),
                                                   key=lambda kv: -kv[1])),
        "switch_step": history.switch_step,
        "heldout_loss": history.heldout,
        "underflow_samples": history.underflow,
        "train_loss": [r.get("loss") for r in rows],
        "scale": [r["scale"] for r in rows],
        "underflow_meter": [r.get("underflow") for r in rows],
        "skipped": [r["step"] for r in rows if r["skipped"]],
        "precision": [r["precision"] for r in rows] if spec.schedule else None,
    }


def _final_scale(row: dict[str, Any]) -> float:
    """The loss scale in force after the last step: the policy's next scale, or 1 once a schedule has
    switched back to float32 (losses are not scaled any more)."""
    return row["next_scale"] if row["precision"] in (None, "float16") else 1.0


def format_table(runs: list[dict[str, Any]]) -> str:
    """The comparison table printed at the end (the same numbers as ``results.json``)."""
    reference = next((r["final_loss"] for r in runs if r["name"] == "fp32"), None)
    header = ["run", "held-out loss", "vs fp32", "skipped", "final scale", "underflow mean/peak", "seconds"]
    lines = []
    for r in runs:
        vs = f"{100 * (r['final_loss'] / reference - 1):+.1f}%" if reference and r["final_loss"] else "-"
        under = f"{100 * r['underflow']:.1f}% / {100 * r['underflow_peak']:.1f}%" if r["underflow"] is not None else "-"
        lines.append([r["name"], f"{r['final_loss']:.4f}", vs, str(r["skipped_steps"]), power_text(r["final_scale"]),
                      under, f"{r['seconds']:.1f}"])
    widths = [max(len(row[i]) for row in [header] + lines) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule] + [fmt(row) for row in lines])


def verdict(runs: list[dict[str, Any]]) -> str:
    """The float16 runs against float32 in a few words, e.g. ``fp16-noscale +6.1% vs fp32 (underflow 3.2%);
    fp16-dynamic +0.2% (7 skipped); `` (empty without an fp32 run)."""
    reference = next((r["final_loss"] for r in runs if r["name"] == "fp32"), None)
    if not reference:
        return ""
    parts = []
    for r in runs:
        if r["name"] != "fp32" and r["name"].startswith("fp16"):
            detail = (f"underflow {100 * r['underflow']:.1f}%" if r["name"] == "fp16-noscale"
                      else f"{r['skipped_steps']} skipped")
            parts.append(f"{r['name']} {100 * (r['final_loss'] / reference - 1):+.1f}% vs fp32 ({detail}); ")
    return "".join(parts)


def write_results(path: str, cfg: DemoConfig, runs: list[dict[str, Any]], world_size: int, corpus: Any,
                  host: dict[str, Any]) -> None:
    """``results.json``: ``{"config", "machine", "underflow_definition", "runs": [...]}`` (written atomically);
    ``machine`` is :func:`lossscale.demo.machine.machine`'s record plus jobs and wall seconds."""
    payload = {
        "config": cfg.as_dict() | {"world_size": world_size, "description": cfg.describe(world_size)},
        "machine": host,
        "corpus": {"train_characters": len(corpus.train), "heldout_characters": len(corpus.heldout),
                   "train_files": [os.path.basename(f) for f in corpus.train_files],
                   "heldout_files": [os.path.basename(f) for f in corpus.heldout_files]},
        "final_loss": "mean cross-entropy in nats per character on the held-out files, computed in float32",
        "underflow_definition": UNDERFLOW_DEFINITION,
        "runs": runs,
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
