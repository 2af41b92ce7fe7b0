"""What the demo ran on: the CPU, whether it has float16/bfloat16 matrix instructions, torch's threads.

The demo's seconds mean little without this. On a CPU with AMX or avx512_fp16 (recent Xeons), float16
and bfloat16 matmuls run in hardware; on one with AVX2 only (most laptops, many cloud CPUs) torch
converts to float32 element by element, and a float16 step of the demo's model costs several times a
float32 one. ``results.json`` records this next to the seconds, and the demo says it at the start.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

__all__ = ["MATRIX_FLAGS", "describe_machine", "machine"]

#: The /proc/cpuinfo flags that decide how fast float16/bfloat16 matmuls are on a CPU.
MATRIX_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile")


def _cpuinfo() -> tuple[str, list[str]]:
    """(model name, the :data:`MATRIX_FLAGS` present); ``platform.processor()`` and no flags off Linux."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())  # the first processor's
    except OSError:
        pass
    present = set(fields.get("flags", "").split())
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    return name, [flag for flag in MATRIX_FLAGS if flag in present]


def machine(device: str = "cpu") -> dict[str, Any]:
    """The machine record ``results.json`` keeps: CPU model and flags, cores, torch threads and version."""
    name, flags = _cpuinfo()
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", lambda: None)()
    return {
        "cpu": name,
        "cpu_flags": flags,
        "float16_matrix_units": any(f in flags for f in ("avx512_fp16", "amx_fp16")),
        "bfloat16_matrix_units": any(f in flags for f in ("avx512_bf16", "amx_bf16")),
        "torch_cpu_capability": capability,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": device,
        "cuda": torch.cuda.get_device_name() if device.startswith("cuda") else None,
    }


def describe_machine(info: dict[str, Any]) -> str:
    """One line for the demo's header, e.g. ``AMD EPYC, 2 cores, 1 torch thread (avx2; no float16 or
    bfloat16 matrix instructions)``."""
    if info["cuda"]:
        return f"{info['cuda']} (CUDA)"
    flags = ", ".join(info["cpu_flags"]) or "no AVX2"
    have = [kind for kind in ("float16", "bfloat16") if info[f"{kind}_matrix_units"]]
    units = (f"{' and '.join(have)} matrix instructions" if have
             else "no float16 or bfloat16 matrix instructions: those matmuls convert to float32, slowly")
    return (f"{info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch thread"
            f"{'s' if info['torch_threads'] != 1 else ''} ({flags}; {units})")
