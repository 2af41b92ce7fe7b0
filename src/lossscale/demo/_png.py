"""A plain PNG line chart with the standard library alone, for when matplotlib is not installed.

No text: stacked panels with a frame and coloured lines (and crosses for marked points). The demo's
full plot, with titles, axes and a legend, needs matplotlib (``pip install 'lossscale[demo]'``).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

__all__ = ["Series", "Panel", "write_chart"]

Color = tuple[int, int, int]


@dataclass
class Series:
    xs: list[float]
    ys: list[float]
    color: Color
    crosses: bool = False  # marks at the points instead of a line


@dataclass
class Panel:
    series: list[Series] = field(default_factory=list)


def _png(width: int, height: int, rgb: bytearray) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    stride = 3 * width
    raw = b"".join(b"\x00" + bytes(rgb[y * stride:(y + 1) * stride]) for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.rgb = bytearray(b"\xff" * (3 * width * height))

    def dot(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.rgb[i:i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(steps + 1):
            self.dot(round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps), color)


def write_chart(path: str, panels: list[Panel], width: int = 900, panel_height: int = 260) -> None:
    """Draw ``panels`` one above the other, each scaled to its own data, and write a PNG to ``path``."""
    margin = 24
    canvas = _Canvas(width, panel_height * len(panels))
    for k, panel in enumerate(panels):
        top, bottom = k * panel_height + margin, (k + 1) * panel_height - margin
        left, right = margin, width - margin
        frame = (160, 160, 160)
        for a, b, c, d in ((left, top, right, top), (left, bottom, right, bottom),
                           (left, top, left, bottom), (right, top, right, bottom)):
            canvas.line(a, b, c, d, frame)
        points = [(x, y) for s in panel.series for x, y in zip(s.xs, s.ys)]
        if not points:
            continue
        x_lo, x_hi = min(p[0] for p in points), max(p[0] for p in points)
        y_lo, y_hi = min(p[1] for p in points), max(p[1] for p in points)
        x_span, y_span = (x_hi - x_lo) or 1.0, (y_hi - y_lo) or 1.0

        def at(x: float, y: float) -> tuple[int, int]:
            return (round(left + (x - x_lo) / x_span * (right - left)),
                    round(bottom - (y - y_lo) / y_span * (bottom - top)))

        for s in panel.series:
            pixels = [at(x, y) for x, y in zip(s.xs, s.ys)]
            if s.crosses:
                for x, y in pixels:
                    canvas.line(x - 3, y - 3, x + 3, y + 3, s.color)
                    canvas.line(x - 3, y + 3, x + 3, y - 3, s.color)
            else:
                for (x0, y0), (x1, y1) in zip(pixels, pixels[1:]):
                    canvas.line(x0, y0, x1, y1, s.color)
    with open(path, "wb") as f:
        f.write(_png(canvas.width, canvas.height, canvas.rgb))
