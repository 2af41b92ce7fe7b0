"""Shared by the benchmark scripts: machine description, the --device option, alternating timers, medians, tables.

On a CUDA device kernels run asynchronously: every timed call is bracketed by ``torch.cuda.synchronize()`` (the
``sync`` of :func:`alternate_samples`, from :func:`synchronizer`), so a time is the call's and its kernels'.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch


def machine(device: str = "cpu") -> dict:
    """What the numbers were measured on; on a CUDA ``device``, also the GPU's name and the CUDA version."""
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
    described = {
        "cpu": cpu,
        "cpu_flags": flags,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    if torch.device(device).type == "cuda":
        described.update(device=device, gpu=torch.cuda.get_device_name(device), cuda_version=torch.version.cuda)
    return described


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device`` (default cpu): where the benchmark's tensors live and its steps run."""
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device, e.g. cuda (default: cpu); on CUDA every timed "
        "call is bracketed by torch.cuda.synchronize()",
    )


def checked_device(parser: argparse.ArgumentParser, device: str) -> str:
    """``device`` if torch can place a tensor there, else the parser's error (one line, exit status 2)."""
    try:
        torch.empty(0, device=device)
    except Exception as err:  # RuntimeError, or AssertionError from a build without that device
        parser.error(f"argument --device: {device!r} is not usable here ({str(err).splitlines()[0]})")
    return device


def synchronizer(device: str) -> Callable[[], None]:
    """What to call before and after a timed call: ``torch.cuda.synchronize`` on a CUDA device, else nothing."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def alternate_samples(
    contenders: dict[str, Callable[[], None]],
    rounds: int,
    setup: Callable[[str], None] | None = None,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """Seconds of every call, per contender: each round runs every contender once (same process, same
    tensors), starting one place later each round, so no contender always follows the same neighbour; the
    first round warms up and is dropped. ``samples[name][r]`` of two contenders come from the same round."""
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if setup is not None:
                setup(name)
            sync()
            start = time.perf_counter()
            contenders[name]()
            sync()
            if r:
                times[name].append(time.perf_counter() - start)
    return times


def alternate(
    contenders: dict[str, Callable[[], None]],
    rounds: int,
    setup: Callable[[str], None] | None = None,
    sync: Callable[[], None] = lambda: None,
    stat: str = "median",
) -> dict[str, float]:
    """Seconds per call of each contender (:func:`alternate_samples`): the median over rounds, or with
    ``stat="min"`` the fastest round (robust on a machine shared with other work, where slow rounds measure
    the neighbours)."""
    return summarize(alternate_samples(contenders, rounds, setup, sync), stat)


def summarize(samples: dict[str, list[float]], stat: str = "median") -> dict[str, float]:
    """Each contender's median over rounds, or its fastest round with ``stat="min"``."""
    pick = min if stat == "min" else statistics.median
    return {name: pick(times) for name, times in samples.items()}


def paired_ratio(times: dict[str, list[float]], name: str, reference: str) -> tuple[float, float, float]:
    """(median, low, high) of ``name``'s time over ``reference``'s, round by round: each ratio compares two
    calls made moments apart, so a machine whose speed drifts over the run (a shared VM: up to 2x within the
    hour) moves both alike. (low, high) is a distribution-free 95% confidence interval for the median ratio:
    the order statistics at ranks n/2 -+ 0.98 sqrt(n) (the sign test's normal approximation; at least 25
    rounds for the interval to mean much)."""
    ratios = sorted(a / b for a, b in zip(times[name], times[reference]))
    n, spread = len(ratios), 0.98 * math.sqrt(len(ratios))
    low = max(0, math.floor(n / 2 - spread) - 1)  # 0-based ranks of the sign test's interval
    high = min(n - 1, math.ceil(n / 2 + spread))
    return statistics.median(ratios), ratios[low], ratios[high]


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
