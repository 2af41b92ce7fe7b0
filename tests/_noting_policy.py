"""A policy that notes when it computes: torch's rule (DynamicScale), appending "policy" to ``EVENTS`` each
time it computes a state. Shared by the tests of when the front ends advance the policy."""

from __future__ import annotations

from lossscale import DynamicScale


class NotingScale(DynamicScale):
    """torch's rule, noting each time the policy computes a state in ``EVENTS`` (reset it per test)."""

    EVENTS: list = []

    def update(self, state, found_inf, amax=None):
        self.EVENTS.append("policy")
        return super().update(state, found_inf, amax)
