"""The units and how they connect: which modules carry a factor, what one forward pass showed the hooks, and the
regions read from the autograd graph (see the package docstring for the rule they serve).

A *slot* is one tensor that enters a unit (an input slot) or leaves it (an output slot); a *region* is a set of
slots joined by operations outside the units. The wiring says, per slot, whose factor its region carries: unit n's
where n is the region's only reader, else the global scale's (-1).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.autograd.graph import Node

#: (node, output index) where a tensor's gradient enters the autograd graph.
Edge = tuple[Node, int]
#: What a wiring was read for: the order the units ran in, the (unit, slot) of every input and output slot, how
#: many tensors the walk starts from past the units (the model's outputs, the losses given), and the units kept in
#: float32.
WiringKey = tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[tuple[int, int], ...], int, tuple[int, ...]]
#: For a node of the identity the hooks put before a unit's input: that unit (None: any other node).
UnitOfNode = Callable[[Node], int | None]


class Slot(NamedTuple):
    """One tensor entering or leaving a unit in the forward being recorded (a tuple: one is made per tensor)."""

    unit: int
    slot: int
    edge: Edge
    wrapped: bool  # an input that passes through an identity node of the hooks (its gradient can be converted)


@dataclass
class Forward:
    """What one forward pass showed the hooks, from its first unit until its backward pass begins."""

    order: list[int] = field(default_factory=list)  # the units in the order they ran
    ran: set[int] = field(default_factory=set)
    inputs: list[Slot] = field(default_factory=list)
    outputs: list[Slot] = field(default_factory=list)
    roots: list[Edge] = field(default_factory=list)  # the model's outputs, the losses given: walks start there too
    kept: set[int] = field(default_factory=set)  # units keep_float32 runs in float32 (it keeps them or a module around)
    changed: bool = False  # the units left the wiring's order: every input from there on is wrapped
    open: bool = False  # still recording: its backward pass has not begun

    def key(self) -> WiringKey:
        """What a wiring read from this forward is read for."""
        return (
            tuple(self.order),
            tuple((s.unit, s.slot) for s in self.inputs),
            tuple((s.unit, s.slot) for s in self.outputs),
            len(self.roots),
            tuple(sorted(self.kept)),
        )

    def closed(self) -> Forward:
        """This forward once its backward began: the units that ran, without the graph's nodes."""
        return Forward(order=self.order, ran=self.ran)


@dataclass(frozen=True)
class Units:
    """The modules that carry a factor, their parameters, and the groups shared parameters join them into."""

    named: list[tuple[str, torch.nn.Module]]
    params: list[list[torch.nn.Parameter]]
    owners: dict[int, list[int]]  # id(parameter) -> the units that own it
    unique: list[tuple[torch.nn.Parameter, list[int]]]  # each parameter once, with its owners
    group: list[int]  # per unit, the smallest unit index of its group
    members: dict[int, list[int]]  # group -> its units
    group_index: torch.Tensor  # ``group`` on the state's device
    given: str  # the type the units were found in, for messages ("Sequential", "list")
    whole: bool  # found in a model given whole (its outputs start the wiring walk), not in a list of modules

    def __len__(self) -> int:
        return len(self.named)

    @property
    def grouped(self) -> bool:
        """Whether some units share parameters."""
        return len(self.members) < len(self.named)

    def name(self, unit: int) -> str:
        return self.named[unit][0]


def find_units(source: torch.nn.Module | Sequence[torch.nn.Module], device: torch.device | str | None) -> Units:
    """The units of a model (every module that owns parameters directly, with its own parameters) or of a list of
    modules (each with all its parameters: a residual block is one unit); the state's device defaults to the first
    parameter's."""
    found = _model_units(source) if isinstance(source, torch.nn.Module) else _listed_units(source)
    params = [p for _, _, p in found]
    if device is None:
        device = next((p.device for unit in params for p in unit), torch.device("cpu"))
    owners: dict[int, list[int]] = {}
    unique: list[tuple[torch.nn.Parameter, list[int]]] = []
    for i, unit in enumerate(params):
        for p in unit:
            if id(p) not in owners:
                owners[id(p)] = []
                unique.append((p, owners[id(p)]))
            if i not in owners[id(p)]:
                owners[id(p)].append(i)
    group = _groups(len(found), unique)
    return Units(
        named=[(name, module) for name, module, _ in found],
        params=params,
        owners=owners,
        unique=unique,
        group=group,
        members={g: [i for i in range(len(found)) if group[i] == g] for g in set(group)},
        group_index=torch.tensor(group, device=device),
        given=type(source).__name__,
        whole=isinstance(source, torch.nn.Module),
    )


_Found = list[tuple[str, torch.nn.Module, list[torch.nn.Parameter]]]


def _model_units(model: torch.nn.Module) -> _Found:
    """Every module of ``model`` that owns parameters directly, with those parameters."""
    found = [
        (n or type(model).__name__, m)
        for n, m in model.named_modules()
        if any(p.requires_grad for p in m.parameters(recurse=False))
    ]
    containers = [
        n for n, m in found if any(c is not m and any(True for _ in c.parameters(recurse=False)) for c in m.modules())
    ]
    if containers:
        raise ValueError(
            f"LayerScales(model): module {containers[0]!r} owns parameters directly and also "
            f"contains modules with parameters, so its hooks would scale theirs twice; wrap its "
            f"own parameters in a submodule, or pass a list of modules, none inside another."
        )
    return [(n, m, list(m.parameters(recurse=False))) for n, m in found]


def _listed_units(source: Sequence[torch.nn.Module]) -> _Found:
    """Each module of ``source`` (none inside another, each once), with all its parameters."""
    modules = list(source)
    if not modules or not all(isinstance(m, torch.nn.Module) for m in modules):
        raise TypeError(
            f"LayerScales(modules): modules must be a torch.nn.Module or a non-empty sequence of them; "
            f"got {type(source).__name__} of {[type(m).__name__ for m in modules][:4]}."
        )
    names = [f"{i}:{type(m).__name__}" for i, m in enumerate(modules)]
    position = {id(m): i for i, m in enumerate(modules)}
    for i, m in enumerate(modules):
        if position[id(m)] != i:
            raise ValueError(
                f"LayerScales(modules): {names[position[id(m)]]!r} and {names[i]!r} are the same "
                f"module; list each unit once."
            )
        inner = [position[id(c)] for c in m.modules() if c is not m and id(c) in position]
        if inner:
            raise ValueError(
                f"LayerScales(modules): unit {names[i]!r} contains unit {names[inner[0]]!r}, so its "
                f"hooks would scale the inner unit's gradients twice; pass either the outer module or "
                f"the modules inside it."
            )
    return [(name, m, list(m.parameters())) for name, m in zip(names, modules)]


def _groups(n: int, unique: list[tuple[torch.nn.Parameter, list[int]]]) -> list[int]:
    """Per unit, the smallest unit index of its group (units joined by shared parameters)."""
    group = list(range(n))

    def find(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for _, owners in unique:
        roots = sorted({find(i) for i in owners})
        for r in roots[1:]:
            group[r] = roots[0]
    return [find(i) for i in range(n)]


@dataclass(frozen=True)
class SlotIndex:
    """The wiring as device tensors, for the factors of every slot at once: each output slot's unit and its
    region's source, each input slot's unit and its region's source (a source of n units: the global scale)."""

    out_unit: torch.Tensor
    out_source: torch.Tensor
    in_unit: torch.Tensor
    in_source: torch.Tensor


@dataclass(frozen=True)
class Wiring:
    """How the units connect: read from the autograd graph, or (``key`` None) the chain of the forward order."""

    key: WiringKey | None  # what it was read for; None: not read from a graph
    order: list[int]  # the units in the order the forward ran them
    rank: torch.Tensor  # per unit, its position in ``order`` (-1: did not run)
    in_position: dict[tuple[int, int], int]  # (unit, slot) -> the input slot's position
    out_position: dict[tuple[int, int], int]
    in_source: list[int]  # per input slot, the unit whose factor its region carries (-1: the global scale's)
    out_source: list[int]
    sole_reader: set[tuple[int, int]]  # input slots whose region only their unit reads (no identity node needed)
    following: torch.Tensor  # per unit, the reader of its output region (-1: none, several, or the global scale)
    readers: torch.Tensor  # [units, units] float32: 1 where unit n reads a region unit p writes and ran after p
    slots: SlotIndex
    pinned: list[int]  # units whose group has a parameter read outside the units: factor 1
    pinned_index: torch.Tensor


def chain_wiring(order: list[int], n: int, device: torch.device, kept: Wiring | None = None) -> Wiring:
    """The wiring assumed until one is read: each unit of ``order`` read by the next; the pinned units ``kept``'s."""
    chain = list(itertools.pairwise(order))
    following = [-1] * n
    for a, b in chain:
        following[a] = b
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return Wiring(
        key=None,
        order=list(order),
        rank=_rank(order, n, device),
        in_position={},
        out_position={},
        in_source=[],
        out_source=[],
        sole_reader=set(),
        following=torch.tensor(following, device=device),
        readers=_reader_matrix(chain, order, n, device),
        slots=SlotIndex(empty, empty, empty, empty),
        pinned=[] if kept is None else kept.pinned,
        pinned_index=empty if kept is None else kept.pinned_index,
    )


def read_wiring(forward: Forward, units: Units, unit_of: UnitOfNode, device: torch.device) -> Wiring:
    """The regions of ``forward``'s graph: walk back from every unit input (and from its roots) through operations
    outside the units, up to unit outputs and leaves; what one walk meets is one region.

    Raises:
        RuntimeError: an input the forward left unwrapped (its region had one reader) is now read by others too.
    """
    ins, outs = forward.inputs, forward.outputs
    regions = _Regions(len(ins) + len(outs))
    pinned = _walk(regions, forward, units, unit_of)
    readers: dict[int, set[int]] = {}  # region -> the units that read it
    for k, s in enumerate(ins):
        readers.setdefault(regions.find(k), set()).add(s.unit)

    def source(element: int) -> int:
        region = regions.find(element)
        reading = readers.get(region, set())
        return next(iter(reading)) if region != regions.find(regions.outside) and len(reading) == 1 else -1

    in_source = [source(k) for k in range(len(ins))]
    out_source = [source(len(ins) + k) for k in range(len(outs))]
    sole_reader = {(s.unit, s.slot) for s, src in zip(ins, in_source) if src == s.unit}
    _refuse_unwrapped_shared(ins, sole_reader, units)
    pairs = [(s.unit, reader) for k, s in enumerate(outs) for reader in readers.get(regions.find(len(ins) + k), ())]
    # a unit kept in float32 (a heal) computes its gradients in float32 and needs no factor; one it carried would go
    # with the gradient it hands on into the float16 ops before it, and overflow there (its weights are what made
    # its float16 output overflow). A group is pinned when all of its units are kept.
    pinned |= {m for m in forward.kept if set(units.members[units.group[m]]) <= forward.kept}
    pinned_units = sorted(m for p in pinned for m in units.members[units.group[p]])
    n = len(units)
    return Wiring(
        key=forward.key(),
        order=list(forward.order),
        rank=_rank(forward.order, n, device),
        in_position={(s.unit, s.slot): k for k, s in enumerate(ins)},
        out_position={(s.unit, s.slot): k for k, s in enumerate(outs)},
        in_source=in_source,
        out_source=out_source,
        sole_reader=sole_reader,
        following=_following(outs, out_source, n, device),
        readers=_reader_matrix(pairs, forward.order, n, device),
        slots=_slot_index(ins, in_source, outs, out_source, n, device),
        pinned=pinned_units,
        pinned_index=torch.tensor(pinned_units, dtype=torch.long, device=device),
    )


class _Regions:
    """A partition of the slots (inputs, then outputs) and one more element, ``outside``: the global scale's region
    (the loss, leaves, parameters outside the units)."""

    def __init__(self, slots: int) -> None:
        self.parent = list(range(slots + 1))
        self.outside = slots

    def find(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)


def _walk(regions: _Regions, forward: Forward, units: Units, unit_of: UnitOfNode) -> set[int]:
    """Join each walk's start with what it meets; return the units whose insides were reached other than through
    their outputs (a parameter of theirs, an inner tensor, read outside them)."""
    ins = forward.inputs
    output_of = {s.edge: len(ins) + k for k, s in enumerate(forward.outputs)}
    unit_of_node = {s.edge[0]: s.unit for s in forward.outputs}
    visited: dict[Node, int] = {}
    pinned: set[int] = set()
    starts = [(k, s.edge) for k, s in enumerate(ins)] + [(regions.outside, edge) for edge in forward.roots]
    for start, edge in starts:
        stack: list[tuple[Node | None, int]] = [edge]
        while stack:
            node, nr = stack.pop()
            if node is None:
                continue
            if (node, nr) in output_of:
                regions.join(start, output_of[(node, nr)])
                continue
            if node in unit_of_node:  # a unit's inner tensor read outside it
                pinned.add(unit_of_node[node])
                regions.join(start, regions.outside)
                continue
            if node in visited:
                regions.join(start, visited[node])
                continue
            visited[node] = start
            entered = unit_of(node)
            if entered is not None:  # reached a unit's inside other than by its output
                pinned.add(entered)
                regions.join(start, regions.outside)
            elif (variable := getattr(node, "variable", None)) is not None:  # a leaf: a parameter, a model input
                pinned.update(units.owners.get(id(variable), ()))
                regions.join(start, regions.outside)
            else:
                stack.extend(node.next_functions)
    return pinned


def _refuse_unwrapped_shared(ins: list[Slot], sole_reader: set[tuple[int, int]], units: Units) -> None:
    """An input the hooks left unwrapped (its region was read by its unit alone) must still be."""
    for s in ins:
        if not s.wrapped and (s.unit, s.slot) not in sole_reader:
            raise RuntimeError(
                f"LayerScales: the wiring around unit {units.name(s.unit)!r} changed while the "
                f"units ran in their usual order (its input {s.slot} is no longer read by it "
                f"alone), so this backward pass would mix two scales; per-layer scales need one "
                f"wiring per order of the units (a branch taken on some steps only must change "
                f"which units run)."
            )


def _following(outs: list[Slot], out_source: list[int], n: int, device: torch.device) -> torch.Tensor:
    """Per unit, the reader of its output region where all its outputs agree on one (-1: none or the global)."""
    following = [-2] * n  # -2: no output seen
    for s, src in zip(outs, out_source):
        following[s.unit] = src if following[s.unit] in (-2, src) else -1
    return torch.tensor([max(f, -1) for f in following], device=device)


def _rank(order: list[int], n: int, device: torch.device) -> torch.Tensor:
    """Per unit, its position in ``order`` (-1: did not run)."""
    rank = [-1] * n
    for position, unit in enumerate(order):
        rank[unit] = position
    return torch.tensor(rank, device=device)


def _reader_matrix(pairs: list[tuple[int, int]], order: list[int], n: int, device: torch.device) -> torch.Tensor:
    """[units, units] float32: 1 where unit r reads a region unit p writes and r ran after p ((p, r) in pairs)."""
    position = {unit: i for i, unit in enumerate(order)}
    readers = torch.zeros(n, n)
    for p, r in pairs:
        if p in position and r in position and position[p] < position[r]:
            readers[p, r] = 1.0
    return readers.to(device)


def _slot_index(
    ins: list[Slot], in_source: list[int], outs: list[Slot], out_source: list[int], n: int, device: torch.device
) -> SlotIndex:
    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor([v if v >= 0 else n for v in values], dtype=torch.long, device=device)

    return SlotIndex(
        out_unit=index([s.unit for s in outs]),
        out_source=index(out_source),
        in_unit=index([s.unit for s in ins]),
        in_source=index(in_source),
    )
