"""Per-layer loss scales: what the hooks and the per-unit unscale cost, against one global scale.

The deep network of issue 18 (blocks of Linear, LayerNorm, Tanh under float16 autocast, each block's
backward signal attenuated by 2**-4), alternating in one process:
  * forward + backward with a global scale only, and with ``LayerScales`` hooks (one float32 multiply
    of each unit's output gradient);
  * the step's unscale + overflow check: one foreach multiply and a finite check over all gradients
    (what a global scale needs), against ``LayerScales.unscale_`` + ``update`` (per unit: aminmax,
    multiply, then ~20 ops on [units] tensors).

    python benchmarks/layerwise.py [--width 256] [--blocks 12] [--batch 256] [--tiny] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device_argument, alternate, checked_device, emit, machine, synchronizer, table
from lossscale.layerwise import LayerScales


class _Attenuate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class Attenuate(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Attenuate.apply(x, self.factor)


def deep_net(blocks: int, width: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(blocks):
        mods += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Tanh(), Attenuate(2.0**-4)]
    return torch.nn.Sequential(*mods)


def measure(blocks: int, width: int, batch: int, rounds: int, device: str = "cpu") -> list[dict]:
    plain, hooked = deep_net(blocks, width).to(device), deep_net(blocks, width).to(device)
    layers = LayerScales(hooked)
    x = torch.randn(batch, width, device=device)
    scale = torch.tensor(2.0**16, device=device)
    sync = synchronizer(device)

    def backward(model: torch.nn.Module) -> None:
        for p in model.parameters():
            p.grad = None
        with torch.autocast(torch.device(device).type, dtype=torch.float16):
            out = model(x)
        (out.float().square().mean() * scale).backward()

    for _ in range(3 * blocks):  # calibrate the per-layer factors first
        backward(hooked)
        layers.update(*layers.unscale_(scale), scale)
    backward(plain)
    grads = [p.grad for p in plain.parameters()]
    saved = [g.clone() for g in grads]
    saved_hooked = [p.grad.clone() for p in hooked.parameters()]

    def restore(name: str) -> None:
        for g, s in zip(grads, saved):
            g.copy_(s)
        for p, s in zip(hooked.parameters(), saved_hooked):
            p.grad.copy_(s)

    def global_unscale() -> None:
        found = torch.zeros((), device=device)
        torch._foreach_mul_(grads, scale.reciprocal())
        found += (~torch.isfinite(torch.stack([g.sum() for g in grads]))).any()

    def layer_unscale() -> None:
        layers.update(*layers.unscale_(scale), scale)

    passes = alternate({"global": lambda: backward(plain), "LayerScales": lambda: backward(hooked)}, rounds, sync=sync)
    unscale = alternate({"global": global_unscale, "LayerScales": layer_unscale}, rounds, setup=restore, sync=sync)
    units = len(layers.units)
    return [
        {
            "part": "forward + backward",
            "global ms": passes["global"] * 1e3,
            "LayerScales ms": passes["LayerScales"] * 1e3,
            "ratio": passes["LayerScales"] / passes["global"],
            "units": units,
        },
        {
            "part": "unscale + check (+ update)",
            "global ms": unscale["global"] * 1e3,
            "LayerScales ms": unscale["LayerScales"] * 1e3,
            "ratio": unscale["LayerScales"] / unscale["global"],
            "units": units,
        },
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json", default=None)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    if args.tiny:
        args.width, args.blocks, args.batch, args.rounds = 16, 3, 8, 2
    rows = measure(args.blocks, args.width, args.batch, args.rounds, device)
    md = (
        f"Device: {device}. {args.blocks} blocks of Linear({args.width}, {args.width}), LayerNorm, Tanh under "
        f"float16 autocast, batch {args.batch}; median of {args.rounds} alternating rounds:\n\n"
        + table(rows, list(rows[0]))
    )
    payload = {"machine": machine(device), "rows": rows, "markdown": md}
    emit("layerwise", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
