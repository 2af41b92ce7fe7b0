"""Run the demo's runs side by side: one worker process per run, one torch thread each.

Why: the demo's model is so small that a second torch thread buys a run almost nothing (measured on a
2-core AMD EPYC with AVX2 only: a float16 micro-batch took 76 ms with 2 threads and 80 ms with 1), while
two runs on two cores take half the time of one after the other. So with ``jobs`` workers every run gets
``max(1, cores // jobs)`` threads, and a run's numbers are the same as when it runs alone with that many
threads (each run is a deterministic function of its seed; the data position is the step number).

The rule::

    workers = spawn(jobs)                       # fresh interpreters: no forked OpenMP state
    each worker: torch.set_num_threads(threads); load the corpus itself (deterministic, ~0.1 s);
                 train_run(RUNS[name], ...); send (name, done, row) to the parent after every step
    parent: show the progress messages as they come; return the histories in the order asked

Cost: each worker imports torch once (about a second, in parallel); the per-step messages are a few
hundred bytes. A worker's error is raised in the parent.

Ctrl-C: the workers ignore SIGINT (a terminal sends it to them too); the parent sets a shared stop flag,
which each worker reads after every step and then stops (within one step, without a final checkpoint),
cancels the runs not yet started, keeps reading the progress queue until every worker has stopped (a
worker never waits on a full queue), and raises KeyboardInterrupt. A worker whose parent was killed outright
(no chance to set the flag) sees its parent's pid change and stops after its step too.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import signal
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from lossscale.demo.config import DemoConfig
from lossscale.demo.data import load_corpus
from lossscale.demo.runs import RUNS
from lossscale.demo.train import RunHistory, train_run

__all__ = ["RunTask", "run_in_workers", "threads_per_job"]

#: The row fields the progress display needs (the rest stays in the worker's CSV).
PROGRESS_FIELDS = ("loss", "next_scale", "skipped_steps")

_messages: Any = None  # the worker's end of the progress queue (set by _start_worker)
_stop: Any = None  # the parent's stop flag, a multiprocessing Event (set by _start_worker)
_parent = 0  # the parent's pid: a worker whose parent has died (killed) stops after its step


class _Stopped(Exception):
    """Raised in a worker after a step when the parent asked every run to stop (Ctrl-C)."""


@dataclass(frozen=True)
class RunTask:
    """One run for a worker: everything :func:`lossscale.demo.train.train_run` takes, by value."""

    name: str
    cfg: DemoConfig
    device: str
    csv_path: str | None
    checkpoint_path: str | None
    checkpoint_every: int
    resume: bool


def threads_per_job(jobs: int, cores: int | None) -> int:
    """Torch threads for each of ``jobs`` workers on ``cores`` cores: ``max(1, cores // jobs)``."""
    return max(1, (cores or 1) // jobs)


def _start_worker(messages: Any, stop: Any, threads: int) -> None:
    global _messages, _stop, _parent
    _messages, _stop, _parent = messages, stop, os.getppid()
    messages.cancel_join_thread()  # exiting never waits for the parent to read (it may have stopped reading)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides, and tells the workers through _stop
    torch.set_num_threads(threads)


def _work(task: RunTask) -> RunHistory:
    corpus = load_corpus(task.cfg.files, task.cfg.seed, task.cfg.context)

    def report(done: int, row: dict[str, Any]) -> None:
        _messages.put((task.name, done, {k: row[k] for k in PROGRESS_FIELDS}))
        if _stop.is_set() or os.getppid() != _parent:
            raise _Stopped(task.name)

    try:
        return train_run(RUNS[task.name], task.cfg, corpus, device=task.device, csv_path=task.csv_path,
                         checkpoint_path=task.checkpoint_path, checkpoint_every=task.checkpoint_every,
                         resume=task.resume, on_step=report)
    except _Stopped:
        if os.getppid() != _parent:  # nobody left to report to, and the pool would wait for work forever
            os._exit(1)  # (train_run has closed its CSV on the way out)
        raise
    finally:
        _messages.put((task.name, None, None))  # after its last row: this run sends nothing more


def run_in_workers(tasks: list[RunTask], jobs: int, threads: int,
                   on_step: Callable[[str, int, dict[str, Any]], None]) -> list[RunHistory]:
    """Train ``tasks`` in ``jobs`` worker processes with ``threads`` torch threads each; ``on_step(name,
    done, row)`` is called in this process as the workers report. Returns the histories in task order.
    Runs listed first start first (put the long ones first to finish soonest)."""
    context = multiprocessing.get_context("spawn")
    messages, stop = context.Queue(), context.Event()
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_start_worker,
                             initargs=(messages, stop, threads)) as pool:
        futures: list[Future[RunHistory]] = [pool.submit(_work, task) for task in tasks]
        try:
            _relay(messages, futures, on_step)
        except KeyboardInterrupt:
            stop.set()
            for future in futures:
                future.cancel()  # the runs not started yet
            _drain(messages, futures)
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        return [future.result() for future in futures]  # a worker's error is raised here


def _drain(messages: Any, futures: list[Future[RunHistory]], seconds: float = 60.0) -> None:
    """Read and drop progress messages until every started run has stopped (at most ``seconds``), so that no
    worker waits on a full queue."""
    deadline = time.monotonic() + seconds
    while not all(future.done() for future in futures) and time.monotonic() < deadline:
        try:
            messages.get(timeout=0.05)
        except queue_module.Empty:
            pass


def _relay(messages: Any, futures: list[Future[RunHistory]],
           on_step: Callable[[str, int, dict[str, Any]], None]) -> None:
    """Pass the workers' progress messages to ``on_step`` until every run has ended; a worker that died without
    a word (killed, out of memory) raises here."""
    ended = 0
    while ended < len(futures):
        try:
            name, done, row = messages.get(timeout=0.2)
        except queue_module.Empty:
            for future in futures:
                if future.done() and future.exception() is not None:
                    future.result()
            continue
        if done is None:
            ended += 1
        else:
            on_step(name, done, row)
