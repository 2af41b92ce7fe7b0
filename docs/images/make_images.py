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


def demo_settings() -> dict[str, Any]:
    """results.json's ``config`` for the demo's options in ``DEMO``: the preset today, with those options applied."""
    from lossscale.demo import cli

    cfg, names = cli.settings(cli.build_parser().parse_args(DEMO[2:]))
    return json.loads(json.dumps(cli.config_record(cfg, names)))  # as read back from the PNG


def draw_demo(folder: Path) -> bytes:
    subprocess.run([sys.executable, "-m", "lossscale", *DEMO[1:]], cwd=folder, check=True)
    return (folder / "demo-out" / "demo.png").read_bytes()


def t5_settings() -> dict[str, Any]:
    """What decides examples/float16_overflow.py's picture, read from its source: ``FACTOR``, the ``T5Config``
    arguments, and the seeding, batch and ``find_overflow`` calls as written."""
    tree = ast.parse(T5_EXAMPLE.read_text(encoding="utf-8"))
    settings: dict[str, Any] = {}
    calls: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["FACTOR"]:
            settings["FACTOR"] = ast.literal_eval(node.value)
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name == "T5Config":
                settings["T5Config"] = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
            elif name in ("torch.manual_seed", "torch.randint", "find_overflow"):
                calls.setdefault(name, []).append(ast.unparse(node))
    return settings | {name: sorted(set(found)) for name, found in sorted(calls.items())}


def draw_t5(folder: Path) -> bytes:
    subprocess.run([sys.executable, str(ROOT / T5[1]), *T5[2:]], cwd=folder, check=True)
    png = (folder / T5[-1]).read_bytes()
    return with_text(png, {"Command": shlex.join(T5), "Settings": json.dumps(t5_settings())})


PICTURES = {
    "demo-quick.png": Picture(DEMO, demo_settings, draw_demo),
    "diagnosis_t5.png": Picture(T5, t5_settings, draw_t5),
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
