"""One demo run: train the character transformer, measure underflow, checkpoint, resume.

A step is ``accumulation`` micro-batches. A step's loss is the sum of its characters' cross-entropies
divided by ``cfg.normalizer()``: 2**20 in the presets, the character count of a typical language-model
batch, though a step computes only ``cfg.tokens_per_step()`` of them. (Each micro-batch's mean is multiplied
by ``tokens_per_step / normalizer`` and divided by the number of ranks; ``LossScaleOptimizer(
accumulation_steps=K)`` divides it by K.) So every backward pass carries gradient values as small as a
large-batch run's, which is what float16 has to hold. AdamW's update does not depend on that factor when
its ``eps`` is divided by the same factor, and it is: float32 and bfloat16 train exactly as with a plain mean.

A run lasts until it has applied ``cfg.steps`` updates. A skipped step (an overflow) costs its compute and
its batch is trained on at the next step, and the learning rate follows the applied updates; so every run
sees the same batches in the same order at the same learning rates, and the runs differ by their precision
and loss scale alone. A run that skips ``cfg.steps`` times stops there (at twice the steps), with fewer
updates.

Underflow (the ``underflow`` of ``results.json``) is measured, not assumed: at every ``measure_every``-th
step (and the first and last), right after the first micro-batch's backward pass, the same micro-batch is
run again in float32 on the same weights (``torch.autograd.grad``, which leaves the run's gradients alone).
The share of parameter-gradient values that are nonzero in that float32 backward pass but exactly zero in
the run's own (low-precision, scaled) backward pass is the share that flushed to zero.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from lossscale import LossScaleOptimizer
from lossscale import distributed as _dist
from lossscale.demo.config import DemoConfig
from lossscale.demo.data import VOCAB, Corpus
from lossscale.demo.model import CharTransformer
from lossscale.demo.runs import RunSpec
from lossscale.metrics import StepLogger, step_record

__all__ = ["RunHistory", "train_run", "load_checkpoint", "heldout_loss", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = 1


#: The library's underflow meter (``StepResult.underflow``) samples every 64th accumulated gradient value at
#: every step; the demo's own measurement below re-runs a micro-batch in float32 at sampled steps.
UNDERFLOW_METER_STRIDE = 64


@dataclass
class RunHistory:
    """What a run has recorded so far (saved in its checkpoints; ``results.json`` is made from it).

    Attributes:
        rows: One :func:`lossscale.metrics.step_record` per step, with ``loss``: the mean training loss of
            the step's micro-batches (rank 0's share under torchrun), as the run computed it.
        heldout: ``[step, held-out loss]`` after that many steps.
        underflow: ``[step, share of gradient values flushed to zero]`` at the measured steps.
        underflow_peak_by_parameter: At the measured step with the most underflow, each parameter's share.
        seconds: Training time so far (evaluation and measurement excluded).
        switch_step: The step a precision schedule switched back to float32 at, if it did.
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    heldout: list[list[float]] = field(default_factory=list)
    underflow: list[list[float]] = field(default_factory=list)
    underflow_peak_by_parameter: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    switch_step: int | None = None


def learning_rate(cfg: DemoConfig, step: int) -> float:
    """Linear warm-up over the first 10% of ``cfg.steps`` updates, then cosine decay to 10% of ``cfg.lr``.

    ``step`` counts applied updates: a skipped step does not advance the schedule (DeepSpeed's engine
    steps its scheduler only when the step was not an overflow), so a run that starts by skipping steps
    still warms up, and every run ends at the same rate."""
    warmup = max(1, cfg.steps // 10)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: str) -> float:
    """Mean cross-entropy (nats per character) on the held-out batches, in float32."""
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for x, y in batches:
        logits = model(x.to(device)).float()
        total += F.cross_entropy(logits.view(-1, VOCAB), y.to(device).reshape(-1), reduction="sum").double().cpu()
        count += y.numel()
    return float(total) / count


def _underflow_shares(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, float]]:
    """Share of this micro-batch's float32 gradient values that the run's own backward pass left at exactly 0,
    overall and per parameter (where a parameter has any)."""
    names, params = zip(*model.named_parameters())
    with torch.autocast(x.device.type, enabled=False):
        reference = F.cross_entropy(model(x).float().view(-1, VOCAB), y.reshape(-1))
    ref_grads = torch.autograd.grad(reference, params)
    live = torch.stack([(ref != 0).sum() for ref in ref_grads])
    flushed = torch.stack([((ref != 0) & (p.grad == 0)).sum() if p.grad is not None else (ref != 0).sum()
                           for p, ref in zip(params, ref_grads)])
    live_n, flushed_n = live.tolist(), flushed.tolist()  # one host read each
    by_param = {n: f / lv for n, f, lv in zip(names, flushed_n, live_n) if f}
    return sum(flushed_n) / max(1, sum(live_n)), by_param


def _save(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str, spec: RunSpec, cfg: DemoConfig, device: str = "cpu") -> dict[str, Any] | None:
    """The checkpoint of run ``spec`` at ``path`` (None if there is none); a ValueError if it was written by
    another run or with other settings (it could not continue the same trajectory)."""
    if not os.path.exists(path):
        return None
    saved = torch.load(path, map_location=device, weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") != CHECKPOINT_FORMAT or saved.get("run") != spec.name:
        raise ValueError(f"--resume: {path} is not a checkpoint of run {spec.name!r}; delete it or point --out "
                         f"elsewhere.")
    if saved["config"] != cfg.as_dict():
        diff = [f"{k} {saved['config'].get(k)!r} -> {v!r}" for k, v in cfg.as_dict().items()
                if saved["config"].get(k) != v]
        raise ValueError(f"--resume: {path} was written with other settings ({'; '.join(diff)}); resume with "
                         f"the same options, or start afresh without --resume.")
    return saved


@dataclasses.dataclass
class _Trainer:
    """What one run trains with: the model, its optimizer wrapper and schedule, where it runs."""

    spec: RunSpec
    cfg: DemoConfig
    corpus: Corpus
    model: CharTransformer
    opt: LossScaleOptimizer
    schedule: Any
    device: str
    rank: int
    world_size: int

    def micro_batches(self, step: int, position: int, history: RunHistory,
                      measure: bool) -> tuple[Any, torch.Tensor, float]:
        """One optimizer step on the batches of update ``position``: every micro-batch's forward and scaled
        backward, the underflow re-run on the first one when ``measure``, the ranks' gradient sum, then
        ``opt.step()``. Returns (result, loss sum, seconds spent measuring)."""
        cfg, opt, model = self.cfg, self.opt, self.model
        loss_sum = torch.zeros((), device=self.device)
        paused = 0.0
        opt.zero_grad()
        for micro in range(cfg.accumulation):
            x, y = (t.to(self.device) for t in self.corpus.batch(cfg.seed, position, micro, cfg.sequences,
                                                                  cfg.context, self.rank))
            with self.spec.autocast(self.device, self.schedule):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))
            opt.backward(loss * (cfg.loss_factor(self.world_size) / self.world_size))  # / accumulation inside
            loss_sum += loss.detach()
            if measure and micro == 0:
                began = time.perf_counter()
                share, by_param = _underflow_shares(model, x, y)
                if share > max((u for _, u in history.underflow), default=0.0):
                    history.underflow_peak_by_parameter = by_param
                history.underflow.append([step, share])
                paused += time.perf_counter() - began
            if micro == cfg.accumulation - 1 and self.world_size > 1:
                for p in model.parameters():  # the ranks' shares of the global batch, summed
                    if p.grad is not None:
                        _dist.all_reduce_sum_(p.grad)
            result = opt.step()
        return result, loss_sum, paused

    def one_step(self, step: int, applied: int, history: RunHistory, logger: StepLogger) -> dict[str, Any]:
        """Step ``step`` on the batches of update ``applied``, at that update's learning rate and precision;
        records it in ``history`` and ``logger`` (one host read) and returns its row."""
        began = time.perf_counter()
        if self.schedule is not None:
            self.schedule.update(step=applied)
        for group in self.opt.param_groups:
            group["lr"] = learning_rate(self.cfg, applied)
        measure = step % self.cfg.measure_every == 0 or applied == self.cfg.steps - 1
        result, loss_sum, paused = self.micro_batches(step, applied, history, measure)
        row = logger.write(step_record(result, loss=loss_sum / self.cfg.accumulation))
        history.rows.append(row)
        if row["switched"]:
            history.switch_step = step
        history.seconds += time.perf_counter() - began - paused
        return row

    def restore(self, saved: dict[str, Any] | None) -> tuple[RunHistory, int]:
        """Model and optimizer state from a checkpoint; the history and the next step (fresh: empty, 0)."""
        if saved is None:
            return RunHistory(), 0
        self.model.load_state_dict(saved["model"])
        self.opt.load_state_dict(saved["optimizer"])
        return RunHistory(**saved["history"]), int(saved["step"])

    def save(self, path: str | None, done: int, history: RunHistory) -> None:
        """A checkpoint after ``done`` steps (rank 0 only; nothing without a path)."""
        if path is None or self.rank != 0:
            return
        _save(path, {"format": CHECKPOINT_FORMAT, "run": self.spec.name, "config": self.cfg.as_dict(),
                     "step": done, "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                     "history": dataclasses.asdict(history)})


def _trainer(spec: RunSpec, cfg: DemoConfig, corpus: Corpus, device: str, rank: int, world_size: int) -> _Trainer:
    torch.manual_seed(cfg.seed)
    model = CharTransformer(VOCAB, cfg.d_model, cfg.layers, cfg.heads, cfg.context).to(device)
    eps = 1e-8 * cfg.loss_factor(world_size)  # with the loss's factor: a plain mean's updates exactly
    inner = torch.optim.AdamW(list(model.parameters()), lr=cfg.lr, betas=(0.9, 0.95), eps=eps, weight_decay=0.1,
                              fused=True)
    schedule = spec.make_schedule(cfg.steps)
    opt = LossScaleOptimizer(inner, policy=spec.policy(cfg), accumulation_steps=cfg.accumulation,
                             clip_grad_norm=cfg.clip_grad_norm, schedule=schedule,
                             underflow_stride=UNDERFLOW_METER_STRIDE)
    return _Trainer(spec, cfg, corpus, model, opt, schedule, device, rank, world_size)


def train_run(
    spec: RunSpec,
    cfg: DemoConfig,
    corpus: Corpus,
    *,
    device: str = "cpu",
    rank: int = 0,
    world_size: int = 1,
    csv_path: str | None = None,
    checkpoint_path: str | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    stop_after: int | None = None,
) -> RunHistory:
    """Train one run from scratch, or from ``checkpoint_path`` when ``resume`` and it exists.

    Checkpoints (model, optimizer with its policy state and schedule, the history, hence the data position:
    the count of applied updates) are written every ``checkpoint_every`` steps and at the end, by rank 0; a
    resumed run repeats the uninterrupted one exactly (no dropout; every state restored bit for bit).
    ``on_step(updates applied, row)`` after every step; ``stop_after`` steps stops as if killed (tests)."""
    run = _trainer(spec, cfg, corpus, device, rank, world_size)
    saved = load_checkpoint(checkpoint_path, spec, cfg, device) if resume and checkpoint_path else None
    history, start = run.restore(saved)

    heldout_batches = corpus.heldout_batches(cfg.context, cfg.eval_tokens)
    logger = StepLogger(csv_path) if rank == 0 else StepLogger()
    for row in history.rows:  # a resumed run's CSV starts with the rows of the steps already done
        logger.write(row)

    try:
        applied = sum(not row["skipped"] for row in history.rows)
        step = start
        while applied < cfg.steps and step < 2 * cfg.steps:
            row = run.one_step(step, applied, history, logger)
            applied += not row["skipped"]
            step += 1
            last = applied == cfg.steps or step == 2 * cfg.steps
            if last or (not row["skipped"] and applied % cfg.eval_every == 0):
                history.heldout.append([step, heldout_loss(run.model, heldout_batches, device)])
            if on_step is not None:
                on_step(applied, row)
            if stop_after is not None and step >= stop_after and not last:
                return history
            if checkpoint_every and (step % checkpoint_every == 0 or last):
                run.save(checkpoint_path, step, history)
    finally:
        logger.close()
    return history
