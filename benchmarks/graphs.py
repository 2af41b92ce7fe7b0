"""A step replayed from a CUDA graph against the same step run eagerly, on the many-small-tensors layout (CUDA only).

2,000 tensors of 20,000 values (40M), fused AdamW built with ``capturable=True``, global-norm clipping. Each
contender's step is captured once (after warm-up on a side stream, torch's recipe) and replayed; the gradients are
restored into the same tensors before every timed call (outside the timing), and every call is bracketed by
``torch.cuda.synchronize()``. Contenders, alternating in every round, all over one shared optimizer:

- ``bare``: ``optimizer.step()``, eager and replayed;
- ``torch``: torch.amp.GradScaler's pipeline (``unscale_``, ``clip_grad_norm_``, ``step``, ``update``), eager and
  replayed;
- ``GS``: lossscale.GradScaler driven the same way, eager and replayed;
- ``LSO``: ``LossScaleOptimizer(clip_grad_norm=1.0)``.step(), eager and replayed;
- ``LSO flat``: the same with ``flat_grads=True``, one wrapper for its eager step and its graph (the gradients are
  views of its buffer for every contender).

Reported: ms per step and each over the bare eager step, and the replayed step over its own eager one.

    python benchmarks/graphs.py --device cuda
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
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
    summarize,
    synchronizer,
    table,
)
from lossscale import DynamicScale, GradScaler, LossScaleOptimizer

SCALE = 2.0**16
WARM_UP = 3


def _pipeline(kind: type, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], device: str) -> Callable:
    scaler = kind(device, init_scale=SCALE, growth_interval=10**9)
    scaler.scale(torch.ones((), device=device))

    def run() -> None:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(optimizer)
        scaler.update()

    return run


def replayed(step: Callable[[], object], restore: Callable[[str], None]) -> Callable[[], None]:
    """``step`` captured in a CUDA graph (after WARM_UP eager calls on a side stream); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARM_UP):
            restore("")
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    restore("")
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def contenders(params: list[torch.nn.Parameter], restore: Callable[[str], None], device: str) -> dict:
    """Eager and replayed steps; each front end's graph over its own scaler or wrapper, one shared optimizer."""
    shared = torch.optim.AdamW(params, lr=1e-9, fused=True, capturable=True)
    flat = LossScaleOptimizer(
        shared, policy=DynamicScale(init_scale=SCALE, growth_interval=10**9), clip_grad_norm=1.0, flat_grads=True
    )

    def lso() -> Callable[[], object]:
        return LossScaleOptimizer(
            shared, policy=DynamicScale(init_scale=SCALE, growth_interval=10**9), clip_grad_norm=1.0
        ).step

    def fresh(name: str) -> Callable[[], object]:
        if name == "bare":
            return shared.step
        if name == "LSO":
            return lso()
        if name == "LSO flat":
            return flat.step
        return _pipeline(torch.amp.GradScaler if name == "torch" else GradScaler, shared, params, device)

    fns = {f"{name} eager": fresh(name) for name in NAMES}
    fns.update({f"{name} graph": replayed(fresh(name), restore) for name in NAMES})
    return fns


NAMES = ("bare", "torch", "GS", "LSO", "LSO flat")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--size", type=int, default=20_000, help="values per tensor")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--tiny", action="store_true", help="50 tensors of 200 values, 2 rounds")
    parser.add_argument("--json", default=None)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    if torch.device(device).type != "cuda":
        parser.error(f"argument --device: graphs.py captures CUDA graphs and needs a CUDA device; got {device!r}")
    tensors, size, rounds = (50, 200, 2) if args.tiny else (args.tensors, args.size, args.rounds)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(size, device=device) * 0.02) for _ in range(tensors)]
    restore = grad_restorer(params, [torch.randn_like(p) * 1e-3 * SCALE for p in params])
    restore("")
    fns = contenders(params, restore, device)
    t = summarize(alternate_samples(fns, rounds, setup=restore, sync=synchronizer(device)))
    rows = []
    for name in NAMES:
        eager, graph = t[f"{name} eager"], t[f"{name} graph"]
        rows.append(
            {
                "step": name,
                "eager ms": eager * 1e3,
                "graph ms": graph * 1e3,
                "eager / bare eager": eager / t["bare eager"],
                "graph / bare eager": graph / t["bare eager"],
                "graph / eager": graph / eager,
            }
        )
    md = (
        f"Device: {device}. {tensors} float32 tensors of {size} values, fused AdamW (capturable=True), "
        f"global-norm clip 1.0; medians over {rounds} alternating rounds, every call bracketed by "
        f"torch.cuda.synchronize(), the gradients restored before each call (outside the timing). bare = the "
        f"optimizer step alone, torch = torch.amp.GradScaler + clip_grad_norm_, GS = lossscale.GradScaler driven "
        f"the same way, LSO = LossScaleOptimizer(clip_grad_norm=1.0), LSO flat = the same with flat_grads=True.\n\n"
        + table(rows, ["step", "eager ms", "graph ms", "eager / bare eager", "graph / bare eager", "graph / eager"])
    )
    payload = {"machine": machine(device), "rows": rows, "markdown": md}
    emit("graphs", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
