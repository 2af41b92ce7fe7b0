"""The demo a new user runs first (``lossscale demo``); not imported by ``import lossscale``."""
