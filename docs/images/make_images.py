"""Make the pictures in docs/images/ with the commands that draw them (the page that shows one names its command):

    python docs/images/make_images.py                    # every picture
    python docs/images/make_images.py demo-quick.png     # one

Each picture is what a command of this repository writes, run in a temporary folder and copied here with two PNG
text chunks: ``Command``, the command line, and ``Settings``, the settings it ran with (JSON). tests/test_docs_images.py
compares both with what the command would use today, so a picture drawn with an older preset fails the tests until
it is made again.

- ``demo-quick.png``: ``lossscale demo --quick --out demo-out`` (seed 0; what ``make demo`` runs), its
  ``demo-out/demo.png``. The demo writes both chunks itself; ``Settings`` is results.json's ``config``.
- ``diagnosis_t5.png``: ``python examples/float16_overflow.py --plot diagnosis_t5.png``. ``Settings``: the T5's sizes,
  the planted factor, the seeds, the batch and the scale, read from the example's source.
- ``heal.png``: ``python examples/heal.py --plot heal.png``. ``Settings``: the GPT-2's sizes, the steps, the fault's
  step, block and growth, the seeds, the optimizer and the scalers, read from the example's source.
"""

from __future__ import annotations

import ast
import json
import shlex
import struct
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "images"
T5_EXAMPLE = ROOT / "examples" / "float16_overflow.py"
HEAL_EXAMPLE = ROOT / "examples" / "heal.py"


@dataclass(frozen=True)
class Picture:
    """A picture of docs/images/: the command that draws it (as recorded), the settings that command uses today,
    and ``draw(folder)``, which runs the command in ``folder`` and returns the PNG's bytes with both chunks."""

    command: list[str]
    settings: Callable[[], dict[str, Any]]
    draw: Callable[[Path], bytes]

    @property
    def command_line(self) -> str:
        return shlex.join(self.command)


DEMO = ["lossscale", "demo", "--quick", "--out", "demo-out"]
T5 = ["python", "examples/float16_overflow.py", "--plot", "diagnosis_t5.png"]
HEAL = ["python", "examples/heal.py", "--plot", "heal.png"]


def demo_settings() -> dict[str, Any]:
    """results.json's ``config`` for the demo's options in ``DEMO``: the preset today, with those options applied."""
    from lossscale.demo import cli

    cfg, names = cli.settings(cli.build_parser().parse_args(DEMO[2:]))
    return json.loads(json.dumps(cli.config_record(cfg, names)))  # as read back from the PNG


def draw_demo(folder: Path) -> bytes:
    subprocess.run([sys.executable, "-m", "lossscale", *DEMO[1:]], cwd=folder, check=True)
    return (folder / "demo-out" / "demo.png").read_bytes()


def source_settings(path: Path, constants: tuple[str, ...], config: str, calls: tuple[str, ...]) -> dict[str, Any]:
    """What decides an example's picture, read from its source: the module-level ``constants``, the keyword arguments
    of its ``config`` call, and the ``calls`` as written."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    settings: dict[str, Any] = {}
    found: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and ast.unparse(node.targets[0]) in constants:
            settings[ast.unparse(node.targets[0])] = ast.literal_eval(node.value)
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name == config:
                settings[config] = {k.arg: _literal(k.value) for k in node.keywords if k.arg}
            elif name in calls:
                found.setdefault(name, []).append(ast.unparse(node))
    return settings | {name: sorted(set(seen)) for name, seen in sorted(found.items())}


def _literal(node: ast.expr) -> Any:
    """A literal's value; any other expression as written (a constant's name)."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def t5_settings() -> dict[str, Any]:
    """examples/float16_overflow.py's ``FACTOR``, the ``T5Config`` arguments, and the seeding, batch and
    ``find_overflow`` calls."""
    return source_settings(T5_EXAMPLE, ("FACTOR",), "T5Config", ("torch.manual_seed", "torch.randint", "find_overflow"))


def draw_t5(folder: Path) -> bytes:
    subprocess.run([sys.executable, str(ROOT / T5[1]), *T5[2:]], cwd=folder, check=True)
    png = (folder / T5[-1]).read_bytes()
    return with_text(png, {"Command": shlex.join(T5), "Settings": json.dumps(t5_settings())})


def heal_settings() -> dict[str, Any]:
    """examples/heal.py's constants, the ``GPT2Config`` arguments, and its seeding, optimizer and scaler calls."""
    calls = ("torch.manual_seed", "torch.optim.AdamW", "torch.amp.GradScaler", "lossscale.GradScaler")
    return source_settings(HEAL_EXAMPLE, ("VOCAB", "STEPS", "FAULT_AT", "BLOCK", "GROWTH"), "GPT2Config", calls)


def draw_heal(folder: Path) -> bytes:
    subprocess.run([sys.executable, str(ROOT / HEAL[1]), *HEAL[2:]], cwd=folder, check=True)
    png = (folder / HEAL[-1]).read_bytes()
    return with_text(png, {"Command": shlex.join(HEAL), "Settings": json.dumps(heal_settings())})


PICTURES = {
    "demo-quick.png": Picture(DEMO, demo_settings, draw_demo),
    "diagnosis_t5.png": Picture(T5, t5_settings, draw_t5),
    "heal.png": Picture(HEAL, heal_settings, draw_heal),
}


def with_text(png: bytes, text: dict[str, str]) -> bytes:
    """``png`` with a ``tEXt`` chunk per item of ``text``, put before its closing IEND chunk."""
    assert png[-12:-8] == b"\0\0\0\0" and png[-8:-4] == b"IEND", "not a PNG file that ends with IEND"
    chunks = b""
    for keyword, value in text.items():
        body = keyword.encode("latin-1") + b"\0" + value.encode("latin-1")
        chunks += struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body))
    return png[:-12] + chunks + png[-12:]


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in PICTURES]
    if unknown:
        print(f"make_images.py: no picture {', '.join(unknown)}; the pictures: {', '.join(PICTURES)}", file=sys.stderr)
        return 2
    for name in names or list(PICTURES):
        picture = PICTURES[name]
        print(f"== {name}: {picture.command_line}", flush=True)
        with tempfile.TemporaryDirectory() as folder:
            (IMAGES / name).write_bytes(picture.draw(Path(folder)))
        print(f"   wrote {(IMAGES / name).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
