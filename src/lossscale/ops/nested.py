"""The tensors in a nested argument or output (tuples, named tuples, lists, dicts, dataclass records), found and
rebuilt by one walker, for the hooks that record or convert what enters and leaves a module."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

#: Containers deeper than this are not entered (a guard against a structure that contains itself).
MAX_DEPTH = 8


def _walked(obj: Any, plain: bool) -> list[Any] | None:
    """The items of a container ``obj`` (None where it is no container): a tuple's or list's items, a dict's values,
    a dataclass record's fields; with ``plain``, exact tuples, lists and dicts only."""
    if plain:
        kind = type(obj)
        if kind is tuple or kind is list:
            return list(obj)
        return list(obj.values()) if kind is dict else None
    if isinstance(obj, (str, bytes)):
        return None
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple)):
        return list(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    return None


def tensors_in(obj: Any, *, plain: bool = False, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor in ``obj``, depth first: ``obj`` itself, or in tuples (named ones too), lists, dicts and dataclass
    records; with ``plain``, in exact tuples, lists and dicts only (the containers :func:`map_tensors` rebuilds with
    ``plain``)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    items = _walked(obj, plain) if depth <= MAX_DEPTH else None
    return [] if items is None else [t for item in items for t in tensors_in(item, plain=plain, depth=depth + 1)]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any, *, plain: bool = False) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it, its tuples (named ones too), lists and dicts rebuilt (dict
    subclasses as their own type where it takes keyword arguments, else as dicts); with ``plain``, exact tuples,
    lists and dicts only. Anything else is returned as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if plain:
        kind = type(obj)
        if kind is tuple or kind is list:
            return kind(map_tensors(fn, v, plain=True) for v in obj)
        if kind is dict:
            return {k: map_tensors(fn, v, plain=True) for k, v in obj.items()}
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if isinstance(obj, dict):
        mapped = {k: map_tensors(fn, v) for k, v in obj.items()}
        try:
            return type(obj)(**mapped) if type(obj) is not dict else mapped
        except TypeError:
            return mapped
    return obj
