"""Healing on real architectures: GPT-2 and Llama built from transformers configs (no download), a fault of each kind
planted partway through training, three runs each: torch.amp.GradScaler, lossscale with ``heal=True``, and float32
skipping the same bad batches.

    python benchmarks/heal.py [--steps 320] [--fault-at 60] [--layers 12] [--tiny] [--json PATH]

The faults (each from step ``--fault-at``; ``none`` plants nothing: what float16 training itself costs against
float32 here, its scale's own search and overflows included):

- ``ff_overflow``: one block's feed-forward output grows past 65504: its output projection (GPT-2 ``mlp.c_proj``,
  Llama ``mlp.down_proj``) is multiplied by 4 at each of 8 steps.
- ``nan_op``: one block's attention scores pass 65504 in float16 (its query and key projections multiplied once), and
  the softmax over them makes NaN: an op that makes NaN in float16 only (eager attention, whose matmul and softmax
  are the attention module's own code).
- ``bad_batches``: 6 batches carry a NaN in their input embeddings (a corrupted feature pipeline), one every 4 steps.
- ``loss_overflow``: for 8 steps a term of the loss is a float16 sum past 65504 (a z-loss summed in float16), its
  gradients finite.

With ``none`` a second float32 run moves the learning rate by one part in a million: how far two float32 runs
end from each other here, the yardstick for *vs float32*. 320 steps, because at 160 the loss is still falling
steeply and such a run ends 1% away; float16 with no fault ended 2.5% behind float32 at 160 steps and 0.1% at 320.

Per run: the final held-out loss (each run in its own precision: float16 autocast with the healed modules, or
float32), the steps skipped, the scale at the end, the modules healing kept, and the step time before the fault and
after the heal (medians; the ratio is the cost of the module kept in float32). The float32 run skips the batches that
are bad for every precision (``bad_batches``). Timings are wall-clock medians in one process on the machine printed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine, table
from lossscale import GradScaler, HealError, OverflowWarning

VOCAB = 128
FAULTS = ("none", "ff_overflow", "nan_op", "bad_batches", "loss_overflow")
RUNS = ("torch", "heal", "float32")
SPREAD = "float32, lr x (1 + 1e-6)"  # with ``none`` only
JSON_ONLY = ("scales at heals",)  # in the JSON rows, not the table
ARCHITECTURES = ("gpt2", "llama")


def build(arch: str, layers: int, d: int) -> torch.nn.Module:
    """A causal language model from a transformers config, seeded, eager attention (its scores are the attention
    module's own code)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=d, n_layer=layers, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, attn_implementation="eager", bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, attn_implementation="eager", bos_token_id=0,
        eos_token_id=0, pad_token_id=None,
    )  # fmt: skip
    # No padding row: token 0 is data here. A padding row is zero and frozen, and a sequence that starts with it
    # keeps a zero residual stream through every block, whose RMSNorm backward multiplies the gradient by
    # 1/sqrt(eps) = 1000 per block: float16 gradients past 65504 that only the benchmark made.
    return LlamaForCausalLM(config)


def block_parts(model: torch.nn.Module, arch: str, block: int) -> tuple[torch.nn.Linear, list[torch.Tensor]]:
    """The feed-forward output projection of ``block`` and the weights of its query and key projections."""
    if arch == "gpt2":
        h = model.transformer.h[block]
        d = h.attn.c_attn.weight.shape[0]
        return h.mlp.c_proj, [h.attn.c_attn.weight[:, : 2 * d]]  # Conv1D: (in, 3 * out), q and k first
    layer = model.model.layers[block]
    return layer.mlp.down_proj, [layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight]


class Bigrams:
    """Token sequences from a fixed sparse transition table (each token has 3 likely successors): learnable by a
    small model in a hundred steps, its loss falling from ln(VOCAB) to about 1."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.next = torch.randint(0, VOCAB, (VOCAB, 3), generator=g)
        self.probs = torch.tensor([0.6, 0.3, 0.1])

    def batch(self, index: int, size: int = 8, length: int = 32) -> torch.Tensor:
        g = torch.Generator().manual_seed(10_000 + index)
        ids = torch.empty(size, length, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (size,), generator=g)
        for t in range(1, length):
            choice = torch.multinomial(self.probs.expand(size, 3), 1, generator=g).squeeze(1)
            ids[:, t] = self.next[ids[:, t - 1], choice]
        return ids


@dataclass
class Run:
    """What one run measured."""

    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    held_out: float = math.nan
    kept: dict[str, str] = field(default_factory=dict)
    heal_steps: list[int] = field(default_factory=list)
    heal_scales: list[float] = field(default_factory=list)  # the scale right after each heal (the one it restored)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None


def plant(
    model: torch.nn.Module, arch: str, fault: str, step: int, fault_at: int, block: int, growth_steps: int = 8
) -> None:
    """The weight changes of ``fault`` at ``step`` (the same in every run)."""
    ff, qk = block_parts(model, arch, block)
    with torch.no_grad():
        if fault == "ff_overflow" and fault_at <= step < fault_at + growth_steps:
            ff.weight.mul_(8.0 ** (8 / growth_steps))  # 8**8 in all
        if fault == "nan_op" and step == fault_at:
            for w in qk:
                w.mul_(1000.0)


def bad_batch(fault: str, step: int, fault_at: int) -> bool:
    return fault == "bad_batches" and fault_at <= step < fault_at + 24 and (step - fault_at) % 4 == 0


def loss_of(model, ids, precision, fault, step, fault_at, bad):
    embeds = model.get_input_embeddings()(ids)
    if bad:
        embeds = embeds.clone()
        embeds[0, 0, 0] = float("nan")  # a corrupted feature pipeline
    with torch.autocast("cpu", dtype=torch.float16, enabled=precision == "float16"):
        logits = model(inputs_embeds=embeds).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        if fault == "loss_overflow" and fault_at <= step < fault_at + 8:
            z = (16 * logits.to(torch.float16 if precision == "float16" else torch.float32)).pow(2).sum()
            loss = loss + 1e-8 * z.float()  # in float16 the sum passes 65504: inf, its gradients finite
    return loss


def held_out_loss(model, data: Bigrams, precision: str) -> float:
    model.eval()
    with torch.no_grad():
        losses = [float(loss_of(model, data.batch(-1 - i), precision, "", 0, 0, False)) for i in range(4)]
    model.train()
    return statistics.mean(losses)


def train(arch: str, fault: str, run: str, args) -> Run:
    model = build(arch, args.layers, args.d_model)
    block = args.layers // 2
    data = Bigrams()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3 * (1 + 1e-6) if run == SPREAD else 3e-3)
    out = Run()
    precision = "float32" if run in ("float32", SPREAD) else "float16"
    scaler: Any = None
    if run == "torch":
        scaler = torch.amp.GradScaler("cpu")
    elif run == "heal":
        scaler = GradScaler("cpu", diagnose=model, heal=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(args.steps):
                plant(model, arch, fault, step, args.fault_at, block, args.growth_steps)
                bad = bad_batch(fault, step, args.fault_at)
                ids = data.batch(step)
                start = time.perf_counter()
                loss = loss_of(model, ids, precision, fault, step, args.fault_at, bad)
                if scaler is None:  # float32: skip the batches that are bad at every precision
                    skipped = bad
                    if not bad:
                        loss.backward()
                        opt.step()
                else:
                    scale = scaler.get_scale()
                    scaler.scale(loss).backward()
                    decision = scaler.step(opt)
                    scaler.update()
                    # torch's rule backs off at every step it skips; ours says so
                    skipped = scaler.get_scale() < scale if run == "torch" else not bool(decision.stepped)
                    if run == "heal" and scaler.last_fields.get("healed_modules"):
                        out.heal_steps.append(step)
                        out.heal_scales.append(scaler.get_scale())
                opt.zero_grad()
                out.times.append(time.perf_counter() - start)
                out.losses.append(float(loss.detach()))
                out.skipped.append(bool(skipped))
                out.scales.append(scaler.get_scale() if scaler is not None else 1.0)
        except HealError as err:
            out.error = str(err).splitlines()[0][:160]
    out.held_out = held_out_loss(model, data, precision)
    if run == "heal":
        out.kept = {name: str(dtype).replace("torch.", "") for name, dtype in scaler.add_ons[0].healed.items()}
    out.warnings = [str(w.message).splitlines()[0][:160] for w in caught if issubclass(w.category, OverflowWarning)]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--fault-at", type=int, default=60)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--architectures", default=",".join(ARCHITECTURES))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--tiny", action="store_true", help="a seconds-long run (tests)")
    parser.add_argument("--json", default=None, help="write the rows, the machine and the table here (run_all.py)")
    args = parser.parse_args(argv)
    args.growth_steps = 8
    if args.tiny:  # the feed-forward grows in 2 steps, the faults come at step 2: healed by step 6 of 12
        args.steps, args.fault_at, args.layers, args.d_model, args.growth_steps = 12, 2, 2, 32, 2
        args.faults = ",".join(f for f in args.faults.split(",") if f != "none")
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    rows = []
    for arch in args.architectures.split(","):
        for fault in args.faults.split(","):
            runs = RUNS + ((SPREAD,) if fault == "none" else ())
            found = {run: train(arch, fault, run, args) for run in runs}
            reference = found["float32"].held_out
            for run, r in found.items():
                before = r.times[max(0, args.fault_at - 40) : args.fault_at]
                after_from = (r.heal_steps[-1] + 2) if r.heal_steps else args.fault_at + 30
                after = r.times[after_from:]
                rows.append(
                    {
                        "model": arch,
                        "fault": fault,
                        "run": run,
                        "held-out loss": r.held_out,
                        "vs float32": r.held_out / reference - 1 if math.isfinite(r.held_out) else math.nan,
                        "skipped": sum(r.skipped),
                        "final scale": r.scales[-1] if run in ("torch", "heal") else "-",
                        "kept": ", ".join(f"{n} ({d})" for n, d in r.kept.items()) or "-",
                        "healed at": ", ".join(map(str, r.heal_steps)) or "-",
                        "scales at heals": r.heal_scales,
                        "ms before": 1e3 * statistics.median(before) if before else math.nan,
                        "ms after": 1e3 * statistics.median(after) if after else math.nan,
                        "ended": r.error or "completed",
                    }
                )
    for row in rows:
        row["after / before"] = row["ms after"] / row["ms before"]
    columns = [c for c in rows[0] if c not in JSON_ONLY]
    fmt = [{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()} for row in rows]
    md = (
        f"Device: cpu. {args.layers} blocks, d={args.d_model}, vocabulary {VOCAB}, batch 8x32, AdamW lr 3e-3, "
        f"{args.steps} steps, the fault from step {args.fault_at} in block {args.layers // 2}. *held-out loss*: 4 "
        f"held-out batches at the end, each run in its own precision; *vs float32*: relative to the float32 run "
        f"(*{SPREAD}*: the float32 run again, its learning rate moved by one part in a million: how far two float32 "
        f"runs end apart); *skipped*: steps skipped; *kept*: the modules healing kept and their precision; *ms before "
        f"/ after*: median step time over the 40 steps before the fault and the steps after the last heal (after "
        f"step {args.fault_at + 30} where nothing was healed).\n\n" + table(fmt, columns)
    )
    payload = {"machine": machine("cpu"), "rows": rows, "markdown": md}
    emit("heal", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
