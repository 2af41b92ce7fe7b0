"""What overflow diagnosis costs: a healthy training step with the OverflowDiagnosis add-on against the same step
without it, the traced step against a plain one, and one find_overflow call against one step.

    python benchmarks/diagnosis.py [--device cuda] [--repeats 7] [--steps 30] [--tiny] [--json PATH]

The last two rows step the same model through LossScaleOptimizer with ``diagnose=`` alone and with ``heal=True``
beside it, and give their ratio in the same round: what healing costs a healthy step.

The step is a float16-autocast transformer encoder (torch.nn.TransformerEncoderLayer blocks) trained by a small
loop that calls the add-on's hooks in a front end's order (on_loss, after_step; check and unscale with
torch's fused kernel, a skip without host read, the policy's update). Variants run interleaved, round after round,
and the median per-step time of each is reported with the ratio. No number is asserted; the machine is printed.
run_all.py writes its table into RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine, table
from lossscale import presets
from lossscale.addons.base import StepOutcome
from lossscale.diagnosis import OverflowDiagnosis, find_overflow
from lossscale.diagnosis.trace import Tracer


class Encoder(nn.Module):
    def __init__(self, d: int, layers: int, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            [nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True) for _ in range(layers)]
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Loop:
    """One training step, with or without the add-on's hooks."""

    def __init__(self, model: nn.Module, device: str, addon: OverflowDiagnosis | None) -> None:
        self.model, self.device, self.addon = model, device, addon
        self.params = list(model.parameters())
        self.policy = presets.torch_amp(init_scale=2.0**12, growth_interval=10**6)
        self.state = self.policy.init(device)
        self.steps = 0

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device, dtype=torch.float16):
            logits = self.model(ids)
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())

    def step(self, ids: torch.Tensor) -> None:
        loss = self.loss(ids)
        scale = self.state.scale
        scaled = loss * scale
        if self.addon is not None:
            self.addon.on_loss(loss, True)
        scaled.backward()
        grads = [p.grad for p in self.params]
        found = torch.zeros(1, device=self.device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, scale.reciprocal().reshape(1))
        found_inf = found.reshape(()) > 0
        with torch.no_grad():
            torch._foreach_add_(self.params, torch._foreach_mul(grads, torch.where(found_inf, 0.0, -1e-4)))
        for p in self.params:
            p.grad = None
        self.state = self.policy.update(self.state, found_inf.float())
        if self.addon is not None:
            self.addon.after_step(StepOutcome(~found_inf, found_inf, scale, self.state.scale, self.steps))
        self.steps += 1


def timed(fn, steps: int, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--size", default="256,4,16,64", help="d_model,layers,batch,sequence (default %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long run (tests)")
    parser.add_argument("--json", default=None, help="write the rows, the machine and the table here (run_all.py)")
    args = parser.parse_args(argv)
    d, layers, batch, seq = (32, 1, 2, 8) if args.tiny else tuple(int(v) for v in args.size.split(","))
    repeats, steps = (2, 2) if args.tiny else (args.repeats, args.steps)
    device = args.device
    torch.manual_seed(0)
    base = Encoder(d, layers).to(device)
    ids = torch.randint(0, 256, (batch, seq), device=device)
    plain = Loop(base, device, None)
    with_addon = Loop(base, device, OverflowDiagnosis(base))
    traced = Loop(base, device, None)

    def traced_step():  # the hooks the add-on puts on for its traced step, read at the end as it does
        tracer = Tracer(base)
        traced.addon = None
        traced.step(ids)
        tracer.remove()
        tracer.report(1.0)

    def diagnose():
        find_overflow(base, lambda: plain.loss(ids), scale=2.0**12)

    # the add-on's own work on a healthy step, alone: its two hooks on the step's real tensors
    addon = OverflowDiagnosis(base)
    loss = plain.loss(ids).detach()
    found_inf = torch.zeros((), dtype=torch.bool, device=device)
    outcome = StepOutcome(~found_inf, found_inf, plain.state.scale, plain.state.scale, 0)

    def hooks_only():
        addon.on_loss(loss, True)
        addon.after_step(outcome)

    # the real front end: LossScaleOptimizer with diagnose= alone, and with heal=True beside it (which adds the
    # forward-fault check: the loss's finiteness on the device, agreed with found_inf, and the policy's masked
    # update); both over the same model, healthy steps
    from lossscale import DynamicScale, LossScaleOptimizer

    def front_end(heal: bool) -> LossScaleOptimizer:
        inner = torch.optim.SGD(base.parameters(), lr=1e-5)
        policy = DynamicScale(init_scale=2.0**12, growth_interval=10**6)
        return LossScaleOptimizer(inner, policy=policy, diagnose=base, heal=heal)

    diagnosed, healing = front_end(False), front_end(True)

    def front_end_step(opt: LossScaleOptimizer) -> None:
        opt.backward(plain.loss(ids))
        opt.step()
        opt.zero_grad()

    variants = {
        "plain step": (lambda: plain.step(ids), steps),
        "step with OverflowDiagnosis": (lambda: with_addon.step(ids), steps),
        "traced step": (traced_step, steps),
        "find_overflow call": (diagnose, 1),
        "the add-on's hooks alone": (hooks_only, 20 * steps),
        "LossScaleOptimizer, diagnose=": (lambda: front_end_step(diagnosed), steps),
        "LossScaleOptimizer, diagnose= and heal=True": (lambda: front_end_step(healing), steps),
    }
    for fn, _ in variants.values():  # warm-up
        timed(fn, 1, device)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):  # interleaved: each round times every variant, so a busy machine slows all of them
        for name, (fn, n) in variants.items():
            times[name].append(timed(fn, n, device))
    medians = {name: statistics.median(v) for name, v in times.items()}
    # each variant's ratio to the plain step of the same round, then the median over rounds
    ratios = {name: statistics.median(t / p for t, p in zip(v, times["plain step"])) for name, v in times.items()}
    rows = [
        {"variant": name, "ms": value * 1e3, "x plain step (same round)": ratios[name]}
        for name, value in medians.items()
    ]
    heal_cost = statistics.median(
        h / d
        for h, d in zip(times["LossScaleOptimizer, diagnose= and heal=True"], times["LossScaleOptimizer, diagnose="])
    )
    rows[-1]["x diagnose= alone (same round)"] = heal_cost
    md = (
        f"Device: {device}. A float16-autocast encoder d={d} x{layers}, batch {batch}x{seq}; median of {repeats} "
        f"interleaved rounds of {steps} steps (find_overflow: one call a round):\n\n"
        + table(
            [{k: f"{v:.3f}" if isinstance(v, float) else v for k, v in row.items()} for row in rows],
            [*rows[0], "x diagnose= alone (same round)"],
        )
    )  # three decimals: a 1% cost must show
    payload = {"machine": machine(device), "rows": rows, "markdown": md}
    emit("diagnosis", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
