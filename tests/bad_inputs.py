"""The harness of the bad-input suite (tests/test_bad_input_*.py).

A case is one bad call on a fresh small training setup: a ``World`` (a model whose inner optimizer has
already taken one real step, so it holds state) plus whatever the case builds on it. The case states the
error it expects (type, and the words the message must contain: the argument's name and the value
received). After the call, the model's parameters and the inner optimizer's state must be exactly as
before, and finite.

Cases that wait for core work are listed by id in each file's ``WAITING`` set and marked
``xfail(strict=True, reason=CORE)``: when the core fixes one, the strict mark fails the run and the id is
removed from the set.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

CORE = "core validation (lead)"


class World:
    """A tiny model and its SGD-with-momentum optimizer after one clean step (so the state is not empty)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            self.model.weight.copy_(torch.randn(2, 3, generator=gen))
            self.model.bias.copy_(torch.randn(2, generator=gen))
        self.params = list(self.model.parameters())
        self.opt = torch.optim.SGD(self.params, lr=0.125, momentum=0.5)
        self.x = torch.randn(4, 3, generator=gen)
        self.loss().backward()
        self.opt.step()
        self.opt.zero_grad()

    def loss(self) -> torch.Tensor:
        return self.model(self.x).square().mean()

    def snapshot(self) -> tuple[list[torch.Tensor], dict[str, Any]]:
        return [p.detach().clone() for p in self.params], copy.deepcopy(self.opt.state_dict())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _finite(a: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return not a.is_floating_point() or bool(torch.isfinite(a).all())
    if isinstance(a, dict):
        return all(_finite(v) for v in a.values())
    if isinstance(a, (list, tuple)):
        return all(_finite(v) for v in a)
    return True


def check_untouched(world: World, before: tuple[list[torch.Tensor], dict[str, Any]]) -> None:
    """Parameters and the inner optimizer's state bit-for-bit as in ``before``, and finite."""
    params, state = before
    for i, (p, q) in enumerate(zip(world.params, params)):
        assert torch.equal(p.detach(), q), f"parameter {i} changed"
        assert torch.isfinite(p).all(), f"parameter {i} is not finite"
    now = world.opt.state_dict()
    assert _same(now, state), "the optimizer state changed"
    assert _finite(now), "the optimizer state is not finite"


def shown(value: Any) -> str:
    """How a message shows a received value: its repr (a tensor's repr, e.g. ``tensor(0.)``)."""
    return repr(value)


@dataclass(frozen=True)
class Bad:
    """One bad input: ``act(world)`` must raise ``error`` with ``words`` (regex-escaped) in the message.

    ``setup(world)`` builds what ``act`` needs before the snapshot (a wrapper, a first scale() call),
    so only the bad call itself is checked for side effects."""

    id: str
    act: Callable[[World, Any], Any]
    error: type[BaseException]
    words: tuple[str, ...]
    setup: Callable[[World], Any] = lambda world: None
    marks: tuple[Any, ...] = field(default=())


def params(cases: list[Bad], waiting: frozenset[str] = frozenset()) -> list[Any]:
    """pytest parameters; the ids in ``waiting`` (cases that wait for core work) get the strict xfail."""
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), f"duplicate case ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    out = []
    for c in cases:
        marks = list(c.marks) + ([pytest.mark.xfail(strict=True, reason=CORE)] if c.id in waiting else [])
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


def run(case: Bad) -> None:
    """Build the world and the subject, call the bad input, check the error and that nothing moved."""
    world = World()
    subject = case.setup(world)
    before = world.snapshot()
    with pytest.raises(case.error) as info:
        case.act(world, subject)
    message = str(info.value)
    for word in case.words:
        assert re.search(re.escape(word), message), f"{word!r} not in the message: {message}"
    check_untouched(world, before)


def ctor_cases(prefix: str, build: Callable[[World, dict[str, Any]], Any], bad: dict[str, list[Any]],
               words: Callable[[str, Any], tuple[str, ...]] | None = None) -> list[Bad]:
    """One case per (argument, bad value): ValueError, or TypeError for a value of the wrong type.

    ``bad[name]`` lists values; a ``(value, error)`` pair overrides the error."""
    out = []
    for name, values in bad.items():
        for entry in values:
            value, error = entry if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], type) \
                else (entry, _default_error(entry))
            expected = words(name, value) if words else (f"{name}=", shown(value))
            out.append(Bad(f"{prefix}({name}={_short(value)})",
                           lambda w, s, name=name, value=value: build(w, {name: value}),
                           error, expected))
    return out


def _default_error(value: Any) -> type[BaseException]:
    """TypeError for a value that is not a number at all (bools included), ValueError for a bad number."""
    return TypeError if isinstance(value, bool) or not isinstance(value, (int, float)) else ValueError


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


NON_FINITE = [math.inf, -math.inf, math.nan]
