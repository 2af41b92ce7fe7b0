"""A progress bar per run: tqdm's when it is installed, else a plain line every tenth of the run."""

from __future__ import annotations

import sys
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
        total: Steps in the run.
        initial: Steps already done (a resumed run).
        enabled: False on ranks other than 0: nothing is shown.
    """

    def __init__(self, name: str, total: int, initial: int = 0, enabled: bool = True) -> None:
        self.name, self.total, self.enabled = name, total, enabled
        self._bar: Any = None
        self._next_line = initial + max(1, total // 10)
        if enabled and have_tqdm():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=f"{name:>13}", unit="step", leave=True,
                             dynamic_ncols=True, file=sys.stderr)

    def update(self, done: int, **postfix: Any) -> None:
        if not self.enabled:
            return
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()}
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(done - self._bar.n)
        elif done >= self._next_line or done == self.total:
            self._next_line = done + max(1, self.total // 10)
            fields = "  ".join(f"{k} {v}" for k, v in shown.items())
            print(f"{self.name:>13}  step {done:>{len(str(self.total))}}/{self.total}  {fields}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
