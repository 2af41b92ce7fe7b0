"""Overflow-check throughput (GB/s of gradients read) against the one-pass floors on the same tensors.

Contenders, all on the same float32 gradients (about 100 tensors):
  lossscale inf_nan check       overflow.check_(mode="inf_nan"): read-only, one pass
  lossscale saturation check    overflow.check_(mode="saturation"): read-only, one aminmax pass
  lossscale unscale+inf_nan     overflow.unscale_and_check_: one fused read+write pass
  torch unscale+check           torch._amp_foreach_non_finite_check_and_unscale_ (what GradScaler runs)
  floor: _foreach_norm          a foreach read pass (L2)
  floor: per-tensor sum         a plain read pass
  floor: _foreach_mul_          a read+write pass

    python benchmarks/overflow_check.py --millions 50
    python benchmarks/overflow_check.py --device cuda --millions 500
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device_argument, alternate, checked_device, emit, machine, synchronizer, table
from lossscale.ops.overflow import check_, unscale_and_check_


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--millions", type=float, default=50.0, help="float32 values in all")
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json", default=None)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    total = 20_000 if args.tiny else int(args.millions * 10**6)
    torch.manual_seed(0)
    grads = [torch.randn(total // args.tensors, device=device) for _ in range(args.tensors)]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    found = torch.zeros((), device=device)
    one = torch.ones((), device=device)

    contenders = {
        "lossscale inf_nan check": lambda: check_(grads, found, "inf_nan"),
        "lossscale saturation check": lambda: check_(grads, found, "saturation"),
        "lossscale unscale+inf_nan": lambda: unscale_and_check_(grads, found, one, "inf_nan"),
        "torch unscale+check": lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one),
        "floor: _foreach_norm": lambda: torch._foreach_norm(grads),
        "floor: per-tensor sum": lambda: [g.sum() for g in grads],
        "floor: _foreach_mul_": lambda: torch._foreach_mul_(grads, one),
    }
    t = alternate(contenders, 2 if args.tiny else args.rounds, sync=synchronizer(device))
    read_floor = min(t["floor: _foreach_norm"], t["floor: per-tensor sum"])
    rows = []
    for name, secs in t.items():
        rows.append(
            {"pass": name, "ms": secs * 1e3, "GB/s": nbytes / secs / 1e9, "vs best read floor": read_floor / secs}
        )
    summary = {
        "saturation / inf_nan time": t["lossscale saturation check"] / t["lossscale inf_nan check"],
        "inf_nan check bandwidth / _foreach_norm floor": t["floor: _foreach_norm"] / t["lossscale inf_nan check"],
        "inf_nan check bandwidth / best read floor": read_floor / t["lossscale inf_nan check"],
        "saturation check bandwidth / best read floor": read_floor / t["lossscale saturation check"],
    }
    md = (
        f"Device: {device}. {nbytes / 1e6:.0f} MB of float32 gradients in {args.tensors} tensors.\n\n"
        + table(rows, ["pass", "ms", "GB/s", "vs best read floor"])
        + "\n\n"
        + table([{"ratio": k, "value": v} for k, v in summary.items()], ["ratio", "value"])
    )
    payload = {"machine": machine(device), "rows": rows, "summary": summary, "markdown": md}
    emit("overflow_check", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
