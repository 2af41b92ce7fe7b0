"""Why float16 training breaks, and healing it: find the first non-finite value, name the module, say what fixes it,
and fix it.

- :func:`find_overflow` traces one forward and scaled backward of a closure and returns an :class:`OverflowReport`.
- :func:`keep_float32` runs one module in float32 inside an autocast model (the fix for a forward overflow).
- :func:`heal` keeps in float32 each module a batch's forward overflows in, until it runs clean: before a run.
- :class:`OverflowDiagnosis` is the add-on a front end takes (``diagnose=model``, and ``heal=True``): it notices the
  scale collapsing or the loss going non-finite without a host read, traces the next step, warns with an
  :class:`OverflowWarning`, and with ``heal`` heals the run as it goes (:class:`HealWarning`, :class:`HealError`).
"""

from lossscale.diagnosis.addon import OverflowDiagnosis, TriggerState, advance_trigger
from lossscale.diagnosis.find import find_overflow
from lossscale.diagnosis.float32 import Float32Forward, keep_float32
from lossscale.diagnosis.healing import HealReport, heal
from lossscale.diagnosis.report import HealError, HealWarning, ModuleRecord, OverflowReport, OverflowWarning

__all__ = [
    "Float32Forward",
    "HealError",
    "HealReport",
    "HealWarning",
    "ModuleRecord",
    "OverflowDiagnosis",
    "OverflowReport",
    "OverflowWarning",
    "TriggerState",
    "advance_trigger",
    "find_overflow",
    "heal",
    "keep_float32",
]
