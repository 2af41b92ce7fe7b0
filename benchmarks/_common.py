"""Shared by the benchmark scripts: machine description, alternating timers, medians, tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable

import torch


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        flags = ",".join(x for x in ("avx2", "avx512f", "amx_tile", "avx512_fp16") if f" {x}" in text)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_flags": flags,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def alternate(contenders: dict[str, Callable[[], None]], rounds: int, setup: Callable[[str], None] | None = None,
              sync: Callable[[], None] = lambda: None, stat: str = "median") -> dict[str, float]:
    """Seconds per call of each contender, run in turn in every round (same process, same tensors): the
    median over rounds, or with ``stat="min"`` the fastest round (robust on a machine shared with other
    work, where slow rounds measure the neighbours)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds + 1):
        for name, fn in contenders.items():
            if setup is not None:
                setup(name)
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    pick = min if stat == "min" else statistics.median
    return {name: pick(ts) for name, ts in times.items()}


def grad_restorer(params: list[torch.Tensor], grads: list[torch.Tensor]) -> Callable[[str], None]:
    """A setup hook for :func:`alternate` that puts the same gradients back before every timed call."""

    def restore(_name: str) -> None:
        for p, g in zip(params, grads):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    return restore


def table(rows: list[dict], columns: list[str]) -> str:
    """A Markdown table."""
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        out.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    return "\n".join(out)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def emit(name: str, payload: dict, json_path: str | None) -> None:
    """Print the payload's Markdown and save its JSON (for run_all.py)."""
    print(payload["markdown"])
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"benchmark": name, **payload}, f, indent=1)
