"""End to end: time per training step of the demo model (char transformer on stdlib text) on this machine.

One step = forward + backward + optimizer step for one micro-batch, with LossScaleOptimizer around
fused AdamW in every precision (fp32 and bf16 with a fixed scale of 1, fp16 with dynamic scaling),
against torch.amp.GradScaler for fp16; contenders alternate, medians reported. The two fp16 contenders
share one model and one inner optimizer (so one set of tensors in one place in memory), and their ratio is
the median of per-round ratios with its 95% interval. On a CPU without float16 matrix units this shows what
autocast costs, not what a GPU gains.

    python benchmarks/end_to_end.py --threads 1 --rounds 41
    python benchmarks/end_to_end.py --device cuda --d-model 512 --layers 6 --heads 8 --context 256 --sequences 32
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    add_device_argument,
    alternate_samples,
    checked_device,
    emit,
    machine,
    paired_ratio,
    summarize,
    synchronizer,
    table,
)
from lossscale import DynamicScale, FixedScale, LossScaleOptimizer
from lossscale.demo.train import QUICK, CharTransformer, batch, load_corpus


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", default=None)
    size = parser.add_argument_group("the model (default: the demo's --quick one)")
    for name in ("d-model", "layers", "heads", "context", "sequences"):
        size.add_argument(f"--{name}", type=int, default=None)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    kind = torch.device(device).type
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = dataclasses.replace(QUICK, files=4, sequences=4, context=16) if args.tiny else QUICK
    sizes = {k: getattr(args, k) for k in ("d_model", "layers", "heads", "context", "sequences")}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in sizes.items() if v is not None})
    x, y = (t.to(device) for t in batch(load_corpus(cfg).train, cfg, 0, 0))

    def build():
        torch.manual_seed(cfg.seed)
        return CharTransformer(cfg).to(device)

    setups = {}
    for name, dtype, policy in [
        ("fp32", None, FixedScale(1.0)),
        ("fp16 LossScaleOptimizer", torch.float16, DynamicScale()),
        ("bf16", torch.bfloat16, FixedScale(1.0)),
    ]:
        model = build()
        opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), policy=policy)
        setups[name] = (model, opt, dtype)
    # torch's scaler steps the model and the optimizer LossScaleOptimizer wraps: same tensors, same memory
    torch_model, torch_opt = setups["fp16 LossScaleOptimizer"][0], setups["fp16 LossScaleOptimizer"][1].inner
    scaler = torch.amp.GradScaler(kind)

    def ours(name):
        model, opt, dtype = setups[name]

        def step():
            ctx = torch.autocast(kind, dtype=dtype) if dtype is not None else contextlib.nullcontext()
            with ctx:
                logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            opt.zero_grad()
            opt.backward(loss)
            opt.step()

        return step

    def torch_fp16():
        with torch.autocast(kind, dtype=torch.float16):
            logits = torch_model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        torch_opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(torch_opt)
        scaler.update()

    contenders = {name: ours(name) for name in setups}
    contenders["fp16 torch.amp.GradScaler"] = torch_fp16
    samples = alternate_samples(contenders, 2 if args.tiny else args.rounds, sync=synchronizer(device))
    payload = _report(
        summarize(samples), cfg, paired_ratio(samples, "fp16 LossScaleOptimizer", "fp16 torch.amp.GradScaler"), device
    )
    emit("end_to_end", payload, args.json)
    return payload


def _report(t: dict[str, float], cfg, paired: tuple[float, float, float], device: str) -> dict:
    """Rows and Markdown: time per step, tokens/s, ratios to fp32 and to torch's fp16 step; ``paired``: the
    fp16 LossScaleOptimizer step over torch's, per round (median, 95% interval)."""
    tokens = cfg.sequences * cfg.context
    ref = t["fp16 torch.amp.GradScaler"]
    rows = [
        {"run": k, "ms per step": v * 1e3, "tokens/s": tokens / v, "vs fp32": v / t["fp32"], "vs torch fp16": v / ref}
        for k, v in t.items()
    ]
    md = (
        f"Device: {device}. One micro-batch of {cfg.sequences} x {cfg.context} characters, {cfg.layers} layer(s), "
        f"d_model {cfg.d_model}, {cfg.heads} heads, fused AdamW, torch threads {torch.get_num_threads()}; on CUDA "
        f"each step is bracketed by torch.cuda.synchronize(). The fp16 LossScaleOptimizer step "
        f"over torch's scaler's, per round: {paired[0]:.3f} (95% interval {paired[1]:.3f}-{paired[2]:.3f}).\n\n"
        + table(rows, ["run", "ms per step", "tokens/s", "vs fp32", "vs torch fp16"])
    )
    return {"machine": machine(device), "rows": rows, "paired": list(paired), "markdown": md}


if __name__ == "__main__":
    main()
