"""A progress line per run: updates applied, loss, scale, skipped steps and the time left.

With tqdm (the ``demo`` extra) every run has its own bar (stacked when runs train side by side), whose
``<`` time is the time left. Without it, a plain line every tenth of the run with the same fields and
``left ~Ns``, estimated from the steps done so far.
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["Progress", "have_tqdm"]


def have_tqdm() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


class Progress:
    """``update(done, loss=..., scale=..., skipped=...)`` after each step; ``close()`` at the end.

    Args:
        name: The run's name (the bar's label).
        total: Updates the run applies (skipped steps do not count).
        initial: Updates already applied (a resumed run).
        enabled: False on ranks other than 0: nothing is shown.
        position: The bar's line, counted from the first bar (runs shown at the same time).
    """

    def __init__(self, name: str, total: int, initial: int = 0, enabled: bool = True, position: int = 0) -> None:
        self.name, self.total, self.enabled = name, total, enabled
        self._bar: Any = None
        self._first: tuple[float, int] | None = None  # (time, steps done) at the first update: runs may queue
        self._next_line = initial + max(1, total // 10)
        if enabled and have_tqdm():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=f"{name:>15}", unit="update", leave=True,
                             dynamic_ncols=True, file=sys.stderr, position=position)

    def time_left(self, done: int) -> float | None:
        """Seconds left at the rate of the steps since the first update (None until there are two)."""
        if self._first is None or done <= self._first[1]:
            return None
        return (self.total - done) * (time.perf_counter() - self._first[0]) / (done - self._first[1])

    def update(self, done: int, **postfix: Any) -> None:
        if not self.enabled:
            return
        if self._first is None:
            self._first = (time.perf_counter(), done)
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()}
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(done - self._bar.n)
        elif done >= self._next_line or done == self.total:
            self._next_line = done + max(1, self.total // 10)
            fields = "  ".join(f"{k} {v}" for k, v in shown.items())
            left = self.time_left(done)
            eta = "" if left is None else f"  left ~{left:.0f}s"
            print(f"{self.name:>15}  update {done:>{len(str(self.total))}}/{self.total}  {fields}{eta}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
