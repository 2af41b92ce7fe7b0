"""Host reads per training step (counted, not timed): ``aten._local_scalar_dense`` calls, the op behind
``.item()``/``bool(tensor)``; on a GPU each one of a device tensor waits for the device.

Counts the reads of the loss-scaling calls only (scale/unscale_/step/update, or LossScaleOptimizer.step),
minus the reads the bare optimizer makes by itself (Adam reads its step counters, CPU tensors unless
capturable), averaged over clean and overflowing steps. On a CUDA device, also the host synchronisations of
the same calls, counted with ``torch.cuda.set_sync_debug_mode("warn")`` (a read of a CPU tensor is none; a copy
of a device tensor to the host is one). Masked mode with a step counter in host memory is refused there (a
ValueError), and its row says so.

    python benchmarks/host_reads.py
    python benchmarks/host_reads.py --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lossscale
from _common import add_device_argument, checked_device, emit, machine, table
from lossscale import LossScaleOptimizer
from lossscale.testing import HostReadCounter

OPTIMIZERS = {
    "fused AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "foreach Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
}
CUDA_OPTIMIZERS = {"capturable foreach Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True, capturable=True)}
PATTERN = [False, False, True, False, True, True, False, False]


def model(device: str):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(device)


class Counted:
    """Host reads (and, on CUDA, host synchronisations) of the calls made inside ``with counted.on():``, summed."""

    def __init__(self, device: str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.reads = 0
        self.syncs = 0

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        with HostReadCounter() as reads, warnings.catch_warnings(record=True) as caught:
            if self.cuda:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if self.cuda:
                    torch.cuda.set_sync_debug_mode("default")
        self.reads += reads.count
        # torch's warning per sync, not its once-per-process notice that the debug mode is a prototype
        self.syncs += sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def bare_reads(opt_name: str, device: str) -> tuple[int, int]:
    """(reads, syncs) of the bare optimizer's steady step."""
    m = model(device)
    opt = _optimizers(device)[opt_name](m.parameters())
    for _ in range(4):
        m(torch.ones(2, 16, device=device)).sum().backward()
        counted = Counted(device)
        with counted.on():
            opt.step()
    return counted.reads, counted.syncs


def scaler_reads(scaler_cls, opt_name: str, device: str) -> tuple[float, float, float]:
    """(reads, reads added by loss scaling, syncs added by loss scaling) per step."""
    m = model(device)
    opt = _optimizers(device)[opt_name](m.parameters())
    scaler = scaler_cls(torch.device(device).type)
    bare, bare_syncs = bare_reads(opt_name, device)
    total = added = syncs = 0
    for inf in PATTERN:
        opt.zero_grad()
        counted = Counted(device)
        with counted.on():
            loss = scaler.scale(m(torch.ones(2, 16, device=device)).sum())
        loss.backward()
        if inf:
            m[0].weight.grad[0, 0] = float("inf")
        with counted.on():
            scaler.step(opt)
            scaler.update()
        stepped_inner = not inf or getattr(opt, "_step_supports_amp_scaling", False)
        total += counted.reads
        added += counted.reads - (bare if stepped_inner else 0)
        syncs += counted.syncs - (bare_syncs if stepped_inner else 0)
    return total / len(PATTERN), added / len(PATTERN), syncs / len(PATTERN)


def wrapper_reads(opt_name: str, skip_mode: str, clip: bool, device: str) -> tuple[float, float, float] | str | None:
    """(reads, reads added, syncs added) per step; None where the skip mode does not take the optimizer; the
    error's first words where masked mode refuses its state."""
    m = model(device)
    try:
        opt = LossScaleOptimizer(
            _optimizers(device)[opt_name](m.parameters()), skip_mode=skip_mode, clip_grad_norm=1.0 if clip else None
        )
    except ValueError:
        return None
    bare, bare_syncs = bare_reads(opt_name, device)
    total = added = syncs = 0
    counted_steps = 0
    for i, inf in enumerate([False] + PATTERN):
        opt.zero_grad()
        opt.backward(m(torch.ones(2, 16, device=device)).sum())
        if inf:
            m[0].weight.grad[0, 0] = float("inf")
        counted = Counted(device)
        try:
            with counted.on():
                opt.step()
        except ValueError:  # masked mode and a step counter in host memory beside a GPU's found_inf
            return "refused: a state tensor in host memory"
        if i == 0:
            continue  # masked mode decides the very first step (which creates optimizer state) on the host
        inner_called = not (inf and opt.skip_mode == "host")
        total += counted.reads
        added += counted.reads - (bare if inner_called else 0)
        syncs += counted.syncs - (bare_syncs if inner_called else 0)
        counted_steps += 1
    return total / counted_steps, added / counted_steps, syncs / counted_steps


def _optimizers(device: str) -> dict:
    return {**OPTIMIZERS, **CUDA_OPTIMIZERS} if torch.device(device).type == "cuda" else OPTIMIZERS


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="(same sizes; accepted for symmetry)")
    parser.add_argument("--json", default=None)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    cuda = torch.device(device).type == "cuda"
    rows = []
    for opt_name in _optimizers(device):
        for label, cls in [
            ("torch.amp.GradScaler", torch.amp.GradScaler),
            ("lossscale.GradScaler", lossscale.GradScaler),
        ]:
            total, added, syncs = scaler_reads(cls, opt_name, device)
            rows.append(
                {
                    "optimizer": opt_name,
                    "loss scaling": label,
                    "skip mode": "(torch's)",
                    "reads per step": total,
                    "added by loss scaling": added,
                    "syncs added": syncs if cuda else "-",
                }
            )
        for skip_mode in ("fused", "host", "masked"):
            for clip in (False, True):
                got = wrapper_reads(opt_name, skip_mode, clip, device)
                if got is None:
                    continue
                label = "LossScaleOptimizer" + (" + clip" if clip else "")
                if isinstance(got, str):
                    rows.append(
                        {
                            "optimizer": opt_name,
                            "loss scaling": label,
                            "skip mode": skip_mode,
                            "reads per step": got,
                            "added by loss scaling": "-",
                            "syncs added": "-",
                        }
                    )
                    continue
                rows.append(
                    {
                        "optimizer": opt_name,
                        "loss scaling": label,
                        "skip mode": skip_mode,
                        "reads per step": got[0],
                        "added by loss scaling": got[1],
                        "syncs added": got[2] if cuda else "-",
                    }
                )
    md = (
        f"Device: {device}. Per step, averaged over {len(PATTERN)} steps of which {sum(PATTERN)} overflow; "
        f"*syncs added*: host synchronisations of the loss-scaling calls beyond the bare step's (CUDA only, "
        f"torch.cuda.set_sync_debug_mode).\n\n"
        + table(
            rows, ["optimizer", "loss scaling", "skip mode", "reads per step", "added by loss scaling", "syncs added"]
        )
    )
    payload = {"machine": machine(device), "rows": rows, "markdown": md}
    emit("host_reads", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
