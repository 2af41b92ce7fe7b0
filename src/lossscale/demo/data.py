"""The demo's corpus: the source files of Python's own standard library, read at run time.

Every Python install has them, nobody here wrote them, and nothing is downloaded. Characters are
encoded as their ASCII code (0-126); every other character (non-ASCII, and DEL) is code 127, so the
vocabulary is always 128 symbols.

Files: the top-level ``*.py`` modules of ``sysconfig.get_paths()["stdlib"]``, sorted by name and
shuffled with ``random.Random(seed)``; the first ``files`` are used, the last tenth of them (at least
one) held out for the reported loss. Training windows for step ``s`` are drawn by a generator seeded
with ``(seed, s, rank, micro-batch)`` alone, so the data position of a run is just its step number: a resumed run
reads exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import glob
import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass

import torch

__all__ = ["VOCAB", "Corpus", "encode", "load_corpus", "stdlib_files"]

#: Codes 0-126 are ASCII characters; 127 stands for every other character.
VOCAB = 128


def encode(text: str) -> torch.Tensor:
    """int64 codes of ``text`` (ASCII as is, anything else as 127)."""
    data = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).to(torch.int64)
    return data.clamp_max(VOCAB - 1)


def stdlib_files() -> list[str]:
    """Sorted paths of the standard library's top-level ``*.py`` files (raises if there are none)."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise RuntimeError(f"found no *.py files in Python's standard library at {root!r}; the demo trains on "
                           f"them. Run it with a Python whose standard library ships its sources.")
    return files


@dataclass(frozen=True)
class Corpus:
    """Encoded training and held-out text, and where it came from."""

    train: torch.Tensor
    heldout: torch.Tensor
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]

    def batch(self, seed: int, step: int, micro: int, sequences: int, context: int,
              rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets, ``[sequences, context]`` each, for one micro-batch of ``step``."""
        key = hashlib.blake2b(f"{seed},{step},{rank},{micro}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key, "little"))
        starts = torch.randint(0, len(self.train) - context - 1, (sequences,), generator=gen)
        index = starts[:, None] + torch.arange(context + 1)
        window = self.train[index]
        return window[:, :-1], window[:, 1:]

    def heldout_batches(self, context: int, tokens: int, batch_tokens: int = 8192) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Evenly spaced held-out windows, about ``tokens`` characters in all, in batches of ``batch_tokens``."""
        count = max(1, min(tokens // context, (len(self.heldout) - 1) // context))
        starts = torch.linspace(0, len(self.heldout) - context - 1, count).long()
        index = starts[:, None] + torch.arange(context + 1)
        window = self.heldout[index]
        return [(w[:, :-1], w[:, 1:]) for w in window.split(max(1, batch_tokens // context))]


def load_corpus(files: int, seed: int, context: int) -> Corpus:
    """Read ``files`` standard-library modules chosen by ``seed``; hold out the last tenth of them."""
    paths = stdlib_files()
    random.Random(seed).shuffle(paths)
    chosen = paths[: max(2, files)]
    held = max(1, len(chosen) // 10)
    train_files, heldout_files = tuple(chosen[:-held]), tuple(chosen[-held:])

    def read(group: tuple[str, ...]) -> torch.Tensor:
        texts = []
        for path in group:
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
        return encode("\n".join(texts))

    train, heldout = read(train_files), read(heldout_files)
    for name, data in (("training", train), ("held-out", heldout)):
        if len(data) < 2 * (context + 1):
            raise RuntimeError(f"the {name} text has {len(data)} characters, too few for windows of {context + 1}; "
                               f"use more --files or a shorter --context.")
    return Corpus(train, heldout, train_files, heldout_files)
