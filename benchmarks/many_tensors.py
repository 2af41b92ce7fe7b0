"""Many small tensors: one optimizer step over 2,000 tensors of 20,000 values (40M), where the host's work per tensor
rather than the memory traffic sets the time (on a GPU above all).

Every contender steps one shared optimizer over the same parameters, the gradients restored before each timed call
(outside the timing), alternating in every round:

- ``bare``: ``optimizer.step()`` alone;
- ``torch``: torch.amp.GradScaler's pipeline (``unscale_`` + ``clip_grad_norm_`` where clipped, ``step``, ``update``);
- ``GS``: lossscale.GradScaler driven exactly as torch's;
- ``LSO``: ``LossScaleOptimizer(..., clip_grad_norm=)``.step() with torch's rule;
- ``LSO flat``: the same with ``flat_grads=True`` (every gradient a view of one buffer: the step's passes are one
  kernel over it). Built first, so every contender steps over the same gradient views.

Reported: ms per step, each over the bare step, LSO and GS over torch's (the median of per-round ratios with its 95%
interval), and the host ops of one step (aten ops outside torch's multi-tensor kernels, ``_host_ops.py``): how many,
and how many more per extra tensor (counted at this size and at a tenth of it).

    python benchmarks/many_tensors.py                      # 2,000 x 20,000
    python benchmarks/many_tensors.py --device cuda
    python benchmarks/many_tensors.py --tensors 500 --size 5000 --rounds 11
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    add_device_argument,
    alternate_samples,
    checked_device,
    emit,
    grad_restorer,
    machine,
    paired_ratio,
    summarize,
    synchronizer,
    table,
)
from _host_ops import growth_per_tensor, host_ops
from lossscale import DynamicScale, GradScaler, LossScaleOptimizer

SCALE = 2.0**16
OPTIMIZERS = {
    "fused AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-9, fused=True),
    "foreach Adam": lambda ps: torch.optim.Adam(ps, lr=1e-9, foreach=True),
}
#: (optimizer, clip) per row
ROWS = [("fused AdamW", True), ("fused AdamW", False), ("foreach Adam", True)]


def contenders(params: list[torch.nn.Parameter], opt_name: str, clip: bool) -> dict:
    """The timed callables over one shared optimizer."""
    device = str(params[0].device)
    shared = OPTIMIZERS[opt_name](params)
    flat = LossScaleOptimizer(
        shared,
        policy=DynamicScale(init_scale=SCALE, growth_interval=10**9),
        clip_grad_norm=1.0 if clip else None,
        flat_grads=True,
    )

    def scaler_of(kind: type):
        scaler = kind(device, init_scale=SCALE, growth_interval=10**9)
        scaler.scale(torch.ones((), device=device))

        def run() -> None:
            if clip:
                scaler.unscale_(shared)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(shared)
            scaler.update()

        return run

    lso = LossScaleOptimizer(
        shared, policy=DynamicScale(init_scale=SCALE, growth_interval=10**9), clip_grad_norm=1.0 if clip else None
    )
    return {
        "bare": shared.step,
        "torch": scaler_of(torch.amp.GradScaler),
        "GS": scaler_of(GradScaler),
        "LSO": lso.step,
        "LSO flat": flat.step,
    }


def _layout(tensors: int, size: int, device: str) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(size, device=device) * 0.02) for _ in range(tensors)]
    return params, [torch.randn_like(p) * 1e-3 * SCALE for p in params]


def counted_ops(tensors: int, size: int, opt_name: str, clip: bool, device: str) -> dict[str, dict]:
    """Host ops of one steady step per contender: ``{name: {"ops": count, "per tensor": growth}}``."""
    counts = {}
    for n in (max(2, tensors // 10), tensors):
        params, grads = _layout(n, size, device)
        restore = grad_restorer(params, grads)
        fns = contenders(params, opt_name, clip)
        for name, fn in fns.items():
            for _ in range(2):  # the first step creates the optimizer state
                restore(name)
                fn()
            restore(name)
            counts.setdefault(name, []).append(host_ops(fn))
    small = max(2, tensors // 10)
    return {
        name: {"ops": sum(large.values()), "per tensor": sum(growth_per_tensor(few, large, small, tensors).values())}
        for name, (few, large) in counts.items()
    }


def measure(tensors: int, size: int, opt_name: str, clip: bool, rounds: int, device: str) -> dict:
    params, grads = _layout(tensors, size, device)
    restore = grad_restorer(params, grads)
    restore("")
    samples = alternate_samples(contenders(params, opt_name, clip), rounds, setup=restore, sync=synchronizer(device))
    t = summarize(samples)
    row = {"layout": f"{tensors} x {size}", "optimizer": opt_name, "clip": "global norm" if clip else "none"}
    for name in NAMES:
        row[f"{name} ms"] = t[name] * 1e3
    for name in NAMES[1:]:
        row[f"{name} / bare"] = t[name] / t["bare"]
    for name in NAMES[2:]:
        ratio, low, high = paired_ratio(samples, name, "torch")
        row[f"{name} / torch"] = ratio
        row[f"{name} / torch 95% CI"] = f"{low:.3f}-{high:.3f}"
    del params, grads
    for name, ops in counted_ops(tensors, size, opt_name, clip, device).items():
        row[f"{name} host ops"] = ops["ops"]
        row[f"{name} ops per tensor"] = ops["per tensor"]
    return row


NAMES = ("bare", "torch", "GS", "LSO", "LSO flat")
COLUMNS = (
    ["layout", "optimizer", "clip"]
    + [f"{n} ms" for n in NAMES]
    + [f"{n} / bare" for n in NAMES[1:]]
    + [f"{n} / torch{ci}" for n in NAMES[2:] for ci in ("", " 95% CI")]
    + [f"{n} host ops" for n in NAMES]
    + [f"{n} ops per tensor" for n in NAMES]
)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--size", type=int, default=20_000, help="values per tensor")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--tiny", action="store_true", help="50 tensors of 200 values, 2 rounds (the test suite)")
    parser.add_argument("--json", default=None)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    tensors, size, rounds = (50, 200, 2) if args.tiny else (args.tensors, args.size, args.rounds)
    rows = []
    for opt_name, clip in ROWS:
        rows.append(measure(tensors, size, opt_name, clip, rounds, device))
        print(rows[-1], file=sys.stderr, flush=True)
    md = (
        f"Device: {device}. One step over {tensors} float32 tensors of {size} values; medians over {rounds} "
        f"alternating rounds, the gradients restored before each call (outside the timing); on CUDA each call is "
        f"bracketed by torch.cuda.synchronize(). *x / bare*: time over the bare optimizer step; *x / torch*: the "
        f"median of per-round ratios to torch's pipeline with its 95% interval. *host ops*: aten ops of one step "
        f"outside torch's multi-tensor kernels (counted with the profiler, `_host_ops.py`); *ops per tensor*: how "
        f"many more for each extra tensor (counted at this size and at a tenth of it). torch = torch.amp.GradScaler "
        f"+ clip_grad_norm_, GS = lossscale.GradScaler driven the same way, LSO = LossScaleOptimizer, LSO flat = "
        f"LossScaleOptimizer(flat_grads=True).\n\n" + table(rows, COLUMNS)
    )
    payload = {"machine": machine(device), "rows": rows, "markdown": md}
    emit("many_tensors", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
