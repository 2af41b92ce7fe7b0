"""Why float16 training breaks: find the first non-finite value, name the module, say what fixes it.

- :func:`find_overflow` traces one forward and scaled backward of a closure and returns an :class:`OverflowReport`.
- :func:`keep_float32` runs one module in float32 inside an autocast model (the fix for a forward overflow).
- :class:`OverflowDiagnosis` is the add-on a front end takes (``diagnose=model``): it notices the scale collapsing
  without a host read and traces the next step, warning with an :class:`OverflowWarning`.
"""

from lossscale.diagnosis.addon import OverflowDiagnosis, TriggerState, advance_trigger
from lossscale.diagnosis.find import find_overflow
from lossscale.diagnosis.float32 import Float32Forward, keep_float32
from lossscale.diagnosis.report import ModuleRecord, OverflowReport, OverflowWarning

__all__ = [
    "Float32Forward",
    "ModuleRecord",
    "OverflowDiagnosis",
    "OverflowReport",
    "OverflowWarning",
    "TriggerState",
    "advance_trigger",
    "find_overflow",
    "keep_float32",
]
