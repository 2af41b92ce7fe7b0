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
from lossscale.demo.data import Corpus, load_corpus
from lossscale.demo.jobs import RunTask, run_in_workers, threads_per_job
from lossscale.demo.machine import describe_machine, machine
from lossscale.demo.plot import have_matplotlib, plot_runs
from lossscale.demo.progress import Progress, have_tqdm
from lossscale.demo.report import format_table, summarize, verdict, write_results
from lossscale.demo.runs import QUICK_RUNS, RUNS, RunSpec, parse_runs
from lossscale.demo.train import RunHistory, load_checkpoint, train_run

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
    p.add_argument("--quick", action="store_true", help=f"the short configuration and runs {','.join(QUICK_RUNS)}")
    p.add_argument("--runs", help=f"comma-separated runs to compare (default: all: {','.join(RUNS)}; with --quick: "
                   f"{','.join(QUICK_RUNS)})")
    p.add_argument("--jobs", type=_int_at_least(1), metavar="N",
                   help="train at most N runs at a time, in worker processes with cores/N torch threads each (default: one "
                        "per core on the CPU; 1 under torchrun or on a GPU)")
    p.add_argument("--steps", type=_int_at_least(1), help="updates each run applies (skipped steps come on top)")
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
    size.add_argument("--init-scale", type=_positive_float, metavar="S", help="first loss scale of the float16 runs")
    size.add_argument("--loss-normalizer", type=_int_at_least(0), metavar="N",
                      help="divide a step's summed loss by N characters (0: by its own, a plain mean)")
    size.add_argument("--growth-interval", type=_int_at_least(1), metavar="N",
                      help="clean steps before DynamicScale doubles the scale")
    size.add_argument("--eval-every", type=_int_at_least(1), metavar="N", help="steps between held-out evaluations")
    size.add_argument("--measure-every", type=_int_at_least(1), metavar="N",
                      help="steps between underflow measurements")
    return p


def _config(args: argparse.Namespace) -> DemoConfig:
    cfg = QUICK if args.quick else DEFAULT
    names = ["steps", "seed", "accumulation", "sequences", "context", "d_model", "layers", "heads", "files", "lr",
             "init_scale", "growth_interval", "loss_normalizer", "eval_every", "measure_every"]
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
        specs = parse_runs(args.runs if args.runs is not None else ",".join(QUICK_RUNS if args.quick else RUNS))
        cfg = _config(args)
        if args.device != "cpu":
            try:
                torch.empty(0, device=args.device)
            except (RuntimeError, ValueError) as err:
                raise _UsageError(f"--device {args.device!r} is not usable here ({str(err).splitlines()[0]})") from None
        _writable_dir(args.out)
        torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if args.jobs is not None and args.jobs > 1 and (args.device != "cpu" or torchrun):
            raise _UsageError(f"--jobs {args.jobs}: runs train side by side only on the CPU without torchrun; "
                              f"{'under torchrun' if torchrun else f'with --device {args.device}'} use --jobs 1")
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
    except KeyboardInterrupt:
        if rank == 0:
            kept = (f"checkpoints in {os.path.join(args.out, 'checkpoints')}: add --resume to go on"
                    if args.checkpoint_every else "nothing saved (--checkpoint-every N saves runs as they go)")
            print(f"\nlossscale demo: interrupted; {kept}", file=sys.stderr)
        return 130
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


def _run(args: argparse.Namespace, specs: list[RunSpec], cfg: DemoConfig, rank: int, world_size: int) -> int:
    main_rank = rank == 0
    say = print if main_rank else (lambda *a, **k: None)
    started = time.perf_counter()
    corpus = load_corpus(cfg.files, cfg.seed, cfg.context)
    jobs = _jobs(args, specs, world_size)
    threads = threads_per_job(jobs, os.cpu_count()) if jobs > 1 else torch.get_num_threads()
    host = machine(args.device) | {"torch_threads": threads, "jobs": jobs}
    say(f"lossscale demo: a character-level transformer on Python's own standard library "
        f"({len(corpus.train_files)} files, {len(corpus.train):,} characters; "
        f"{len(corpus.heldout_files)} files, {len(corpus.heldout):,} characters held out)")
    say(f"  {cfg.describe(world_size)}")
    say(f"  each step's summed loss is divided by {cfg.normalizer(world_size):,} characters: gradient values "
        f"{1 / cfg.loss_factor(world_size):,.0f}x smaller than a plain mean's; a skipped step's batch is trained on "
        f"at the next step")
    say(f"  on {describe_machine(host)}; {len(specs)} runs, {jobs} at a time")
    missing = [n for n, ok in (("tqdm", have_tqdm()), ("matplotlib", have_matplotlib())) if not ok]
    if missing:
        say(f"  note: {' and '.join(missing)} not installed: plain progress lines"
            f"{' and a plot without text' if 'matplotlib' in missing else ''}; "
            f"pip install 'lossscale[demo]' for the full output")
    if args.checkpoint_every and main_rank:
        os.makedirs(os.path.join(args.out, "checkpoints"), exist_ok=True)
    histories = _train_all(args, specs, cfg, corpus, rank, world_size, jobs, threads)
    if not main_rank:
        return 0
    summaries = [summarize(spec, history) for spec, history in zip(specs, histories)]
    results = os.path.join(args.out, "results.json")
    write_results(results, cfg, summaries, world_size, corpus, host | {"wall_seconds": time.perf_counter() - started})
    figure = os.path.join(args.out, "demo.png")
    drawn = plot_runs(figure, summaries, f"lossscale demo: {cfg.describe(world_size)}")
    print()
    print(format_table(summaries))
    print(f"\n{verdict(summaries)}plot: {figure}{' (plain, no matplotlib)' if drawn == 'plain' else ''}; table "
          f"above and in {results}; {time.perf_counter() - started:.0f} s in all")
    return 0


def _jobs(args: argparse.Namespace, specs: list[RunSpec], world_size: int) -> int:
    """Runs trained at a time: ``--jobs``, else one per core (CPU, one process), else 1."""
    alone = world_size == 1 and args.device == "cpu"
    if args.jobs is not None:
        return min(args.jobs, len(specs))
    return min(len(specs), os.cpu_count() or 1) if alone else 1


def _train_all(args: argparse.Namespace, specs: list[RunSpec], cfg: DemoConfig, corpus: Corpus, rank: int,
               world_size: int, jobs: int, threads: int) -> list[RunHistory]:
    """Every run's history, in the order of ``specs``: one after the other in this process, or ``jobs`` at
    a time in worker processes (float32 runs, the shortest, start last)."""
    tasks = [_task(args, spec, cfg, rank) for spec in specs]
    if jobs > 1:
        bars = {t.name: _progress(args, spec, t, rank, position) for position, (spec, t) in enumerate(zip(specs, tasks))}
        order = sorted(tasks, key=lambda t: RUNS[t.name].dtype is None and RUNS[t.name].schedule is None)
        try:
            done = run_in_workers(order, jobs, threads, lambda name, step, row: _show(bars[name], step, row))
        finally:
            for bar in bars.values():
                bar.close()
        by_name = {t.name: history for t, history in zip(order, done)}
        return [by_name[t.name] for t in tasks]
    histories = []
    for spec, task in zip(specs, tasks):
        bar = _progress(args, spec, task, rank, 0)
        try:
            histories.append(train_run(spec, cfg, corpus, device=args.device, rank=rank, world_size=world_size,
                                       csv_path=task.csv_path, checkpoint_path=task.checkpoint_path,
                                       checkpoint_every=task.checkpoint_every, resume=task.resume,
                                       on_step=lambda step, row, bar=bar: _show(bar, step, row)))
        finally:
            bar.close()
    return histories


def _task(args: argparse.Namespace, spec: RunSpec, cfg: DemoConfig, rank: int) -> RunTask:
    checkpoint = args.checkpoint_every or args.resume
    return RunTask(spec.name, cfg, args.device,
                   csv_path=os.path.join(args.out, f"{_slug(spec.name)}.csv") if rank == 0 else None,
                   checkpoint_path=os.path.join(args.out, "checkpoints", f"{_slug(spec.name)}.pt") if checkpoint
                   else None, checkpoint_every=args.checkpoint_every, resume=args.resume)


def _progress(args: argparse.Namespace, spec: RunSpec, task: RunTask, rank: int, position: int) -> Progress:
    """The run's progress line, starting where its checkpoint left off when resuming."""
    saved = load_checkpoint(task.checkpoint_path, spec, task.cfg) if args.resume and task.checkpoint_path else None
    applied = 0 if saved is None else sum(not row["skipped"] for row in saved["history"]["rows"])
    return Progress(spec.name, task.cfg.steps, initial=applied,
                    enabled=rank == 0, position=position)


def _show(bar: Progress, step: int, row: dict[str, Any]) -> None:
    bar.update(step, loss=row["loss"], scale=row["next_scale"], skips=row["skipped_steps"])
