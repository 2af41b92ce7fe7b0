"""``lossscale demo``: one small language model trained in float32, in float16 with and without loss scaling,
in bfloat16 and under a precision schedule, on the same batches from the same seed (see docs/demo.md).

Writes to ``--out``: ``results.json``, ``demo.png`` and one :class:`lossscale.StepLogger` CSV per run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import queue
import shlex
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from typing import Any, NoReturn

import torch

try:
    from tqdm import tqdm

    from lossscale.demo.plot import plot_runs, power_text
except ImportError as err:
    raise SystemExit(
        f"lossscale demo: error: {err.name} is not installed; the demo needs matplotlib and tqdm, the demo extra: "
        f"pip install '.[demo]' in a clone of the lossscale repository"
    ) from None

from lossscale.demo.train import (
    DEFAULT,
    QUICK,
    QUICK_RUNS,
    RUNS,
    Config,
    RunResult,
    load_corpus,
    start_worker,
    train_in_worker,
)
from lossscale.reporting import atomic_write

DEFINITIONS = {
    "heldout_loss": "mean cross-entropy in nats per character on the held-out files, in float32, after the last step",
    "underflow": "share of gradient values nonzero in a float32 backward pass of a step's first micro-batch but "
    "exactly zero in the run's own backward pass of it (its precision and loss scale), at every "
    "measure_every-th step and the last: mean and peak over those samples",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")  # one line; --help shows the usage


def _at_least(low: int) -> Callable[[str], int]:
    def count(text: str) -> int:
        if not text.isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}; got {text!r}")
        return int(text)

    return count


def _run_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if any(n not in RUNS for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"got {text!r}; name runs once each, from {', '.join(RUNS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The demo's options."""
    p = _Parser(
        prog="lossscale demo",
        description=__doc__.split("\n\n")[0],
        epilog="Quote 'fast|step|0.9' in a shell. Details and measurements: docs/demo.md.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK.steps} updates of {QUICK.sequences} sequences per micro-batch instead of {DEFAULT.steps} "
        f"of {DEFAULT.sequences}, and the runs {','.join(QUICK_RUNS)}",
    )
    p.add_argument("--runs", type=_run_names, help=f"comma-separated runs (default: {','.join(RUNS)})")
    p.add_argument("--steps", type=_at_least(1), help="updates each run applies (skipped steps come on top)")
    p.add_argument("--seed", type=_at_least(0), help="seeds the model, the choice of files and the batches")
    p.add_argument(
        "--jobs",
        type=_at_least(1),
        help="runs trained at a time, each in a worker process with one "
        "torch thread (default: one per core on the CPU, else 1)",
    )
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--out", default="demo-out", help="directory for results.json, demo.png and the CSVs")
    size = p.add_argument_group("size of the experiment (default: the preset's)")
    size.add_argument("--accumulation", type=_at_least(1), help="micro-batches per step")
    size.add_argument("--sequences", type=_at_least(1), help="sequences per micro-batch")
    size.add_argument("--context", type=_at_least(2), help="characters per sequence")
    size.add_argument("--d-model", type=_at_least(2), help="transformer width (a multiple of its 2 heads)")
    size.add_argument("--files", type=_at_least(2), help="standard-library files to read (a tenth held out)")
    return p


def settings(args: argparse.Namespace) -> tuple[Config, list[str]]:
    """The configuration and the runs that parsed options ask for: the preset's, with the options given applied."""
    options = ("steps", "seed", "accumulation", "sequences", "context", "d_model", "files")
    cfg = replace(
        QUICK if args.quick else DEFAULT, **{k: getattr(args, k) for k in options if getattr(args, k) is not None}
    )
    return cfg, args.runs or (QUICK_RUNS if args.quick else list(RUNS))


def config_record(cfg: Config, names: list[str]) -> dict[str, Any]:
    """results.json's ``config``, also written into demo.png: every field of ``cfg``, its loss factor, the runs."""
    return asdict(cfg) | {"loss_factor": cfg.loss_factor, "runs": names}


def main(argv: list[str]) -> int:
    """Run the demo; returns the exit status (bad input exits with 2 and one line, as argparse does)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg, names = settings(args)
    if cfg.d_model % cfg.heads:
        parser.error(f"argument --d-model: must be a multiple of the {cfg.heads} heads; got {cfg.d_model}")
    try:
        torch.empty(0, device=args.device)
    except Exception as err:  # RuntimeError, or AssertionError from a build without that device
        parser.error(f"argument --device: {args.device!r} is not usable here ({str(err).splitlines()[0]})")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as err:
        parser.error(f"argument --out: cannot make directory {args.out!r} ({err.strerror})")
    try:
        corpus = load_corpus(cfg)
    except ValueError as err:
        parser.error(str(err))
    jobs = min(len(names), args.jobs or ((os.cpu_count() or 1) if args.device == "cpu" else 1))

    started = time.perf_counter()
    print(
        f"lossscale demo: a character-level transformer on Python's own standard library: "
        f"{len(corpus.train_files)} files ({len(corpus.train):,} characters), {len(corpus.heldout_files)} held out "
        f"({len(corpus.heldout):,})\n  {cfg.steps} updates x {cfg.accumulation} micro-batches x {cfg.sequences} "
        f"sequences x {cfg.context} characters; loss / {cfg.loss_normalizer:,} characters; "
        f"seed {cfg.seed}; {len(names)} runs, {jobs} at a time"
    )
    try:
        runs = train_all(names, cfg, args.device, args.out, jobs)
    except KeyboardInterrupt:
        print("\nlossscale demo: interrupted", file=sys.stderr)
        return 130
    wall = time.perf_counter() - started
    results = os.path.join(args.out, "results.json")
    with atomic_write(results) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(
            {
                "config": config_record(cfg, names),
                "machine": {
                    "processor": platform.processor(),
                    "machine": platform.machine(),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "torch": torch.__version__,
                    "device": args.device,
                    "torch_threads_per_run": 1,
                    "jobs": jobs,
                    "wall_seconds": wall,
                },
                "corpus": {
                    "train_files": [os.path.basename(p) for p in corpus.train_files],
                    "heldout_files": [os.path.basename(p) for p in corpus.heldout_files],
                    "train_characters": len(corpus.train),
                    "heldout_characters": len(corpus.heldout),
                },
                "definitions": DEFINITIONS,
                "runs": runs,
            },
            f,
            indent=1,
        )
    figure = os.path.join(args.out, "demo.png")
    plot_runs(
        figure,
        runs,
        f"lossscale demo (seed {cfg.seed}): {cfg.steps} updates of {cfg.accumulation} x "
        f"{cfg.sequences} x {cfg.context} characters, loss / {cfg.loss_normalizer:,} "
        f"characters, float16 loss scale from {power_text(cfg.init_scale)}",
        {"Command": shlex.join(["lossscale", "demo", *argv]), "Settings": json.dumps(config_record(cfg, names))},
    )
    print(f"\n{format_table(runs)}\n\n{verdict(runs)}plot {figure}, numbers {results}; {wall:.0f} s")
    return 0


def train_all(names: list[str], cfg: Config, device: str, out: str, jobs: int) -> list[RunResult]:
    """Every run's results in the order of ``names``, trained ``jobs`` at a time in spawned worker processes.

    A progress bar per run where stderr is a terminal; elsewhere (a log file) one line per run as it finishes, with
    no cursor movement or carriage return.
    """
    bars = {
        n: tqdm(total=cfg.steps, desc=f"{n:>15}", unit="update", position=i, disable=None) for i, n in enumerate(names)
    }
    context = multiprocessing.get_context("spawn")
    progress = context.Queue()
    pool = ProcessPoolExecutor(jobs, mp_context=context, initializer=start_worker, initargs=(progress,))
    try:
        first = sorted(names, key=lambda n: RUNS[n].dtype is None and RUNS[n].schedule is None)  # fp32: shortest
        futures = {
            n: pool.submit(train_in_worker, n, cfg, device, os.path.join(out, n.replace("|", "_") + ".csv"))
            for n in first
        }
        while True:
            try:
                name, applied, loss, scale, skips = progress.get(timeout=0.2)
            except queue.Empty:
                if all(f.done() for f in futures.values()):  # and the last steps' progress has arrived
                    break
                continue
            bars[name].set_postfix(loss=f"{loss:.3f}", scale=power_text(scale), skips=skips, refresh=False)
            bars[name].update(applied - bars[name].n)
            if bars[name].disable and applied == cfg.steps:
                print(
                    f"{name:>15}: {applied} updates, loss {loss:.3f}, scale {power_text(scale)}, {skips} skipped",
                    flush=True,
                )
        return [futures[n].result() for n in names]
    finally:
        pool.shutdown(cancel_futures=True)
        for bar in bars.values():
            bar.close()


def format_table(runs: list[RunResult]) -> str:
    """The comparison printed at the end: the headline numbers of results.json."""
    reference = next((r["heldout_loss"] for r in runs if r["name"] == "fp32"), None)
    rows = [("run", "held-out loss", "vs fp32", "skipped", "final scale", "underflow mean/peak", "seconds")]
    for r in runs:
        rows.append(
            (
                r["name"],
                f"{r['heldout_loss']:.4f}",
                f"{100 * (r['heldout_loss'] / reference - 1):+.1f}%" if reference else "-",
                str(r["skipped_steps"]),
                power_text(r["final_scale"]),
                f"{100 * r['underflow']:.1f}% / {100 * r['underflow_peak']:.1f}%",
                f"{r['seconds']:.1f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows
    )


def verdict(runs: list[RunResult]) -> str:
    """The float16 runs against fp32 in a few words (empty without fp32)."""
    reference = next((r["heldout_loss"] for r in runs if r["name"] == "fp32"), None)
    parts = []
    for r in runs:
        if reference and r["name"].startswith("fp16"):
            why = (
                f"{100 * r['underflow']:.0f}% of gradient values flushed to zero"
                if r["name"] == "fp16-noscale"
                else f"{r['skipped_steps']} skipped"
            )
            parts.append(f"{r['name']} {100 * (r['heldout_loss'] / reference - 1):+.1f}% vs fp32 ({why}); ")
    return "".join(parts)
