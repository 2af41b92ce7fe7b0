"""Host reads per training step (counted, not timed): ``aten._local_scalar_dense`` calls, the op behind
``.item()``/``bool(tensor)``; on a GPU each one waits for the device.

Counts the reads of the loss-scaling calls only (scale/unscale_/step/update, or LossScaleOptimizer.step),
minus the reads the bare optimizer makes by itself (CPU Adam reads its step counters), averaged over
clean and overflowing steps.

    python benchmarks/host_reads.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine, table  # noqa: E402

import lossscale  # noqa: E402
from lossscale import HostReadCounter, LossScaleOptimizer  # noqa: E402

OPTIMIZERS = {
    "fused AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "foreach Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
}
PATTERN = [False, False, True, False, True, True, False, False]


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def bare_reads(opt_name: str) -> float:
    m = model()
    opt = OPTIMIZERS[opt_name](m.parameters())
    counts = []
    for _ in range(4):
        m(torch.ones(2, 16)).sum().backward()
        with HostReadCounter() as r:
            opt.step()
        counts.append(r.count)
    return counts[-1]


def scaler_reads(scaler_cls, opt_name: str) -> tuple[float, float]:
    m = model()
    opt = OPTIMIZERS[opt_name](m.parameters())
    scaler = scaler_cls("cpu") if scaler_cls is torch.amp.GradScaler else scaler_cls()
    bare = bare_reads(opt_name)
    total = added = 0
    for inf in PATTERN:
        opt.zero_grad()
        with HostReadCounter() as r:
            loss = scaler.scale(m(torch.ones(2, 16)).sum())
        loss.backward()
        if inf:
            m[0].weight.grad[0, 0] = float("inf")
        with HostReadCounter() as r2:
            scaler.step(opt)
            scaler.update()
        stepped_inner = not inf or getattr(opt, "_step_supports_amp_scaling", False)
        reads = r.count + r2.count
        total += reads
        added += reads - (bare if stepped_inner else 0)
    return total / len(PATTERN), added / len(PATTERN)


def wrapper_reads(opt_name: str, skip_mode: str, clip: bool) -> tuple[float, float] | None:
    m = model()
    try:
        opt = LossScaleOptimizer(OPTIMIZERS[opt_name](m.parameters()), skip_mode=skip_mode,
                                 clip_grad_norm=1.0 if clip else None)
    except ValueError:
        return None
    bare = bare_reads(opt_name)
    total = added = 0
    counted = 0
    for i, inf in enumerate([False] + PATTERN):
        opt.zero_grad()
        opt.backward(m(torch.ones(2, 16)).sum())
        if inf:
            m[0].weight.grad[0, 0] = float("inf")
        with HostReadCounter() as r:
            opt.step()
        if i == 0:
            continue  # masked mode decides the very first step (which creates optimizer state) on the host
        inner_called = not (inf and opt.skip_mode == "host")
        total += r.count
        added += r.count - (bare if inner_called else 0)
        counted += 1
    return total / counted, added / counted


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="(same sizes; accepted for symmetry)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    for opt_name in OPTIMIZERS:
        for label, cls in [("torch.amp.GradScaler", torch.amp.GradScaler), ("lossscale.GradScaler", lossscale.GradScaler)]:
            total, added = scaler_reads(cls, opt_name)
            rows.append({"optimizer": opt_name, "loss scaling": label, "skip mode": "(torch's)",
                         "reads per step": total, "added by loss scaling": added})
        for skip_mode in ("fused", "host", "masked"):
            for clip in (False, True):
                got = wrapper_reads(opt_name, skip_mode, clip)
                if got is None:
                    continue
                rows.append({"optimizer": opt_name, "loss scaling": "LossScaleOptimizer" + (" + clip" if clip else ""),
                             "skip mode": skip_mode, "reads per step": got[0], "added by loss scaling": got[1]})
    md = table(rows, ["optimizer", "loss scaling", "skip mode", "reads per step", "added by loss scaling"])
    payload = {"machine": machine(), "rows": rows, "markdown": md}
    emit("host_reads", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
