"""Find why a T5 breaks in float16, and fix it: the gated feed-forward's activations pass 65504.

    python examples/float16_overflow.py [--plot magnitudes.png]

T5's failure in float16 is well known: in trained checkpoints the gated feed-forward (``wo(gelu(wi_0 x) * wi_1 x)``)
makes products past float16's 65504 while ``wo`` maps them back down, so the forward gives inf and then NaN, and a
loss scaler only lowers its scale step after step ("overflow detected, setting loss scale to ...") until its floor.
Here a tiny T5 is built from a ``T5Config`` (nothing is downloaded) and one encoder block's feed-forward gets such
weights: ``wi_0`` and ``wi_1`` multiplied by ``c``, ``wo`` divided by ``c**2``. ``find_overflow`` names that module,
and ``keep_float32`` on it makes the same batch finite. Needs transformers (in a clone of this repository:
``pip install '.[transformers]'``; with ``--plot``, ``pip install '.[transformers,demo]'`` for matplotlib); seconds
on a CPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from lossscale.diagnosis import OverflowReport, find_overflow, keep_float32

FACTOR = 300.0  # how far the planted feed-forward's input weights grew


def build_t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = T5ForConditionalGeneration(config)
    ff = model.encoder.block[1].layer[1].DenseReluDense
    with torch.no_grad():
        ff.wi_0.weight.mul_(FACTOR)
        ff.wi_1.weight.mul_(FACTOR)
        ff.wo.weight.div_(FACTOR**2)
    return model


def main(argv: list[str] | None = None) -> tuple[OverflowReport, OverflowReport]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", help="also draw the magnitudes to this file (needs matplotlib)")
    args = parser.parse_args(argv)

    model = build_t5()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    ids = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(1)).to(device)

    def closure() -> torch.Tensor:
        with torch.autocast(device, dtype=torch.float16):
            return model(input_ids=ids, labels=ids).loss

    report = find_overflow(model, closure, scale=2.0**10)
    print(report)
    if args.plot:
        report.plot(args.plot)
        print(f"magnitudes drawn to {args.plot}")
    print(f"\nfix: keep_float32(model.get_submodule({report.module!r}))\n")
    with keep_float32(model.get_submodule(report.module)):
        fixed = find_overflow(model, closure, scale=2.0**10)
        print(fixed.summary + f"; max_safe_scale={fixed.max_safe_scale}")
    return report, fixed


if __name__ == "__main__":
    main(sys.argv[1:])
