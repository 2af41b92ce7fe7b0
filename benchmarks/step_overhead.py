"""Step overhead of both front ends against torch's scaler, in ratios and in read-pass "floors".

Every contender works on the same parameters, the same scaled gradients (restored before each timed
call, outside the timing) and the same optimizer object (so one optimizer state in one place in memory:
twin LossScaleOptimizers over optimizers of their own differ by up to 3.4% at 1M on a 2-core AVX2 EPYC,
from where their states lie), alternating in every round; medians over rounds. Contenders:

- ``bare``: ``optimizer.step()`` alone;
- ``torch``: torch.amp.GradScaler's pipeline (``unscale_`` + ``clip_grad_norm_`` where clipped, ``step``,
  ``update``);
- ``LSO``: ``LossScaleOptimizer(..., clip_grad_norm=)``.step(), with torch's rule (``DynamicScale``) as
  the scalers have it;
- ``GS``: ``lossscale.GradScaler`` driven exactly as torch's;
- two floors: one read pass over the gradients as a per-tensor ``sum`` and as one ``torch._foreach_norm``.
  The *floor* is the faster of them.

Reported: total ratio (x / torch), overhead ratio ((x - bare) / (torch - bare)), overhead in floors
((x - bare) / floor), and the passes over the gradients beyond the bare step (R = one read of every
gradient, W = one write), counted structurally by a dispatch mode (``_passes.py``), not timed.

    python benchmarks/step_overhead.py    # every optimizer at 20M, two at 1M and 100M; 100 tensors; layouts at 20M
    python benchmarks/step_overhead.py --sizes 20 --rounds 15 --optimizers "fused AdamW"
    python benchmarks/step_overhead.py --device cuda --sizes 1000 --optimizers "fused AdamW,foreach Adam" \
        --scaling-sizes "" --layouts "100 tensors,transformer" --layout-size 350     # 1B in 100 tensors, 350M
"""

from __future__ import annotations

import argparse
import math
import statistics
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
from _passes import count_passes, passes_text
from lossscale import DynamicScale, GradScaler, LossScaleOptimizer

SCALE = 2.0**16
STAT = "median"  # or "min" (--stat)
OPTIMIZERS = {
    "fused AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-8, fused=True),
    "fused Adam": lambda ps: torch.optim.Adam(ps, lr=1e-8, fused=True),
    "fused SGD": lambda ps: torch.optim.SGD(ps, lr=1e-8, momentum=0.9, fused=True),
    "foreach Adam": lambda ps: torch.optim.Adam(ps, lr=1e-8, foreach=True),
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-8, momentum=0.9, foreach=True),
}


def _transformer_shapes(total: int) -> list[tuple[int, ...]]:
    """12 blocks of 16 tensors (layer norms, q/k/v/o, two MLP matrices, all with biases), ~total params."""
    d = max(8, int(math.sqrt(total / 144)))
    block = [
        (d,),
        (d,),
        (d, d),
        (d,),
        (d, d),
        (d,),
        (d, d),
        (d,),
        (d, d),
        (d,),
        (d,),
        (d,),
        (4 * d, d),
        (4 * d,),
        (d, 4 * d),
        (d,),
    ]
    return block * 12


LAYOUTS = {
    "100 tensors": lambda total: [(total // 100,)] * 100,
    "1000 tensors": lambda total: [(total // 1000,)] * 1000,
    "transformer": _transformer_shapes,
}


def params_of(total: int, layout: str, device: str = "cpu") -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(shape, device=device) * 0.02) for shape in LAYOUTS[layout](total)]


def _floors(grads: list[torch.Tensor]) -> dict:
    """The two one-read floors over ``grads``."""
    return {
        "floor sum": lambda: torch.stack([g.sum() for g in grads]),
        "floor norm": lambda: torch._foreach_norm(grads, 2.0),
    }


def _ready(scaler_type, device: str):
    """A scaler of ``scaler_type`` at SCALE that never grows, its scale tensor made on ``device`` as a backward
    would."""
    scaler = scaler_type(device, init_scale=SCALE, growth_interval=10**9)
    scaler.scale(torch.ones((), device=device))
    return scaler


def _lso(opt: torch.optim.Optimizer, clip: bool) -> LossScaleOptimizer:
    """A LossScaleOptimizer with torch's rule at SCALE, never growing (as :func:`_ready`'s scalers)."""
    return LossScaleOptimizer(
        opt, policy=DynamicScale(init_scale=SCALE, growth_interval=10**9), clip_grad_norm=1.0 if clip else None
    )


def contenders(params: list[torch.nn.Parameter], opt_name: str, clip: bool) -> dict:
    """The timed callables, every one stepping one shared optimizer over the shared parameters."""
    make = OPTIMIZERS[opt_name]
    shared = make(params)
    device = str(params[0].device)
    scaler, ours_gs = _ready(torch.amp.GradScaler, device), _ready(GradScaler, device)
    lso = _lso(shared, clip)

    def pipeline(s, opt):
        def run() -> None:
            if clip:
                s.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            s.step(opt)
            s.update()

        return run

    fns = {
        "bare": shared.step,
        "torch": pipeline(scaler, shared),
        "LSO": lso.step,
        "GS": pipeline(ours_gs, shared),
        "_skip_mode": lso.skip_mode,
    }
    if getattr(shared, "_step_supports_amp_scaling", False):
        fns["kernel"] = _kernel_unscaling(shared, device)
    else:
        fns.update(_pipelines_alone(params, make, clip, pipeline))
    return fns


def _pipelines_alone(params: list[torch.nn.Parameter], make, clip: bool, pipeline) -> dict:
    """torch's scaler and LossScaleOptimizer around an optimizer whose ``step()`` does nothing: the scaler's
    own passes and ops, timed without the optimizer step beside them (whose jitter, at 100M with foreach
    Adam about a floor per call here, would swamp a difference of two whole steps). Non-fused optimizers
    only: a fused kernel unscales inside the step."""
    idle = make(params)
    idle.step = lambda *args, **kwargs: None
    device = str(params[0].device)
    return {"torch alone": pipeline(_ready(torch.amp.GradScaler, device), idle), "LSO alone": _lso(idle, clip).step}


def _kernel_unscaling(opt: torch.optim.Optimizer, device: str):
    """The bare fused step handed ``grad_scale`` (1.0) and ``found_inf`` (0): what the kernel's own
    unscaling costs (it divides every gradient and stores it back), a cost no scaler that unscales in
    the kernel can avoid."""
    one, zero = torch.ones((), device=device), torch.zeros((), device=device)

    def run() -> None:
        opt.grad_scale, opt.found_inf = one, zero
        try:
            opt.step()
        finally:
            del opt.grad_scale, opt.found_inf

    return run


def measure(total: int, layout: str, opt_name: str, clip: bool, rounds: int, device: str = "cpu") -> dict:
    torch.manual_seed(0)
    params = params_of(total, layout, device)
    base = [torch.randn_like(p) * 1e-3 * SCALE for p in params]
    restore = grad_restorer(params, base)
    restore("")
    fns = contenders(params, opt_name, clip)
    skip_mode = fns.pop("_skip_mode")
    fns.update(_floors([p.grad for p in params]))
    samples = alternate_samples(fns, rounds, setup=restore, sync=synchronizer(device))
    t = summarize(samples, STAT)
    floor = min(t["floor sum"], t["floor norm"])
    floors = _round_floors(samples)
    n = sum(p.numel() for p in params)
    counts = {}
    for name in ("bare", "torch", "LSO", "GS"):
        restore(name)
        counts[name] = count_passes(params, fns[name])
    row = {
        "params": f"{n / 1e6:.3g}M",
        "layout": layout,
        "optimizer": opt_name,
        "clip": "global norm" if clip else "none",
        "skip mode": skip_mode,
        "floor ms": floor * 1e3,
        "bare ms": t["bare"] * 1e3,
    }
    for name in ("torch", "LSO", "GS"):
        row[f"{name} passes"] = passes_text(counts[name], n, counts["bare"])
        row[f"{name} ops"] = counts[name].calls - counts["bare"].calls
        row[f"{name} ms"] = t[name] * 1e3
        row[f"{name} floors"] = floors(lambda r, name=name: samples[name][r] - samples["bare"][r])
    for name in ("torch", "LSO"):
        row[f"{name} alone floors"] = (
            floors(lambda r, name=name: samples[f"{name} alone"][r]) if f"{name} alone" in samples else "-"
        )
    kernel = samples.get("kernel")
    row["kernel unscale floors"] = floors(lambda r: kernel[r] - samples["bare"][r]) if kernel else "-"
    row["LSO floors net"] = floors(lambda r: samples["LSO"][r] - kernel[r]) if kernel else "-"
    over_torch = t["torch"] - t["bare"]
    for name in ("LSO", "GS"):
        ratio, low, high = paired_ratio(samples, name, "torch")
        row[f"{name} total"] = ratio
        row[f"{name} total 95% CI"] = f"{low:.3f}-{high:.3f}"
        row[f"{name} overhead"] = (t[name] - t["bare"]) / over_torch if over_torch > 0 else float("nan")
    return row


def _round_floors(samples: dict[str, list[float]]):
    """A function of ``extra(r)`` (seconds in round r): the median over rounds of ``extra(r)`` / that round's
    floor (the faster of its two read passes), each time against a floor measured moments apart."""
    rounds = range(len(samples["bare"]))
    floor = [min(samples["floor sum"][r], samples["floor norm"][r]) for r in rounds]

    def in_floors(extra) -> float:
        return statistics.median(extra(r) / floor[r] for r in rounds)

    return in_floors


COLUMNS = [
    "params",
    "layout",
    "optimizer",
    "clip",
    "floor ms",
    "bare ms",
    "torch passes",
    "torch ops",
    "torch ms",
    "torch floors",
    "kernel unscale floors",
    "LSO passes",
    "LSO ops",
    "LSO ms",
    "LSO total",
    "LSO total 95% CI",
    "LSO overhead",
    "torch alone floors",
    "LSO alone floors",
    "LSO floors",
    "LSO floors net",
    "GS passes",
    "GS ops",
    "GS ms",
    "GS total",
    "GS total 95% CI",
    "GS overhead",
    "GS floors",
]


MORE_ROUNDS_BELOW = 20 * 10**6
MAX_ROUND_FACTOR = 10


def rounds_for(total: int, rounds: int) -> int:
    """Rounds for a row of ``total`` parameters: ``rounds`` from 20M up; below, as many more as keep the
    timed work per row about equal (at most 10x), so a 1M row's median is not noisier than a 20M row's."""
    return rounds * max(1, min(MAX_ROUND_FACTOR, MORE_ROUNDS_BELOW // max(total, 1)))


def plan(args: argparse.Namespace) -> list[tuple[int, str, str, bool]]:
    """(total, layout, optimizer, clip) per row: every optimizer at every size in the first layout, then
    fused AdamW in the other layouts at ``--layout-size``."""
    if args.tiny:
        return [(20_000, "100 tensors", o, c) for o in ("fused AdamW", "SGD momentum") for c in (True, False)] + [
            (20_000, "transformer", "fused AdamW", True)
        ]
    sizes = [int(float(s) * 10**6) for s in args.sizes.split(",")]
    layouts = args.layouts.split(",")
    rows = [(s, layouts[0], o, c) for s in sizes for o in args.optimizers.split(",") for c in (True, False)]
    scaling = [int(float(s) * 10**6) for s in args.scaling_sizes.split(",") if s]
    rows += [(s, layouts[0], o, c) for s in scaling for o in args.scaling_optimizers.split(",") for c in (True, False)]
    rows += [
        (int(float(args.layout_size) * 10**6), layout, "fused AdamW", c)
        for layout in layouts[1:]
        for c in (True, False)
    ]
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="20", help="millions of parameters, comma-separated (every optimizer)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--scaling-sizes", default="1,100", help="more sizes, for --scaling-optimizers only")
    parser.add_argument("--scaling-optimizers", default="fused AdamW,SGD momentum")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="the first is used for every size")
    parser.add_argument("--layout-size", default="20", help="millions of parameters for the other layouts")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--stat", default="median", choices=["median", "min"], help="over rounds (min: shared CPUs)")
    parser.add_argument("--tiny", action="store_true", help="a few thousand parameters (for the test suite)")
    parser.add_argument("--json", default=None)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    global STAT
    STAT = args.stat
    rows = []
    for total, layout, opt_name, clip in plan(args):
        row = measure(total, layout, opt_name, clip, 2 if args.tiny else rounds_for(total, args.rounds), device)
        rows.append(row)
        print(
            " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
            file=sys.stderr,
            flush=True,
        )
    md = (
        f"Device: {device}. Times in ms, {STAT}s over {2 if args.tiny else args.rounds} alternating rounds "
        f"({MORE_ROUNDS_BELOW // 10**6}M "
        f"parameters and more; smaller rows get proportionally more, up to {MAX_ROUND_FACTOR}x: 1M rows take a "
        "few ms a step and their fixed cost is what they measure). Every contender steps one shared optimizer "
        "(one optimizer state in one place in memory: twins over optimizers of their own differ by up to 3.4% at "
        "1M), and LSO runs torch's rule (`DynamicScale`, never growing, as the scalers here). "
        "Contenders run in turn in every round, starting one place later each round. *total* = the median "
        "over rounds of time / torch's time in the same round (calls moments apart, so the VM's drift moves "
        "both alike), with its 95% confidence interval (sign test): a row is above torch's where the whole "
        "interval is above 1; *overhead* = (time - bare) / "
        "(torch - bare); *floors* = (time - bare) / floor, per round and "
        "then the median, where the floor is the faster of one per-tensor sum and one `_foreach_norm` over the "
        "gradients in that round; *floor ms* its median. *kernel unscale floors* (fused optimizers): the bare "
        "step handed `grad_scale` = 1, less the bare step, in floors: torch's fused CPU kernel divides every "
        "gradient and stores it back, a write no scaler that unscales in the kernel avoids; *LSO floors net* "
        "= LSO's floors less that. *alone floors* (non-fused optimizers): the scaler's pipeline around an "
        "optimizer whose step does nothing, in floors: its own passes and ops, without the optimizer step's "
        "jitter (which at 100M with foreach Adam is about a floor per call). Passes beyond the bare step, "
        "counted by a dispatch "
        "mode: R = one read of every gradient, W = one write; *ops* = aten calls beyond the bare step (the "
        "fixed cost per step). LSO = LossScaleOptimizer, GS = "
        "lossscale.GradScaler.\n\n" + table(rows, COLUMNS)
    )
    payload = {"machine": machine(device), "rows": rows, "markdown": md}
    emit("step_overhead", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
