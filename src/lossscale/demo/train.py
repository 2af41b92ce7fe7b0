"""One demo run: a small character-level transformer trained on Python's own standard-library sources.

A step is ``cfg.accumulation`` micro-batches. Its loss is the sum of its characters' cross-entropies
divided by ``cfg.loss_normalizer`` characters (as a large language-model batch would divide it), and
AdamW's ``eps`` is multiplied by the same ``cfg.loss_factor``, so float32 trains as with a plain mean
while float16 has to hold gradients as small as such a batch's. A run lasts until it has applied
``cfg.steps`` updates (at most ``2 * cfg.steps`` steps): a skipped step's batch and learning rate are
used again at the next step, so every run sees the same batches at the same learning rates.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import random
import sysconfig
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from lossscale import (
    DynamicScale,
    FixedScale,
    LossScaleOptimizer,
    Policy,
    PrecisionSchedule,
    PredictiveScale,
    StepLogger,
)

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

VOCAB = 128  # ASCII codes 0-126 as they are; 127 for every other character


@dataclass(frozen=True)
class Config:
    """Everything that decides a run's numbers (the run's name aside).

    ``steps`` counts applied updates; ``files`` standard-library modules are read (a tenth held out);
    ``eval_every`` and ``measure_every`` count steps between held-out evaluations and underflow
    measurements (the first and last step always measured); ``init_scale`` and ``growth_interval`` set
    the float16 runs' loss scale; a step's summed loss is divided by ``loss_normalizer`` characters
    (0: by the step's own characters, a plain mean).
    """

    steps: int = 160
    accumulation: int = 6
    sequences: int = 64
    context: int = 32
    d_model: int = 16
    layers: int = 1
    heads: int = 2
    files: int = 60
    lr: float = 0.02
    seed: int = 0
    init_scale: float = 2.0**32
    growth_interval: int = 20
    loss_normalizer: int = 2**20
    eval_every: int = 20
    measure_every: int = 10
    eval_characters: int = 32_768

    @property
    def loss_factor(self) -> float:
        """``characters per step / loss_normalizer``: what a plain mean's loss and AdamW's eps are multiplied by."""
        per_step = self.accumulation * self.sequences * self.context
        return per_step / (self.loss_normalizer or per_step)


DEFAULT = Config()
#: A quarter of the default's sequences per micro-batch and a quarter of its updates: a float16 run costs a sixteenth
#: of the default's compute, which matters where float16 matmuls have no hardware support (an AVX2-only CPU).
QUICK = Config(steps=40, sequences=16, eval_every=10, measure_every=5)


@dataclass(frozen=True)
class Run:
    """How a run trains: its autocast dtype (None: float32) or precision schedule, and its loss-scale policy."""

    dtype: torch.dtype | None
    policy: Callable[[Config], Policy[Any]]
    schedule: str | None = None

    def autocast(self, device: str, schedule: PrecisionSchedule | None) -> AbstractContextManager[object]:
        """The forward pass's precision context at this step."""
        if schedule is not None:
            return schedule.autocast(device)
        return torch.autocast(device, dtype=self.dtype) if self.dtype else contextlib.nullcontext()


def _dynamic(cfg: Config) -> DynamicScale:
    return DynamicScale(init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)


RUNS: dict[str, Run] = {
    "fp32": Run(None, lambda cfg: FixedScale(1.0)),
    "fp16-noscale": Run(torch.float16, lambda cfg: FixedScale(1.0)),
    "fp16-dynamic": Run(torch.float16, _dynamic),
    "fp16-predictive": Run(torch.float16, lambda cfg: PredictiveScale(init_scale=cfg.init_scale)),
    "bf16": Run(torch.bfloat16, lambda cfg: FixedScale(1.0)),
    "fast|step|0.9": Run(None, _dynamic, schedule="fast|step|0.9"),
}
QUICK_RUNS = ["fp32", "fp16-noscale", "fp16-dynamic", "fp16-predictive", "bf16"]


class Corpus(NamedTuple):
    """Character codes of the training and held-out files, and the files' names."""

    train: torch.Tensor
    heldout: torch.Tensor
    train_files: list[str]
    heldout_files: list[str]


def load_corpus(cfg: Config) -> Corpus:
    """``cfg.files`` top-level modules of the standard library, shuffled by ``cfg.seed``; the last tenth held out."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(glob.glob(os.path.join(root, "*.py")))
    random.Random(cfg.seed).shuffle(paths)
    chosen = paths[: max(2, cfg.files)]
    held = max(1, len(chosen) // 10)

    def encode(group: list[str]) -> torch.Tensor:
        text = "\n".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in group)
        return torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).long().clamp_max(VOCAB - 1)

    corpus = Corpus(encode(chosen[:-held]), encode(chosen[-held:]), chosen[:-held], chosen[-held:])
    if min(len(corpus.train), len(corpus.heldout)) <= cfg.context + 1:
        raise ValueError(
            f"the {len(chosen)} standard-library files at {root} hold too few characters for "
            f"--context {cfg.context}; read more --files or use a shorter --context."
        )
    return corpus


def batch(text: torch.Tensor, cfg: Config, update: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-character targets, ``[sequences, context]`` each: a function of (seed, update, micro) alone."""
    gen = torch.Generator().manual_seed(hash((cfg.seed, update, micro)) % 2**63)
    starts = torch.randint(0, len(text) - cfg.context - 1, (cfg.sequences,), generator=gen)
    window = text[starts[:, None] + torch.arange(cfg.context + 1)]
    return window[:, :-1], window[:, 1:]


class _Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.fc, self.out = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attended = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """``[batch, time]`` character codes to ``[batch, time, VOCAB]`` logits: GPT-2's layout and initialisation,
    no dropout (a run is a deterministic function of its seed)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.token, self.position = nn.Embedding(VOCAB, cfg.d_model), nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.Sequential(*(_Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers)))
        self.ln, self.head = nn.LayerNorm(cfg.d_model), nn.Linear(cfg.d_model, VOCAB)
        for name, p in self.named_parameters():  # normal(0, 0.02); residual projections / sqrt(2 * layers)
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        x = self.token(codes) + self.position(torch.arange(codes.shape[1], device=codes.device))
        return self.head(self.ln(self.blocks(x)))


def learning_rate(cfg: Config, update: int) -> float:
    """Linear warm-up over the first 10% of ``cfg.steps`` updates, then cosine decay to 10% of ``cfg.lr``."""
    warmup = max(1, cfg.steps // 10)
    if update < warmup:
        return cfg.lr * (update + 1) / warmup
    progress = (update - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean cross-entropy in nats per character, computed in float32."""
    return F.cross_entropy(model(x).float().view(-1, VOCAB), y.reshape(-1)).item()


def flushed_share(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, float]]:
    """Share of the gradient values of a float32 backward pass of ``(x, y)`` that are nonzero there but exactly
    zero in ``p.grad`` (the run's own backward pass of the same micro-batch), overall and by parameter."""
    names, params = zip(*model.named_parameters())
    with torch.autocast(x.device.type, enabled=False):
        reference = torch.autograd.grad(F.cross_entropy(model(x).view(-1, VOCAB), y.reshape(-1)), params)
    live = [int((r != 0).sum()) for r in reference]
    flushed = [int(((r != 0) & (p.grad == 0)).sum()) for p, r in zip(params, reference)]
    return sum(flushed) / max(1, sum(live)), {n: f / lv for n, f, lv in zip(names, flushed, live) if f}


class Curves(TypedDict):
    """A run's curves in results.json: ``[step, value]`` pairs, or one value per step."""

    heldout_loss: list[list[float]]
    underflow: list[list[float]]
    train_loss: list[float]
    scale: list[float]
    skipped: list[int]
    underflow_meter: list[float | None]
    lr: list[float]


class RunResult(TypedDict):
    """One run's entry of results.json."""

    name: str
    heldout_loss: float
    skipped_steps: int
    final_scale: float
    underflow: float
    underflow_peak: float
    seconds: float
    updates: int
    schedule: str | None
    switch_step: int | None
    underflow_peak_by_parameter: dict[str, float]
    curves: Curves


#: A worker's progress message: (run name, updates applied, loss, scale, skipped steps).
Progress = tuple[str, int, float, float, int]


def train_run(
    name: str,
    cfg: Config,
    corpus: Corpus | None = None,
    device: str = "cpu",
    csv_path: str | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
) -> RunResult:
    """Train run ``name`` of :data:`RUNS` from scratch; returns its numbers and curves (an entry of results.json).

    Every step is logged by :class:`lossscale.StepLogger` (to ``csv_path`` if given, with the step's mean
    training loss and learning rate); ``on_step(updates applied, row)`` follows each step.
    """
    run, corpus = RUNS[name], corpus or load_corpus(cfg)
    torch.manual_seed(cfg.seed)
    model = CharTransformer(cfg).to(device)
    inner = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8 * cfg.loss_factor, weight_decay=0.1, fused=True
    )
    schedule = PrecisionSchedule(run.schedule, total_steps=cfg.steps) if run.schedule else None
    opt = LossScaleOptimizer(
        inner, policy=run.policy(cfg), accumulation_steps=cfg.accumulation, schedule=schedule, underflow_stride=64
    )
    count = min(cfg.eval_characters, len(corpus.heldout) - 1) // cfg.context
    starts = torch.linspace(0, len(corpus.heldout) - cfg.context - 1, count).long()
    held = corpus.heldout[starts[:, None] + torch.arange(cfg.context + 1)].to(device)
    rows: list[dict[str, Any]] = []
    heldout: list[list[float]] = []
    underflow: list[list[float]] = []
    peak_by_parameter: dict[str, float] = {}
    seconds, applied, step = 0.0, 0, 0
    with StepLogger(csv_path) as log:
        while applied < cfg.steps and step < 2 * cfg.steps:
            began = time.perf_counter()
            if schedule is not None:
                schedule.update(step=applied)
            lr = learning_rate(cfg, applied)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad()
            loss_sum = torch.zeros((), device=device)
            for micro in range(cfg.accumulation):
                x, y = (t.to(device) for t in batch(corpus.train, cfg, applied, micro))
                with run.autocast(device, schedule):
                    logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))
                opt.backward(loss * cfg.loss_factor)  # LossScaleOptimizer divides by the accumulation steps
                loss_sum += loss.detach()
                if micro == 0 and (step % cfg.measure_every == 0 or applied == cfg.steps - 1):
                    measuring = time.perf_counter()
                    share, by_parameter = flushed_share(model, x, y)
                    if share > max((u for _, u in underflow), default=0.0):
                        peak_by_parameter = by_parameter
                    underflow.append([step, share])
                    began += time.perf_counter() - measuring
                result = opt.step()
            row = log.log(result, loss=loss_sum / cfg.accumulation, lr=lr)
            assert row is not None  # a boundary's step, never an accumulation micro-step
            seconds += time.perf_counter() - began
            rows.append(row)
            applied, step = applied + (not row["skipped"]), step + 1
            if applied == cfg.steps or step == 2 * cfg.steps or (not row["skipped"] and applied % cfg.eval_every == 0):
                heldout.append([step, heldout_loss(model, held[:, :-1], held[:, 1:])])
            if on_step is not None:
                on_step(applied, row)
    shares = [u for _, u in underflow]
    last = rows[-1]
    return {
        "name": name,
        "heldout_loss": heldout[-1][1],
        "skipped_steps": last["skipped_steps"],
        "final_scale": last["next_scale"] if last.get("precision") in (None, "float16") else 1.0,
        "underflow": sum(shares) / len(shares),
        "underflow_peak": max(shares),
        "seconds": seconds,
        "updates": applied,
        "schedule": run.schedule,
        "switch_step": None if schedule is None else schedule.switch_step,
        "underflow_peak_by_parameter": dict(sorted(peak_by_parameter.items(), key=lambda kv: -kv[1])),
        "curves": {
            "heldout_loss": heldout,
            "underflow": underflow,
            "train_loss": [r["loss"] for r in rows],
            "scale": [r["scale"] for r in rows],
            "skipped": [r["step"] for r in rows if r["skipped"]],
            "underflow_meter": [r["underflow"] for r in rows],
            "lr": [r["lr"] for r in rows],
        },
    }


_progress: Queue[Progress] | None = None  # a worker's end of the progress queue


def start_worker(progress: Queue[Progress]) -> None:
    """A worker process's initializer: one torch thread, and the queue its progress goes to."""
    global _progress
    _progress = progress
    torch.set_num_threads(1)


def train_in_worker(name: str, cfg: Config, device: str, csv_path: str) -> RunResult:
    """:func:`train_run` in a worker; after each step, ``(name, updates applied, loss, scale, skipped steps)``
    goes to the parent."""
    progress = _progress
    assert progress is not None  # start_worker ran first: the pool's initializer
    return train_run(
        name,
        cfg,
        None,
        device,
        csv_path,
        lambda applied, row: progress.put((name, applied, row["loss"], row["next_scale"], row["skipped_steps"])),
    )
