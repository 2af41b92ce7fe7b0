"""Facades: other frameworks' loss-scaling APIs as translation tables onto the lossscale core.

Import each from its module (``lossscale.compat.ascend``, ``.mindspore``, ``.nnabla``, ``.keras``); none is
re-exported from ``lossscale``. Each module's docstring is its table (foreign name and default -> core);
``docs/compat.md`` lists every table and deviation. No facade keeps a copy of the scale.
"""
