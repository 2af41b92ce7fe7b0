"""Step overhead: LossScaleOptimizer.step() vs torch's unscale_ + clip_grad_norm_ + step + update vs a bare step.

Every contender works on the same parameters and the same scaled gradients (restored before each
timed call, outside the timing), alternating in every round; medians over rounds. Reported:
total ratio ours / torch, and overhead ratio (ours - bare) / (torch - bare).

    python benchmarks/step_overhead.py                # 10M, 20M, 100M params
    python benchmarks/step_overhead.py --sizes 20 --rounds 15
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternate, emit, grad_restorer, machine, table  # noqa: E402

from lossscale import FixedScale, LossScaleOptimizer  # noqa: E402

SCALE = 2.0**16
OPTIMIZERS = {
    "fused AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-8, fused=True),
    "foreach Adam": lambda ps: torch.optim.Adam(ps, lr=1e-8, foreach=True),
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-8, momentum=0.9, foreach=True),
}


def params_of(total: int, tensors: int = 100) -> list[torch.nn.Parameter]:
    sizes = [total // tensors] * tensors
    sizes[0] += total - sum(sizes)
    return [torch.nn.Parameter(torch.randn(n) * 0.02) for n in sizes]


def measure(total: int, opt_name: str, clip: bool, rounds: int) -> dict:
    torch.manual_seed(0)
    params = params_of(total)
    base = [torch.randn_like(p) * 1e-3 * SCALE for p in params]
    make = OPTIMIZERS[opt_name]
    bare_opt = make(params)
    torch_opt = make(params)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10**9)
    scaler.scale(torch.ones(()))  # initialise its scale tensor, as the backward pass would
    ours = LossScaleOptimizer(make(params), policy=FixedScale(SCALE), clip_grad_norm=1.0 if clip else None)

    restore = grad_restorer(params, base)

    def bare() -> None:
        bare_opt.step()

    def torch_pipeline() -> None:
        scaler.unscale_(torch_opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(torch_opt)
        scaler.update()

    def lossscale_step() -> None:
        ours.step()

    t = alternate({"bare": bare, "torch": torch_pipeline, "lossscale": lossscale_step}, rounds, setup=restore)
    over_torch = t["torch"] - t["bare"]
    return {
        "params": f"{total // 10**6}M", "optimizer": opt_name, "clip": "global norm" if clip else "none",
        "bare ms": t["bare"] * 1e3, "torch ms": t["torch"] * 1e3, "lossscale ms": t["lossscale"] * 1e3,
        "total ratio": t["lossscale"] / t["torch"],
        "overhead ratio": (t["lossscale"] - t["bare"]) / over_torch if over_torch > 0 else float("nan"),
        "skip mode": ours.skip_mode,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,20,100", help="millions of parameters, comma-separated")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--tiny", action="store_true", help="a few thousand parameters (for the test suite)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sizes = [20_000] if args.tiny else [int(float(s) * 10**6) for s in args.sizes.split(",")]
    rows = []
    for total in sizes:
        for opt_name in args.optimizers.split(","):
            for clip in (True, False):
                row = measure(total, opt_name, clip, 2 if args.tiny else args.rounds)
                rows.append(row)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      file=sys.stderr, flush=True)
    cols = ["params", "optimizer", "clip", "skip mode", "bare ms", "torch ms", "lossscale ms", "total ratio",
            "overhead ratio"]
    md = table(rows, cols)
    payload = {"machine": machine(), "rows": rows, "markdown": md}
    emit("step_overhead", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
