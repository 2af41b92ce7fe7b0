"""Float16 training that heals itself: a GPT-2 whose feed-forward output passes 65504 partway through training.

    python examples/heal.py [--plot heal.png]

A 6-block GPT-2 is built from a ``GPT2Config`` (nothing is downloaded) and trained on token sequences of a fixed
bigram table. From step ``FAULT_AT`` one block's feed-forward output projection grows (multiplied by 8 at each of 8
steps) until its float16 output passes 65504: the forward gives inf, then NaN.

- ``torch.amp.GradScaler`` halves the scale at every step after that (it cannot tell a forward fault from a gradient
  overflow), down to its floor, and skips every step to the end: the run looks alive and learns nothing.
- ``lossscale.GradScaler(diagnose=model, heal=True)``: the second non-finite loss fires the trace, the step after next
  is traced, the block's ``mlp.c_proj`` is named, kept in float32 (its outputs too), with a ``HealWarning``; the
  scale never moved (a forward fault is not shown to the policy), and training goes on.
- float32 training, the reference.

Prints each run's final held-out loss, skipped steps and scale; ``--plot`` draws the loss and the scale over steps
(needs matplotlib). Needs transformers (in a clone of this repository: ``pip install '.[transformers,demo]'``).
Under a minute on a CPU.
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
import torch.nn.functional as F

import lossscale

VOCAB = 128
STEPS = 80
FAULT_AT = 30
BLOCK = 3  # the block whose feed-forward output grows
GROWTH = 8.0  # its output projection is multiplied by this at each of 8 steps


def build() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=6, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def batch(index: int, size: int = 8, length: int = 32) -> torch.Tensor:
    """Sequences of a fixed bigram table: each token has 3 likely successors (the loss can fall to about 1)."""
    successors = torch.randint(0, VOCAB, (VOCAB, 3), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(10_000 + index)
    ids = torch.empty(size, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (size,), generator=g)
    for t in range(1, length):
        choice = torch.multinomial(torch.tensor([0.6, 0.3, 0.1]).expand(size, 3), 1, generator=g).squeeze(1)
        ids[:, t] = successors[ids[:, t - 1], choice]
    return ids


def loss_of(model: torch.nn.Module, ids: torch.Tensor, float16: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16, enabled=float16):
        logits = model(ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def train(run: str) -> dict:
    """One run: ``"torch"``, ``"heal"`` or ``"float32"``; its losses, scales, skipped steps and held-out loss."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = {
        "torch": lambda: torch.amp.GradScaler("cpu"),
        "heal": lambda: lossscale.GradScaler("cpu", diagnose=model, heal=True),
        "float32": lambda: None,
    }[run]()
    out: dict = {"losses": [], "scales": [], "skipped": 0, "healed_at": []}
    for step in range(STEPS):
        if FAULT_AT <= step < FAULT_AT + 8:
            with torch.no_grad():
                model.transformer.h[BLOCK].mlp.c_proj.weight.mul_(GROWTH)
        loss = loss_of(model, batch(step), float16=scaler is not None)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            decision = scaler.step(opt)
            scaler.update()
            if run == "heal":
                out["skipped"] += not bool(decision.stepped)
                if scaler.last_fields.get("healed_modules"):
                    out["healed_at"].append(step)
            else:
                out["skipped"] += scaler.get_scale() < before  # torch's rule backs off at every step it skips
        opt.zero_grad()
        out["losses"].append(float(loss.detach()))
        out["scales"].append(scaler.get_scale() if scaler is not None else math.nan)
    with torch.no_grad():
        out["held_out"] = sum(float(loss_of(model, batch(-1 - i), scaler is not None)) for i in range(4)) / 4
    if run == "heal":
        out["healed"] = {name: str(dtype) for name, dtype in scaler.add_ons[0].healed.items()}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", help="draw the loss and the scale over steps to this file (needs matplotlib)")
    args = parser.parse_args(argv)
    runs = {}
    for run in ("torch", "heal", "float32"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", lossscale.OverflowWarning)
            runs[run] = train(run)
        for w in caught:
            if issubclass(w.category, lossscale.HealWarning):
                print(f"HealWarning: {str(w.message).splitlines()[0]}")
    for run, r in runs.items():
        scale = "-" if run == "float32" else f"{r['scales'][-1]:g}"
        print(f"{run:8s} held-out loss {r['held_out']:.4f}  skipped {r['skipped']:3d} of {STEPS}  final scale {scale}")
    print(f"kept by healing: {runs['heal']['healed']}")
    if args.plot:
        draw(runs, args.plot)
        print(f"wrote {args.plot}")
    return runs


def draw(runs: dict, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.5), layout="constrained")
    loss_ax, scale_ax = fig.subplots(2, 1, sharex=True)
    styles = {
        "torch": ("torch.amp.GradScaler", "tab:red"),
        "heal": ("lossscale.GradScaler(diagnose=model, heal=True)", "tab:blue"),
        "float32": ("float32", "0.45"),
    }
    for run, r in runs.items():
        label, color = styles[run]
        dashed = {"ls": "--", "zorder": 3} if run == "torch" else {}  # on top, where the runs agree
        loss_ax.plot(
            [v if math.isfinite(v) else math.nan for v in r["losses"]], color=color, label=label, lw=1.2, **dashed
        )
        if run != "float32":
            scale_ax.semilogy(r["scales"], color=color, label=label, lw=1.2)
    for step in runs["heal"]["healed_at"]:
        for ax in (loss_ax, scale_ax):
            ax.axvline(step, color="tab:blue", ls=":", lw=1)
    loss_ax.axvspan(FAULT_AT, FAULT_AT + 8, color="0.92", label="the feed-forward output grows")
    loss_ax.set_ylabel("training loss (gaps: inf or NaN)")
    loss_ax.legend(loc="upper right", fontsize=8)
    scale_ax.set_ylabel("loss scale")
    scale_ax.set_xlabel("step (dotted: the heal)")
    scale_ax.legend(loc="lower left", fontsize=8)
    fig.suptitle(f"GPT-2, 6 blocks: block {BLOCK}'s feed-forward output passes float16's 65504 from step ~{FAULT_AT}")
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
