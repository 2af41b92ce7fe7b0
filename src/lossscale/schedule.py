"""Placeholder: the precision schedule lands with its own issue."""


def check_attachable(schedule, params):  # pragma: no cover - replaced by the schedule issue
    raise NotImplementedError("PrecisionSchedule is not available yet")
