"""Where one training step's time goes: torch's scaler against LossScaleOptimizer, op by op (a diagnostic).

The model of ``end_to_end.py`` (the demo's character transformer; its size from the same options) takes float16
autocast steps (forward, backward, optimizer step with fused AdamW) under each contender: torch.amp.GradScaler,
``LossScaleOptimizer`` with ``DynamicScale()``, with ``PredictiveScale()`` (its update replayed from a CUDA graph
on a GPU, and with ``cuda_graph=False``: its ops one by one) and with per-layer scales, one unit per module that
owns parameters (``layerwise=model``) and one per block (``layerwise=[token, position, *blocks, ln, head]``). Each
contender has its own copy of the same model. Printed per contender:

* the median time of a whole step from an idle device, and how much of the optimizer step's call is host time
  (the call returns before its kernels finish on a GPU);
* from ``torch.profiler`` over ``--profiled`` steps: the ops with the most self device time and the most self host
  time, and how many kernels one step launches.

Then the optimizer call alone under the profiler, ``DynamicScale``'s against ``PredictiveScale``'s: the ops whose
self host time per call differs most (what ``PredictiveScale``'s read and update add to the call).

Then the overflow pass alone over gradients of the model's shapes, host time of the call: torch's fused check
(DynamicScale's pass), the multi-tensor inf-norm PredictiveScale reads its amax from without triton, with its
per-tensor results gathered by ``ops.clip.norms`` and reduced (what the step runs then) and by ``torch.stack``, and on
CUDA with triton ``ops.amax_kernel`` (one kernel with one small output: what the step runs there).

No RESULTS.md section: the ratios live in ``end_to_end.py`` and ``language_model.py``; this says why they are what
they are. ``benchmarks/gpu_check.sh`` runs it on a GPU.

    python benchmarks/profile_step.py --device cuda --d-model 512 --layers 6 --heads 8 --context 256 --sequences 32
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device_argument, checked_device, synchronizer
from lossscale import DynamicScale, LossScaleOptimizer, PredictiveScale
from lossscale.demo.train import QUICK, CharTransformer, batch, load_corpus
from lossscale.ops.clip import norms
from lossscale.ops.overflow import amax_kernel_module


def contenders(cfg, device: str) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """name -> (forward and backward, optimizer step), each contender on its own copy of one model."""
    kind = torch.device(device).type
    x, y = (t.to(device) for t in batch(load_corpus(cfg).train, cfg, 0, 0))
    out: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {}

    def model():
        torch.manual_seed(cfg.seed)
        return CharTransformer(cfg).to(device)

    def loss_of(m):
        with torch.autocast(kind, dtype=torch.float16):
            logits = m(x)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(kind)

    def torch_backward(m=m, opt=opt):
        opt.zero_grad()
        scaler.scale(loss_of(m)).backward()

    def torch_step(opt=opt):
        scaler.step(opt)
        scaler.update()

    out["torch.amp.GradScaler"] = (torch_backward, torch_step)
    for name, policy, layerwise in (
        ("LossScaleOptimizer, DynamicScale", DynamicScale(), None),
        ("LossScaleOptimizer, PredictiveScale", PredictiveScale(), None),
        ("LossScaleOptimizer, PredictiveScale op by op", PredictiveScale(cuda_graph=False), None),
        ("LossScaleOptimizer, per-layer", DynamicScale(), "model"),
        ("LossScaleOptimizer, per-block", DynamicScale(), "blocks"),
    ):
        m = model()
        units = {"model": m, "blocks": [m.token, m.position, *m.blocks, m.ln, m.head]}.get(layerwise)
        lso = LossScaleOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True), policy=policy, layerwise=units)

        def backward(m=m, lso=lso):
            lso.zero_grad()
            lso.backward(loss_of(m))

        out[name] = (backward, lso.step)
    return out


def measure(
    calls: dict[str, tuple[Callable[[], None], Callable[[], None]]], rounds: int, device: str
) -> dict[str, tuple[float, float, float]]:
    """name -> (median ms of a whole step, median ms of the optimizer step, median host ms of its call)."""
    sync = synchronizer(device)
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds + 1):  # the first round warms up
        for name in names[r % len(names) :] + names[: r % len(names)]:
            backward, step = calls[name]
            sync()
            start = time.perf_counter()
            backward()
            sync()
            stepping = time.perf_counter()
            step()
            returned = time.perf_counter()
            sync()
            done = time.perf_counter()
            if r:
                samples[name].append((done - start, done - stepping, returned - stepping))
    return {
        name: tuple(1e3 * statistics.median(s[i] for s in rows) for i in range(3))  # type: ignore[misc]
        for name, rows in samples.items()
    }


def profiled(backward: Callable[[], None], step: Callable[[], None], steps: int, device: str, top: int) -> str:
    """The profiler's tables (self device time, self host time) and kernels per step, as text."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    sync = synchronizer(device)
    sync()
    with profile(activities=activities, acc_events=True) as prof:
        for _ in range(steps):
            backward()
            step()
        sync()
    averages = prof.key_averages()
    parts = []
    if ProfilerActivity.CUDA in activities:
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        parts.append(f"kernels per step: {kernels / steps:.0f}")
        parts.append(averages.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=60))
    parts.append(averages.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    return "\n".join(parts)


def call_ops(
    backward: Callable[[], None], step: Callable[[], None], steps: int, device: str
) -> dict[str, tuple[float, float]]:
    """op -> (calls, self host µs) per optimizer call, with only the call under the profiler (the backward and the
    device's work before it outside)."""
    sync = synchronizer(device)
    totals: dict[str, list[float]] = {}
    for _ in range(steps):
        backward()
        sync()
        with profile(activities=[ProfilerActivity.CPU], acc_events=True) as prof:
            step()
        for event in prof.key_averages():
            row = totals.setdefault(event.key, [0.0, 0.0])
            row[0] += event.count
            row[1] += event.self_cpu_time_total
        sync()
    return {op: (calls / steps, us / steps) for op, (calls, us) in totals.items()}


def compared_calls(ops: dict[str, dict[str, tuple[float, float]]], base: str, other: str, top: int) -> str:
    """A markdown table of the ops whose self host time per optimizer call differs most between two contenders
    (``other`` minus ``base``), with both totals."""
    a, b = ops[base], ops[other]
    rows = sorted(set(a) | set(b), key=lambda op: b.get(op, (0, 0))[1] - a.get(op, (0, 0))[1], reverse=True)
    short_a, short_b = base.split(", ")[-1], other.split(", ")[-1]
    lines = [
        f"| op | calls, {short_a} | µs, {short_a} | calls, {short_b} | µs, {short_b} | µs more |",
        "|---|---|---|---|---|---|",
    ]
    totals = {name: tuple(sum(v[i] for v in x.values()) for i in (0, 1)) for name, x in (("a", a), ("b", b))}
    rows_of = [(op, a.get(op, (0, 0.0)), b.get(op, (0, 0.0))) for op in rows[:top]]
    for op, (ca, ta), (cb, tb) in rows_of + [("all ops", totals["a"], totals["b"])]:
        lines.append(f"| {op} | {ca:.0f} | {ta:.0f} | {cb:.0f} | {tb:.0f} | {tb - ta:+.0f} |")
    return "\n".join(lines)


def overflow_passes(cfg, device: str, rounds: int) -> tuple[int, dict[str, float]]:
    """(how many gradients, pass -> median host ms of its call) over gradients of the model's shapes (the device
    idle before each call)."""
    torch.manual_seed(cfg.seed)
    grads = [torch.randn_like(p) for p in CharTransformer(cfg).to(device).parameters()]
    found, one = torch.zeros((), device=device), torch.ones((), device=device)
    inf = float("inf")
    passes = {
        "fused overflow check (DynamicScale)": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            grads, found, one
        ),
        "inf-norm alone": lambda: torch._foreach_norm(grads, ord=inf),
        "ops.clip.norms(inf) + max (PredictiveScale without triton)": lambda: norms(grads, inf).max(),
        "inf-norm + torch.stack + max": lambda: torch.stack(torch._foreach_norm(grads, ord=inf)).max(),
    }
    kernel = amax_kernel_module() if torch.device(device).type == "cuda" else None
    if kernel is not None:
        passes["ops.amax_kernel, one Triton kernel (PredictiveScale with triton)"] = lambda: kernel.amax(grads)
    sync = synchronizer(device)
    samples: dict[str, list[float]] = {name: [] for name in passes}
    for r in range(rounds + 1):  # the first round warms up (and makes the kept buffer)
        for name, call in passes.items():
            sync()
            start = time.perf_counter()
            call()
            if r:
                samples[name].append(time.perf_counter() - start)
    sync()
    return len(grads), {name: 1e3 * statistics.median(s) for name, s in samples.items()}


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profiled", type=int, default=3, help="steps under the profiler per contender")
    parser.add_argument("--top", type=int, default=12, help="rows per profiler table")
    parser.add_argument("--tiny", action="store_true")
    size = parser.add_argument_group("the model (default: the demo's --quick one)")
    for name in ("d-model", "layers", "heads", "context", "sequences"):
        size.add_argument(f"--{name}", type=int, default=None)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    cfg = dataclasses.replace(QUICK, files=4, sequences=4, context=16) if args.tiny else QUICK
    sizes = {k: getattr(args, k) for k in ("d_model", "layers", "heads", "context", "sequences")}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in sizes.items() if v is not None})
    if args.tiny:
        args.rounds, args.profiled, args.top = 2, 1, 5
    calls = contenders(cfg, device)
    times = measure(calls, args.rounds, device)
    print(
        f"Device {device} ({torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu'}), torch "
        f"{torch.__version__}; model {cfg.layers} layers, d_model {cfg.d_model}, batch {cfg.sequences} x "
        f"{cfg.context}; medians over {args.rounds} rounds, each call from an idle device.\n"
    )
    print("| contender | step ms | optimizer step ms | host ms of the optimizer step's call |\n|---|---|---|---|")
    for name, (whole, step, host) in times.items():
        print(f"| {name} | {whole:.3f} | {step:.3f} | {host:.3f} |")
    for name, (backward, step) in calls.items():
        print(f"\n== {name}, {args.profiled} step(s) under the profiler\n")
        print(profiled(backward, step, args.profiled, device, args.top))
    base, other = "LossScaleOptimizer, DynamicScale", "LossScaleOptimizer, PredictiveScale"
    ops = {name: call_ops(*calls[name], 2 * args.profiled, device) for name in (base, other)}
    print(
        f"\n== The optimizer call alone under the profiler ({2 * args.profiled} calls each): the ops whose self host "
        f"time per call differs most, {other.split(', ')[1]} over {base.split(', ')[1]} (the profiler's own cost "
        f"inflates every op alike)\n"
    )
    print(compared_calls(ops, base, other, args.top))
    count, passes = overflow_passes(cfg, device, 5 * args.rounds)
    print(
        f"\n== The overflow pass alone over {count} gradients of the model's shapes: host ms of the call, median "
        f"over {5 * args.rounds} calls\n\n| pass | host ms |\n|---|---|"
    )
    for name, ms in passes.items():
        print(f"| {name} | {ms:.3f} |")
    return times


if __name__ == "__main__":
    main()
