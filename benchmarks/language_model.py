"""A small real language model: torch's scaler against LossScaleOptimizer's global, predictive and per-layer scales.

A GPT-2 built from a config (transformers, random init, tied input and output embeddings, no download) learns
the characters of Python's standard-library source (read from disk, as ``lossscale demo`` does) under float16
autocast, with fused AdamW, from the same weights in every run:

  * float32 (the reference for the held-out loss), no scaling;
  * float16, ``torch.amp.GradScaler`` (torch's defaults);
  * float16, ``LossScaleOptimizer`` with ``DynamicScale()`` (torch's rule), ``PredictiveScale()``,
    ``layerwise=model`` (one factor per module that owns parameters, on top of ``DynamicScale()``; the tied
    embeddings share one) and ``layerwise=[wte, wpe, *h, ln_f]`` ("per-block": one factor per block and embedding,
    fewer units and so fewer hooks; the head reads wte's weight outside its unit, which keeps wte at factor 1);
  * the first two again with ``flat_grads=True`` (every gradient a view of one buffer: the step's passes are one
    kernel each, where otherwise the host walks every gradient tensor).

The runs take their steps in lockstep (step k of every run, the order rotating each step), so a machine whose speed
drifts moves them alike; a step's time is forward + backward + optimizer step. Reported per run: held-out loss (a
float32 pass over held-out files), skipped steps, the share of gradient entries a float32 backward pass has nonzero
that the run's own backward left zero (overall, and per layer: embeddings, each block, the final norm), and the step
time over torch's scaler's (median of per-step ratios, with its 95% interval); PredictiveScale's runs also over
DynamicScale's with the same gradients (flat or not). Each training step is timed from an
idle device (synchronised before and after), so the host's time per step counts in full; after training, a
free-running measure times ``--free-steps`` consecutive steps with no synchronisation between them (as a training
loop that reads nothing back runs: the host queues work while the device computes), ``--free-rounds`` rounds with
the order rotating, reported as ms per step and its median ratio to torch's scaler's over the rounds.

    python benchmarks/language_model.py [--steps 150] [--layers 4] [--d-model 128] [--tiny] [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device_argument, checked_device, emit, machine, paired_ratio, synchronizer, table
from lossscale import DynamicScale, LossScaleOptimizer, PredictiveScale
from lossscale.demo.train import VOCAB, Config, batch, load_corpus
from lossscale.layerwise import LayerScales
from lossscale.ops.overflow import amax_kernel_module

RUNS = [
    "float32",
    "torch GradScaler",
    "DynamicScale",
    "PredictiveScale",
    "DynamicScale flat",
    "PredictiveScale flat",
    "per-layer",
    "per-block",
]
REFERENCE = "torch GradScaler"
#: PredictiveScale's runs, each against the DynamicScale run with the same gradients
AGAINST_DYNAMIC = {"PredictiveScale": "DynamicScale", "PredictiveScale flat": "DynamicScale flat"}


def gpt2(args: argparse.Namespace, device: str) -> torch.nn.Module:
    import transformers  # the benchmark's own requirement, not the library's

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=args.context,
        n_embd=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(device)


def layer_of(name: str) -> str:
    """The layer a parameter is reported under: ``wte`` (also the tied head), ``wpe``, ``h.3``, ``ln_f``."""
    parts = name.split(".")
    if parts[0] == "lm_head":
        return "wte"
    return ".".join(parts[1:3]) if parts[1] == "h" else parts[1]


class Run:
    """One contender: a model, its optimizer, and how it takes a step."""

    def __init__(self, name: str, args: argparse.Namespace, device: str) -> None:
        self.name, self.device = name, device
        self.model = gpt2(args, device)
        inner = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        self.dtype = None if name == "float32" else torch.float16
        self.scaler = torch.amp.GradScaler(torch.device(device).type) if name == REFERENCE else None
        self.layers: LayerScales | None = None
        if name in ("float32", REFERENCE):
            self.opt: Any = inner
        else:
            policy = PredictiveScale() if name.startswith("PredictiveScale") else DynamicScale()
            body = self.model.transformer
            units = {"per-layer": self.model, "per-block": [body.wte, body.wpe, *body.h, body.ln_f]}.get(name)
            self.layers = None if units is None else LayerScales(units)
            self.opt = LossScaleOptimizer(
                inner, policy=policy, layerwise=self.layers, flat_grads=name.endswith(" flat")
            )
        self.skipped, self.seconds = 0, []
        self.flushed: dict[str, list[int]] = {}  # layer -> [entries flushed, entries live], summed over measurements
        self.shares: dict[int, float] = {}  # measured step -> share of the live entries this run left zero
        self.last_result: Any = None

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        autocast = (
            torch.autocast(torch.device(self.device).type, dtype=self.dtype)
            if self.dtype is not None
            else contextlib.nullcontext()
        )
        self.opt.zero_grad()
        with autocast:
            logits = self.model(x).logits
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        elif isinstance(self.opt, LossScaleOptimizer):
            self.opt.backward(loss)
        else:
            loss.backward()

    def step(self, count_skips: bool = True) -> None:
        """One optimizer step; ``count_skips`` reads whether it skipped (a host read: on a GPU, a wait for the
        device)."""
        if self.scaler is not None:
            before = self.scaler.get_scale() if count_skips else None
            self.scaler.step(self.opt)
            self.scaler.update()
            if count_skips:
                self.skipped += self.scaler.get_scale() < before
        elif isinstance(self.opt, LossScaleOptimizer):
            self.last_result = self.opt.step()
            if count_skips:
                self.skipped += bool(self.last_result.skipped)
        else:
            self.opt.step()

    def measure_flushed(self, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        """Entries a float32 backward of (x, y) has nonzero that this run's gradients (of the same batch) left zero."""
        names, params = zip(*self.model.named_parameters())
        reference = torch.autograd.grad(
            F.cross_entropy(self.model(x).logits.float().view(-1, VOCAB), y.reshape(-1)), params
        )
        flushed = total = 0
        for name, p, r in zip(names, params, reference):
            live, zero = int((r != 0).sum()), int(((r != 0) & (p.grad == 0)).sum())
            counts = self.flushed.setdefault(layer_of(name), [0, 0])
            counts[0] += zero
            counts[1] += live
            flushed, total = flushed + zero, total + live
        self.shares[step] = flushed / max(total, 1)

    @torch.no_grad()
    def heldout_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return F.cross_entropy(self.model(x).logits.float().view(-1, VOCAB), y.reshape(-1)).item()


def train(args: argparse.Namespace, device: str) -> tuple[dict[str, Run], float]:
    """Every run, ``args.steps`` steps in lockstep; returns the runs and the seconds the whole took."""
    cfg = Config(files=args.files, sequences=args.sequences, context=args.context, seed=0)
    corpus = load_corpus(cfg)
    runs = {name: Run(name, args, device) for name in RUNS}
    measured = {min(k, args.steps - 1) for k in (0, 10, 100)} | {args.steps - 1}
    sync = synchronizer(device)
    began = time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in batch(corpus.train, cfg, step, 0))
        order = RUNS[step % len(RUNS) :] + RUNS[: step % len(RUNS)]
        for name in order:
            run = runs[name]
            sync()
            start = time.perf_counter()
            run.backward(x, y)
            sync()
            elapsed = time.perf_counter() - start
            if step in measured and name != "float32":  # not timed
                run.measure_flushed(x, y, step)
            sync()
            start = time.perf_counter()
            run.step()
            sync()
            run.seconds.append(elapsed + time.perf_counter() - start)
    count = min(args.heldout_sequences, (len(corpus.heldout) - 1) // args.context)
    starts = torch.linspace(0, len(corpus.heldout) - args.context - 1, count).long()
    held = corpus.heldout[starts[:, None] + torch.arange(args.context + 1)].to(device)
    for run in runs.values():
        run.heldout = run.heldout_loss(held[:, :-1], held[:, 1:])
    return runs, time.perf_counter() - began


def free_running(runs: dict[str, Run], args: argparse.Namespace, device: str) -> dict[str, list[float]]:
    """Seconds per step of ``args.free_steps`` consecutive steps without a synchronisation between them, per round:
    nothing is read back (skips are not counted; the training statistics stay as training made them)."""
    cfg = Config(files=args.files, sequences=args.sequences, context=args.context, seed=0)
    corpus = load_corpus(cfg)
    batches = [tuple(t.to(device) for t in batch(corpus.train, cfg, args.steps + k, 0)) for k in range(args.free_steps)]
    sync = synchronizer(device)
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    skipped = {name: run.skipped for name, run in runs.items()}
    for r in range(args.free_rounds + 1):  # the first round warms up
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run = runs[name]
            sync()
            start = time.perf_counter()
            for x, y in batches:
                run.backward(x, y)
                run.step(count_skips=False)
            sync()
            if r:
                times[name].append((time.perf_counter() - start) / len(batches))
    for name, run in runs.items():
        run.skipped = skipped[name]
    return times


def rows_of(runs: dict[str, Run], free: dict[str, list[float]] | None = None) -> tuple[list[dict], list[dict]]:
    """The summary table and the underflow-by-layer table."""
    times = {name: run.seconds for name, run in runs.items()}
    summary, by_layer = [], []
    for name, run in runs.items():
        ratio, low, high = paired_ratio(times, name, REFERENCE)
        row: dict[str, Any] = {
            "run": name,
            "held-out loss": run.heldout,
            "skipped": run.skipped,
            "step ms": 1e3 * sorted(run.seconds)[len(run.seconds) // 2],
            "time / torch's": ratio,
            "95% CI": f"{low:.3f}-{high:.3f}",
        }
        if free:
            free_ratio, free_low, free_high = paired_ratio(free, name, REFERENCE)
            row.update(
                {
                    "free-running ms": 1e3 * sorted(free[name])[len(free[name]) // 2],
                    "free-running / torch's": free_ratio,
                    "free-running 95% CI": f"{free_low:.3f}-{free_high:.3f}",
                }
            )
        if name in AGAINST_DYNAMIC and AGAINST_DYNAMIC[name] in runs:
            against = AGAINST_DYNAMIC[name]
            row["time / DynamicScale's"] = paired_ratio(times, name, against)[0]
            if free:
                row["free-running / DynamicScale's"] = paired_ratio(free, name, against)[0]
        if run.flushed:
            flushed = sum(f for f, _ in run.flushed.values())
            live = sum(t for _, t in run.flushed.values())
            row.update({f"underflow, step {k}": f"{share:.2e}" for k, share in sorted(run.shares.items())})
            row["underflow, mean"] = f"{flushed / live:.2e}"
            by_layer.append({"run": name, **{layer: f"{f / max(t, 1):.1e}" for layer, (f, t) in run.flushed.items()}})
        else:
            row["underflow, mean"] = "-"
        if run.last_result is not None and run.last_result.fields.get("layer_scales"):
            exponents = [
                math.log2(float(s) / float(run.last_result.scale)) for s in run.last_result.layer_scales.values()
            ]
            row["unit factors"] = f"2**{min(exponents):.0f}..2**{max(exponents):.0f}"
        summary.append(row)
    return summary, by_layer


def amax_read(device: str) -> str:
    """Which read gives PredictiveScale its amax on ``device``, as a sentence."""
    if torch.device(device).type != "cuda":
        return "PredictiveScale reads amax with one aminmax per tensor (the CPU path)."
    if amax_kernel_module() is None:
        return "PredictiveScale reads amax with torch's multi-tensor inf-norm (no triton, or LOSSSCALE_TRITON=0)."
    import triton

    return (
        f"PredictiveScale reads amax with lossscale.ops.amax_kernel (one Triton kernel; triton {triton.__version__})."
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--files", type=int, default=40, help="standard-library modules read (a tenth held out)")
    parser.add_argument("--heldout-sequences", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--free-rounds", type=int, default=9, help="rounds of the free-running measure")
    parser.add_argument("--free-steps", type=int, default=10, help="consecutive steps per free-running round")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json", default=None)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        args.steps, args.layers, args.d_model, args.heads = 4, 2, 32, 2
        args.context, args.sequences, args.files, args.heldout_sequences = 32, 4, 4, 8
        args.free_rounds, args.free_steps = 2, 2
    runs, seconds = train(args, device)
    free = free_running(runs, args, device) if args.free_rounds > 0 else None
    summary, by_layer = rows_of(runs, free)
    parameters = sum(p.numel() for p in runs["float32"].model.parameters())
    md = (
        f"Device: {device}. GPT-2 from a config ({args.layers} layers, width {args.d_model}, {args.heads} heads, "
        f"context {args.context}, vocabulary {VOCAB}, {parameters / 1e6:.2f}M parameters, tied embeddings), "
        f"characters of {args.files} standard-library modules, batch {args.sequences} x {args.context}, fused "
        f"AdamW (lr {args.lr:g}), {args.steps} steps from the same weights; float16 autocast except the float32 "
        f"run ({seconds:.0f} s in all). *underflow*: share of the gradient entries a float32 backward pass of the "
        f"same batch has nonzero that the run's gradients left zero, at the steps named (0, 10, 100 and the last) "
        f"and their mean over those steps. *time / torch's*: median over steps of the step's time over torch's "
        f"scaler's in the same step, with its 95% interval (each step timed from an idle device); *time / "
        f"DynamicScale's*: the same against the DynamicScale run with the same gradients (flat or not). *flat*: "
        f"flat_grads=True. *free-running*: {args.free_steps} consecutive steps with no synchronisation between "
        f"them, per step, median over {args.free_rounds} rounds, and the median of per-round ratios to torch's "
        f"scaler's. *per-layer*: layerwise=model ({len(runs['per-layer'].layers.units)} units, every module "
        f"that owns parameters); *per-block*: layerwise=[wte, wpe, *h, ln_f] "
        f"({len(runs['per-block'].layers.units)} units; the head reads wte's tied weight outside wte's unit, which "
        f"keeps wte at factor 1). {amax_read(device)}\n\n"
        + table(summary, list(dict.fromkeys(k for r in summary for k in r)))
        + "\n\nUnderflow by layer (``wte``: the tied input and output embedding):\n\n"
        + table(by_layer, list(by_layer[0]))
    )
    payload = {"machine": machine(device), "rows": summary, "by_layer": by_layer, "markdown": md}
    emit("language_model", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
