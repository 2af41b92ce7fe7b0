"""Run every benchmark and write benchmarks/RESULTS.md from their output (never typed by hand).

    python benchmarks/run_all.py            # full sizes (tens of minutes on 2 CPU cores)
    python benchmarks/run_all.py --tiny     # seconds; what the test suite runs
    python benchmarks/run_all.py --only step_overhead,masked_memory --extra "step_overhead=--sizes 1,20"
    python benchmarks/run_all.py --device cuda   # the GPU sections (GPU_BENCHMARKS; minutes on one H100)

With ``--only``, the chosen sections are replaced in the existing file and the others kept. A full run
replaces its own device's sections and keeps the other's: ``--device cuda`` writes the sections titled
"GPU: ...", each headed by the GPU's name and the torch and CUDA versions, and leaves the CPU sections
as they were. Every section states the command, the date and the machine (CPU flags included) it was
measured on.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import shlex
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# (module, title, arguments for a full run)
BENCHMARKS = [
    ("step_overhead", "Step overhead against torch.amp.GradScaler", []),
    ("overflow_check", "Overflow-check throughput against the one-pass floors", []),
    ("host_reads", "Host reads per step", []),
    ("masked_memory", "Masked skip: peak extra memory and time", []),
    ("end_to_end", "End to end: the demo model's training step", ["--threads", "1", "--rounds", "41"]),
    ("predictive", "Predictive scale against torch's defaults", []),
    ("layerwise", "Per-layer loss scales: hook and unscale overhead", []),
    ("language_model", "Language model: a tiny GPT-2 with global, predictive and per-layer scales", []),
    ("many_tensors", "Many small tensors: 2,000 tensors against torch's pipeline", []),
    (
        "diagnosis",
        "Overflow diagnosis: a healthy step with the add-on, the traced step, find_overflow",
        ["--size", "128,2,8,32", "--repeats", "15", "--steps", "10"],
    ),
    (
        "heal",
        "Healing: GPT-2 and Llama with a planted fault of each kind, against torch.amp.GradScaler and float32",
        [],
    ),
]
# (module, title, arguments for a full run) with --device cuda: each also gets --device; sized together for a few
# minutes on one H100 (1B parameters in 100 tensors and a 350M transformer layout: about 25 GB of device memory)
GPU = "GPU: "
GPU_BENCHMARKS = [  # the open measurements first (issues 28 and 31), so that a run cut short by its budget has them
    ("many_tensors", GPU + "many small tensors, 2,000 tensors against torch's pipeline", []),
    (
        "language_model",
        GPU + "GPT-2 medium's shape with global, predictive and per-layer scales",
        [
            "--layers",
            "24",
            "--d-model",
            "1024",
            "--heads",
            "16",
            "--context",
            "256",
            "--sequences",
            "16",
            "--steps",
            "120",
            "--files",
            "120",
        ],
    ),
    ("graphs", GPU + "a step replayed from a CUDA graph against the eager step", []),
    ("host_reads", GPU + "host reads and synchronisations per step", []),
    (
        "end_to_end",
        GPU + "end to end, a small transformer's training step",
        [
            "--d-model",
            "512",
            "--layers",
            "6",
            "--heads",
            "8",
            "--context",
            "256",
            "--sequences",
            "32",
            "--rounds",
            "21",
        ],
    ),
    (
        "step_overhead",
        GPU + "step overhead against torch.amp.GradScaler at 1B and 350M",
        [
            "--sizes",
            "1000",
            "--optimizers",
            "fused AdamW,foreach Adam",
            "--scaling-sizes",
            "",
            "--layouts",
            "100 tensors,transformer",
            "--layout-size",
            "350",
        ],
    ),
    ("diagnosis", GPU + "overflow diagnosis: a healthy step with the add-on, the traced step, find_overflow", []),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--only", default=None, help="comma-separated module names")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--json-dir", default=None, help="keep each benchmark's JSON output in this folder")
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        help='NAME=ARGS: more arguments for one benchmark, e.g. "step_overhead=--sizes 1,20"',
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (default: BENCHMARKS) or a CUDA device (GPU_BENCHMARKS, written as the GPU sections)",
    )
    args = parser.parse_args(argv)
    extras = {k: v.split() for k, v in (e.split("=", 1) for e in args.extra)}
    gpu = torch.device(args.device).type == "cuda"
    if gpu and not torch.cuda.is_available():
        parser.error(f"argument --device: {args.device!r} is not usable here (torch.cuda.is_available() is False)")
    device_args = ["--device", args.device] if gpu else []
    chosen = [b for b in (GPU_BENCHMARKS if gpu else BENCHMARKS) if args.only is None or b[0] in args.only.split(",")]
    sections: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.json_dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name, title, extra in chosen:
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as err:
                if err.name == name:
                    continue  # a benchmark not written yet
                raise
            json_path = str(folder / f"{name}.json")
            argv_b = (["--tiny"] if args.tiny else extra) + extras.get(name, []) + device_args
            module.main(argv_b + ["--json", json_path])
            with open(json_path) as f:
                payload = json.load(f)
            described = payload.get("machine", {})
            machine = ", ".join(f"{k}={v}" for k, v in described.items())
            command = " ".join([f"python benchmarks/{name}.py", *map(shlex.quote, argv_b)])
            device = (
                f"Device: {described.get('gpu')}, torch {described.get('torch')}, CUDA "
                f"{described.get('cuda_version')}\n\n"
                if gpu
                else ""
            )
            sections[title] = (
                f"## {title}\n\n{device}`{command}` on {datetime.date.today().isoformat()}\n\n"
                f"Machine: {machine}\n\n{payload['markdown']}\n"
            )
    head = [
        "# Benchmark results",
        "",
        "Generated by `python benchmarks/run_all.py` (sections may be regenerated one at a time with "
        "`--only`; the GPU sections by `--device cuda`). Do not edit by hand.",
        "",
    ]
    merged = _combined(Path(args.out), sections, [t for _, t, _ in chosen], gpu, bool(args.only))
    Path(args.out).write_text("\n".join(head) + "\n" + "\n".join(merged))
    print(f"wrote {args.out}")
    return 0


def _combined(path: Path, fresh: dict[str, str], order: list[str], gpu: bool, only: bool) -> list[str]:
    """The sections to write: with ``only``, :func:`_merge`; else this device's sections anew (in ``order``) and the
    other device's kept from ``path``, the CPU sections first."""
    if only:
        return _merge(path, fresh)
    new = [fresh[title] for title in order if title in fresh]
    kept = [text for title, text in _sections(path).items() if title.startswith(GPU) != gpu]
    return kept + new if gpu else new + kept


def _merge(path: Path, fresh: dict[str, str]) -> list[str]:
    """The sections of ``path`` in their order, the fresh ones replacing theirs; new ones appended to their device's
    sections (a CPU one before the first GPU section)."""
    old = _sections(path)
    out = [fresh.get(title, text) for title, text in old.items()]
    first_gpu = next((i for i, title in enumerate(old) if title.startswith(GPU)), len(out))
    new = [(title, text) for title, text in fresh.items() if title not in old]
    return (
        out[:first_gpu]
        + [text for title, text in new if not title.startswith(GPU)]
        + out[first_gpu:]
        + [text for title, text in new if title.startswith(GPU)]
    )


def _sections(path: Path) -> dict[str, str]:
    """title -> section text of ``path`` (none if it does not exist), in file order; a section written when the
    machine was in the file's header gets that line."""
    old: dict[str, str] = {}
    if path.exists():
        head, *parts = path.read_text().split("\n## ")
        machine = [line for line in head.splitlines() if line.startswith("Machine: ")]
        for part in parts:
            title, body = part.split("\n", 1)
            if machine and "\nMachine: " not in "\n" + body:  # written when the machine was in the header
                first, rest = body.lstrip("\n").split("\n", 1)
                body = f"\n{first}\n\n{machine[0]}\n{rest}"
            old[title.strip()] = f"## {title}\n{body.rstrip()}\n"
    return old


if __name__ == "__main__":
    sys.exit(main())
