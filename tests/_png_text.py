"""The text chunks of a PNG file (its ``tEXt`` metadata, as matplotlib's ``savefig(metadata=...)`` writes it)."""

from __future__ import annotations

import struct

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_text(data: bytes) -> dict[str, str]:
    """``{keyword: text}`` of the ``tEXt`` chunks of a PNG file's bytes (both Latin-1, as PNG defines them)."""
    assert data[:8] == SIGNATURE, "not a PNG file"
    text, at = {}, 8
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at : at + 8])
        if kind == b"tEXt":
            keyword, _, value = data[at + 8 : at + 8 + length].partition(b"\0")
            text[keyword.decode("latin-1")] = value.decode("latin-1")
        at += 12 + length  # length, type, data, CRC
    return text
