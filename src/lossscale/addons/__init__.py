"""Add-ons: what rides along a front end's step (EMA, precision schedule, overflow diagnosis and healing, your own),
met through one contract (:class:`AddOn`, documented in :mod:`lossscale.addons.base`)."""

from lossscale.addons.base import AddOn, FrontEnd
from lossscale.reporting import StepOutcome

__all__ = ["AddOn", "FrontEnd", "StepOutcome"]
