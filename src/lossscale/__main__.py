"""``python -m lossscale demo`` / the ``lossscale`` console script. Imports the demo only when asked."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lossscale demo [--quick] [--out DIR] [...]   (lossscale demo --help for the options)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from lossscale.demo.cli import main as demo_main  # optional dependencies live behind this import

        return demo_main(rest)
    print(f"lossscale: unknown command {command!r}; the commands are: demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
