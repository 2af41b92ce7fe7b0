"""Loss-scale policies: frozen configs whose whole rule is ``update(state, found_inf, amax=None) -> state``.

The public names are ``lossscale``'s (``DynamicScale``, ``FixedScale``, ``PredictiveScale``, ``Policy``, ...) and
``lossscale.presets``; the modules here are internal.
"""
