"""Masked skip: peak extra memory and time per step, against the host skip, in fresh processes.

Each configuration runs in its own process (peak RSS, ``VmHWM``): the same parameters,
gradients and optimizer, stepped through ``LossScaleOptimizer`` with ``skip_mode="host"`` (the reference:
no snapshot), ``"masked"`` in chunks (the default: a pool of 0.25x the parameters' bytes) and ``"masked"``
with the whole snapshot (``MaskedSkip(budget=None)``, what any other optimizer gets). Reported: peak RSS
above the host skip's, as a multiple of the parameters' bytes, the snapshot bytes the skip holds
(counted), and the median time per step. On a CUDA device the peak is the device's
(``torch.cuda.max_memory_allocated``), Adam and AdamW keep their step counters there (``capturable=True``, which
masked mode requires on a GPU), and each step is timed between two ``torch.cuda.synchronize()``.

    python benchmarks/masked_memory.py               # 100M parameters in 100 tensors
    python benchmarks/masked_memory.py --size 20
    python benchmarks/masked_memory.py --device cuda --size 1000
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device_argument, checked_device, emit, machine, synchronizer, table

OPTIMIZERS = {
    "foreach Adam": lambda ps, gpu: torch.optim.Adam(ps, lr=1e-8, foreach=True, capturable=gpu),
    "foreach AdamW": lambda ps, gpu: torch.optim.AdamW(ps, lr=1e-8, foreach=True, capturable=gpu),
    "SGD momentum": lambda ps, gpu: torch.optim.SGD(ps, lr=1e-8, momentum=0.9, foreach=True),
}
WAYS = ["host", "masked, chunked", "masked, whole"]


def child(total: int, opt_name: str, way: str, steps: int, device: str = "cpu") -> dict:
    """One configuration in this process: peak memory growth over the steps (bytes), snapshot bytes, ms/step."""
    from lossscale import FixedScale, LossScaleOptimizer
    from lossscale.ops.masked import MaskedSkip

    gpu = torch.device(device).type == "cuda"
    params = [torch.nn.Parameter(torch.randn(total // 100, device=device) * 0.02) for _ in range(100)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = LossScaleOptimizer(
        OPTIMIZERS[opt_name](params, gpu), policy=FixedScale(1.0), skip_mode="host" if way == "host" else "masked"
    )
    if way == "masked, whole":
        opt._masked = MaskedSkip(budget=None)
    sync = synchronizer(device)
    if gpu:
        sync()
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    else:
        start = _peak_kib(reset=True) * 1024
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) if gpu else _peak_kib() * 1024
    return {
        "grow_bytes": peak - start,
        "held": opt._masked.extra_bytes if way != "host" else 0,
        "ms": statistics.median(times[2:]) * 1e3,
    }


def _peak_kib(reset: bool = False) -> int:
    """Peak RSS of this process in KiB: ``VmHWM`` (per address space, so unlike ``ru_maxrss`` not inherited
    from a large parent across exec), reset first where ``/proc/self/clear_refs`` allows."""
    if reset:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run_child(total: int, opt_name: str, way: str, steps: int, threads: int | None, device: str = "cpu") -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps([total, opt_name, way, steps, threads, device])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="100", help="millions of parameters")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    if args.child:
        total, opt_name, way, steps, threads, device = json.loads(args.child)
        if threads:
            torch.set_num_threads(threads)
        print(json.dumps(child(total, opt_name, way, steps, device)))
        return {}
    device = checked_device(parser, args.device)
    total = 20_000 if args.tiny else int(float(args.size) * 10**6)
    steps = 4 if args.tiny else args.steps
    rows = []
    param_bytes = total * 4
    # --tiny (the test suite's run) checks the script's path, every skip way, with one optimizer, and the child
    # process once: each child costs the 15 s of importing torch and its compiler (torch's optimizers import it)
    for opt_name in list(OPTIMIZERS)[:1] if args.tiny else OPTIMIZERS:
        got = {
            way: (
                child(total, opt_name, way, steps, device)
                if args.tiny and way != WAYS[0]
                else run_child(total, opt_name, way, steps, args.threads, device)
            )
            for way in WAYS
        }
        for way in WAYS:
            extra = got[way]["grow_bytes"] - got["host"]["grow_bytes"]
            rows.append(
                {
                    "optimizer": opt_name,
                    "skip": way,
                    "peak extra / params": extra / param_bytes,
                    "snapshot held / params": got[way]["held"] / param_bytes,
                    "ms per step": got[way]["ms"],
                    "vs host": got[way]["ms"] / got["host"]["ms"],
                }
            )
            print(rows[-1], file=sys.stderr, flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    peak = "device memory (max_memory_allocated)" if torch.device(device).type == "cuda" else "RSS"
    md = (
        f"Device: {device}. {total / 1e6:g}M float32 parameters in 100 tensors ({param_bytes / 2**20:.0f} MiB). "
        f"*peak extra* = peak {peak} growth over {steps} steps minus the host skip's, in the parameters' bytes; "
        f"*snapshot held* = bytes the skip keeps (counted).\n\n"
        + table(rows, ["optimizer", "skip", "peak extra / params", "snapshot held / params", "ms per step", "vs host"])
    )
    payload = {"machine": machine(device), "rows": rows, "markdown": md}
    emit("masked_memory", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
