"""``lossscale demo``: the same small language model trained in float32, float16 with and without loss
scaling, bfloat16 and under a precision schedule, side by side on the same data and seed.

Writes to ``--out`` (default ``demo-out``): ``results.json``, ``demo.png``, one CSV of
:class:`lossscale.metrics.StepLogger` rows per run, and with ``--checkpoint-every`` a checkpoint per run
in ``checkpoints/``. Under torchrun every rank trains its share of each global batch and rank 0 prints
and writes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any, NoReturn

import torch

from lossscale import distributed as _dist
from lossscale.demo.config import DEFAULT, QUICK, DemoConfig
from lossscale.demo.data import load_corpus
from lossscale.demo.plot import have_matplotlib, plot_runs
from lossscale.demo.progress import Progress, have_tqdm
from lossscale.demo.report import format_table, summarize, write_results
from lossscale.demo.runs import RUNS, parse_runs
from lossscale.demo.train import load_checkpoint, train_run

__all__ = ["main"]


class _UsageError(Exception):
    """Bad input: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _int_at_least(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}; got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}; got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0; got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0; got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lossscale demo", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=f"--quick: {QUICK.describe()}\ndefault: {DEFAULT.describe()}")
    p.add_argument("--quick", action="store_true", help="the short configuration (under two minutes on 2 cores)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated runs to compare (default: all: "
                   f"{','.join(RUNS)})")
    p.add_argument("--steps", type=_int_at_least(1), help="optimizer steps per run")
    p.add_argument("--seed", type=_int_at_least(0), help="seeds the model, the choice of files and the batches")
    p.add_argument("--out", default="demo-out", help="directory for results.json, demo.png, CSVs, checkpoints")
    p.add_argument("--checkpoint-every", type=_int_at_least(0), default=0, metavar="N",
                   help="save each run every N steps (and at its end); 0: never")
    p.add_argument("--resume", action="store_true", help="continue each run from its checkpoint in --out")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    size = p.add_argument_group("size of the experiment (defaults: the preset's)")
    size.add_argument("--accumulation", type=_int_at_least(1), metavar="K", help="micro-batches per step")
    size.add_argument("--sequences", type=_int_at_least(1), help="sequences per micro-batch")
    size.add_argument("--context", type=_int_at_least(2), help="characters per sequence")
    size.add_argument("--d-model", type=_int_at_least(2), help="transformer width")
    size.add_argument("--layers", type=_int_at_least(1), help="transformer blocks")
    size.add_argument("--heads", type=_int_at_least(1), help="attention heads")
    size.add_argument("--files", type=_int_at_least(2), help="standard-library files to read")
    size.add_argument("--lr", type=_positive_float, help="peak learning rate")
    size.add_argument("--eval-every", type=_int_at_least(1), metavar="N", help="steps between held-out evaluations")
    size.add_argument("--measure-every", type=_int_at_least(1), metavar="N",
                      help="steps between underflow measurements")
    return p


def _config(args: argparse.Namespace) -> DemoConfig:
    cfg = QUICK if args.quick else DEFAULT
    names = ["steps", "seed", "accumulation", "sequences", "context", "d_model", "layers", "heads", "files", "lr",
             "eval_every", "measure_every"]
    cfg = cfg.replace(**{n: getattr(args, n) for n in names if getattr(args, n) is not None})
    if cfg.d_model % cfg.heads:
        raise _UsageError(f"--d-model {cfg.d_model} must be a multiple of --heads {cfg.heads}")
    return cfg


def _writable_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise _UsageError(f"--out {path!r} is not a writable directory ({err.strerror or err})") from None


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)


def main(argv: list[str]) -> int:
    """Run the demo; returns the exit status (0, 1 for a failure, 2 for bad input)."""
    try:
        args = build_parser().parse_args(argv)
        specs = parse_runs(args.runs)
        cfg = _config(args)
        if args.device != "cpu":
            try:
                torch.empty(0, device=args.device)
            except (RuntimeError, ValueError) as err:
                raise _UsageError(f"--device {args.device!r} is not usable here ({str(err).splitlines()[0]})") from None
        _writable_dir(args.out)
    except (_UsageError, ValueError) as err:
        print(f"lossscale demo: error: {err}", file=sys.stderr)
        return 2

    rank, world_size = _join(args.device)
    try:
        return _run(args, specs, cfg, rank, world_size)
    except (ValueError, RuntimeError, OSError) as err:
        if rank == 0:
            print(f"lossscale demo: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        if world_size > 1:
            _dist.shutdown()


def _join(device: str) -> tuple[int, int]:
    """``(rank, world_size)``: the torchrun group when launched by torchrun, else ``(0, 1)``.

    Without ``lossscale.distributed.init_from_env`` (older lossscale) every process runs alone and only
    the one with ``RANK`` 0 (or none) prints and writes."""
    init = getattr(_dist, "init_from_env", None)
    if init is None:
        return int(os.environ.get("RANK", "0")), 1
    return init("nccl" if device.startswith("cuda") else "gloo")


def _run(args: argparse.Namespace, specs: list, cfg: DemoConfig, rank: int, world_size: int) -> int:
    main_rank = rank == 0
    say = print if main_rank else (lambda *a, **k: None)
    corpus = load_corpus(cfg.files, cfg.seed, cfg.context)
    say(f"lossscale demo: a character-level transformer on Python's own standard library "
        f"({len(corpus.train_files)} files, {len(corpus.train):,} characters; "
        f"{len(corpus.heldout_files)} files, {len(corpus.heldout):,} characters held out)")
    say(f"  {cfg.describe(world_size)}")
    say(f"  each micro-batch's loss is normalized by the {cfg.tokens_per_step(world_size):,} characters of the "
        f"global batch: its gradient values are {cfg.accumulation * world_size}x smaller than its own mean's")
    missing = [n for n, ok in (("tqdm", have_tqdm()), ("matplotlib", have_matplotlib())) if not ok]
    if missing:
        say(f"  note: {' and '.join(missing)} not installed: plain progress lines"
            f"{' and a plot without text' if 'matplotlib' in missing else ''}; "
            f"pip install 'lossscale[demo]' for the full output")
    checkpoints = os.path.join(args.out, "checkpoints")
    if args.checkpoint_every and main_rank:
        os.makedirs(checkpoints, exist_ok=True)
    summaries = []
    started = time.perf_counter()
    for spec in specs:
        ckpt = os.path.join(checkpoints, f"{_slug(spec.name)}.pt") if args.checkpoint_every or args.resume else None
        saved = load_checkpoint(ckpt, spec, cfg) if args.resume and ckpt is not None else None
        initial = 0 if saved is None else int(saved["step"])
        bar = Progress(spec.name, cfg.steps, initial=initial, enabled=main_rank)

        def on_step(done: int, row: dict[str, Any], bar: Progress = bar) -> None:
            bar.update(done, loss=row["loss"], scale=row["next_scale"], skipped=row["skipped_steps"])

        try:
            history = train_run(spec, cfg, corpus, device=args.device, rank=rank, world_size=world_size,
                                csv_path=os.path.join(args.out, f"{_slug(spec.name)}.csv") if main_rank else None,
                                checkpoint_path=ckpt, checkpoint_every=args.checkpoint_every,
                                resume=args.resume, on_step=on_step)
        finally:
            bar.close()
        summaries.append(summarize(spec, history))
    if not main_rank:
        return 0
    results = os.path.join(args.out, "results.json")
    write_results(results, cfg, summaries, world_size, corpus)
    figure = os.path.join(args.out, "demo.png")
    drawn = plot_runs(figure, summaries, f"lossscale demo: {cfg.describe(world_size)}")
    print()
    print(format_table(summaries))
    print(f"\nwrote {results}, {figure}{' (plain: no matplotlib)' if drawn == 'plain' else ''} and a CSV per run "
          f"({time.perf_counter() - started:.0f} s)")
    return 0
