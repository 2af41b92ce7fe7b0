"""PredictiveScale against torch's defaults: skipped steps, underflow, final loss and step time.

Three measurements, all in one process:
  1. Seeded synthetic gradient streams (``_streams.py``: stationary, drifting, heavy-tailed, and the
     hard iid-max case), 20,000 steps each: skipped steps, mean share of gradient values float16
     rounds to zero on applied steps, and the final scale, for torch's rule (advanced by torch's own
     ``_amp_update_scale_``), ``DynamicScale()`` (the same rule in this library) and
     ``PredictiveScale()``; one row per stream and seed.
  2. Step time of LossScaleOptimizer.step() with each policy on the same gradients (fused AdamW),
     alternating: the predictive policy reads the maximum in the pass that already checks overflow.
  3. The demo model (``lossscale demo`` runs fp16-dynamic and fp16-predictive): skipped steps, final
     held-out loss, measured underflow and seconds, when the demo is installed.

    python benchmarks/predictive.py [--seeds 3] [--tiny] [--device cuda]

``--device`` places the step-time measurement (2) and the demo (3); the streams (1) are simulated on the CPU.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _streams as streams
from _common import (
    add_device_argument,
    alternate,
    checked_device,
    emit,
    grad_restorer,
    machine,
    synchronizer,
    table,
)
from lossscale import DynamicScale, LossScaleOptimizer, PredictiveScale


def stream_rows(steps: int, seeds: int) -> list[dict]:
    """One row per (kind, seed): what each rule paid on the same stream."""
    runs = [streams.make_stream(kind, steps, seed) for kind in streams.KINDS for seed in range(seeds)]
    ours = streams.run_policy(PredictiveScale(), runs)
    rows = []
    for s, p in zip(runs, ours):
        t = streams.run_torch_rule(s)
        d = streams.run_policy(DynamicScale(), [s])[0]
        rows.append(
            {
                "stream": s.kind,
                "seed": s.seed,
                "steps": len(s),
                "skipped torch / DynamicScale / predictive": f"{t.skipped} / {d.skipped} / {p.skipped}",
                "skip ratio torch / predictive": round(t.skipped / max(p.skipped, 1), 1),
                "underflow torch": f"{t.underflow:.2e}",
                "underflow DynamicScale": f"{d.underflow:.2e}",
                "underflow predictive": f"{p.underflow:.2e}",
                "underflow ratio predictive / torch": round(p.underflow / t.underflow, 2),
                "final scale torch / predictive": f"2**{_log2(t.final_scale)} / 2**{_log2(p.final_scale)}",
            }
        )
    return rows


def _log2(x: float) -> int:
    return int(math.log2(x))


def step_time(total: int, rounds: int, device: str = "cpu") -> dict[str, float]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(total // 100, device=device) * 0.02) for _ in range(100)]
    base = [torch.randn_like(p) * 1e-3 * 2**16 for p in params]
    opts = {
        "DynamicScale": LossScaleOptimizer(torch.optim.AdamW(params, lr=1e-9, fused=True), policy=DynamicScale()),
        "PredictiveScale": LossScaleOptimizer(torch.optim.AdamW(params, lr=1e-9, fused=True), policy=PredictiveScale()),
    }

    restore = grad_restorer(params, base)

    return alternate({name: opt.step for name, opt in opts.items()}, rounds, setup=restore, sync=synchronizer(device))


def demo_comparison(steps: int | None, quick: bool, device: str = "cpu") -> list[dict]:
    try:
        from lossscale.demo.cli import main as demo_main
        from lossscale.demo.train import RUNS
    except ImportError:
        return []
    if "fp16-predictive" not in RUNS:
        return []
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        argv = ["--runs", "fp16-dynamic,fp16-predictive", "--out", out, "--device", device]
        if quick:
            argv.append("--quick")
        if steps is not None:
            argv += ["--steps", str(steps)]
        if demo_main(argv) != 0:
            return []
        with open(Path(out) / "results.json") as f:
            runs = json.load(f)["runs"]
    return [
        {k: r.get(k) for k in ("name", "heldout_loss", "skipped_steps", "final_scale", "underflow", "seconds")}
        for r in runs
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stream-steps", type=int, default=20_000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--millions", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--demo-steps", type=int, default=20, help="steps of the demo's --quick run (default 20)")
    parser.add_argument("--full-demo", action="store_true", help="the demo's default run instead of --quick")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json", default=None)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    rows = stream_rows(2_000 if args.tiny else args.stream_steps, 1 if args.tiny else args.seeds)
    t = step_time(20_000 if args.tiny else int(args.millions * 10**6), 2 if args.tiny else args.rounds, device)
    timing = [
        {"policy": k, "LossScaleOptimizer.step ms": v * 1e3, "ratio to DynamicScale": v / t["DynamicScale"]}
        for k, v in t.items()
    ]
    demo = [] if args.tiny else demo_comparison(args.demo_steps, quick=not args.full_demo, device=device)

    md = (
        "Seeded synthetic streams (`benchmarks/_streams.py`: a step overflows when its max |g| x scale >= 65504; "
        "underflow = mean share of gradient values float16 rounds to zero on applied steps; torch's rule is "
        "advanced by `torch._amp_update_scale_`). iid-max is the hard case: step maxima with no structure "
        "to forecast.\n\n"
        + table(rows, list(rows[0]))
        + "\n\n"
        + f"Step time on {('20k' if args.tiny else f'{args.millions:g}M')} float32 parameters, fused AdamW, on "
        f"{device}:\n\n" + table(timing, list(timing[0]))
    )
    if demo:
        quick = "" if args.full_demo else " --quick"
        md += (
            "\n\nThe demo model (`lossscale demo --runs fp16-dynamic,fp16-predictive"
            f"{quick} --steps {args.demo_steps}`; fp16-dynamic is DynamicScale(init_scale=2**32, "
            "growth_interval=20), fp16-predictive PredictiveScale(init_scale=2**32)):\n\n"
        )
        md += table(demo, list(demo[0]))
    payload = {"machine": machine(device), "rows": rows, "timing": timing, "demo": demo, "markdown": md}
    emit("predictive", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
