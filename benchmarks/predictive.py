"""PredictiveScale against torch's defaults: skipped steps, underflow, final loss and step time.

Three measurements, all in one process:
  1. Synthetic gradient streams (unscaled gradient maximum per step: slow drift, spikes of 2**8,
     long quiet stretches, noisy): a step overflows when its maximum times the scale reaches 65504.
     Counts skipped steps and the mean scale headroom for torch's rule (DynamicScale() = torch
     defaults) and PredictiveScale().
  2. Step time of LossScaleOptimizer.step() with each policy on the same gradients (fused AdamW),
     alternating: the predictive policy reads the maximum in the pass that already checks overflow.
  3. The demo model (``lossscale demo`` runs fp16-dynamic and fp16-predictive): skipped steps, final
     held-out loss, measured underflow and seconds, when the demo is installed.

    python benchmarks/predictive.py
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternate, emit, grad_restorer, machine, table  # noqa: E402

from lossscale import DynamicScale, LossScaleOptimizer, PredictiveScale  # noqa: E402

LIMIT = 65504.0


def streams(n: int, seed: int = 0) -> dict[str, list[float]]:
    rng = random.Random(seed)
    drift = [1e-3 * math.exp(6 * t / n) * rng.uniform(0.7, 1.0) for t in range(n)]
    spikes = [0.3 * rng.uniform(0.7, 1.0) * (2**8 if rng.random() < 0.002 else 1) for _ in range(n)]
    quiet = [(1e-2 if (t // (n // 4)) % 2 == 0 else 1e-5) * rng.uniform(0.8, 1.0) for t in range(n)]
    noisy = [0.05 * math.exp(rng.gauss(0, 0.7)) for _ in range(n)]
    return {"slow drift": drift, "spikes of 2**8": spikes, "quiet stretches": quiet, "log-normal noise": noisy}


def simulate(policy, amaxes: list[float]) -> tuple[int, float]:
    """Skipped steps, and the mean log2 headroom (log2(LIMIT / (amax * scale)); smaller = less underflow)."""
    state = policy.init()
    observes = getattr(policy, "observes_amax", False)
    skipped, headroom = 0, 0.0
    for a in amaxes:
        scale = float(state.scale)
        over = a * scale >= LIMIT
        skipped += over
        if not over:
            headroom += math.log2(LIMIT / (a * scale))
        found = torch.tensor(over)
        state = (policy.update(state, found, amax=torch.tensor(math.inf if over else a * scale)) if observes
                 else policy.update(state, found))
    return skipped, headroom / max(1, len(amaxes) - skipped)


def step_time(total: int, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(total // 100) * 0.02) for _ in range(100)]
    base = [torch.randn_like(p) * 1e-3 * 2**16 for p in params]
    opts = {
        "DynamicScale": LossScaleOptimizer(torch.optim.AdamW(params, lr=1e-9, fused=True), policy=DynamicScale()),
        "PredictiveScale": LossScaleOptimizer(torch.optim.AdamW(params, lr=1e-9, fused=True), policy=PredictiveScale()),
    }

    restore = grad_restorer(params, base)

    return alternate({name: opt.step for name, opt in opts.items()}, rounds, setup=restore)


def demo_comparison(steps: int | None, quick: bool) -> list[dict]:
    try:
        from lossscale.demo import runs as demo_runs
        from lossscale.demo.cli import main as demo_main
    except ImportError:
        return []
    if "fp16-predictive" not in getattr(demo_runs, "RUNS", {}):
        return []
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        argv = ["--runs", "fp16-dynamic,fp16-predictive", "--out", out]
        if quick:
            argv.append("--quick")
        if steps is not None:
            argv += ["--steps", str(steps)]
        if demo_main(argv) != 0:
            return []
        with open(Path(out) / "results.json") as f:
            runs = json.load(f)["runs"]
    return [{k: r.get(k) for k in ("name", "final_loss", "skipped_steps", "final_scale", "underflow", "seconds")}
            for r in runs]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stream-steps", type=int, default=20_000)
    parser.add_argument("--millions", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--demo-steps", type=int, default=None, help="default: the demo's own default run")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    n = 2_000 if args.tiny else args.stream_steps

    rows = []
    for name, amaxes in streams(n).items():
        t_skip, t_head = simulate(DynamicScale(), amaxes)
        p_skip, p_head = simulate(PredictiveScale(), amaxes)
        rows.append({"stream": name, "steps": n, "torch defaults skipped": t_skip, "predictive skipped": p_skip,
                     "torch mean headroom (log2)": t_head, "predictive mean headroom (log2)": p_head})
    t = step_time(20_000 if args.tiny else int(args.millions * 10**6), 2 if args.tiny else args.rounds)
    timing = [{"policy": k, "LossScaleOptimizer.step ms": v * 1e3, "ratio to DynamicScale": v / t["DynamicScale"]}
              for k, v in t.items()]
    demo = [] if args.tiny else demo_comparison(args.demo_steps, quick=False)

    md = ("Synthetic streams (a step overflows when max|g| x scale >= 65504; headroom = log2(65504 / (max|g| x "
          "scale)) on clean steps: more headroom means more of the gradient lost to underflow):\n\n"
          + table(rows, list(rows[0])) + "\n\n"
          + f"Step time on {('20k' if args.tiny else f'{args.millions:g}M')} float32 parameters, fused AdamW:\n\n"
          + table(timing, list(timing[0])))
    if demo:
        md += "\n\nThe demo model (`lossscale demo --runs fp16-dynamic,fp16-predictive`):\n\n" + table(demo, list(demo[0]))
    payload = {"machine": machine(), "rows": rows, "timing": timing, "demo": demo, "markdown": md}
    emit("predictive", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
