"""Sharding propagation: layouts for the operators a plan leaves unannotated.

Over the forward graph (torch.fx, the partitioner's capture), every operator with a known
signature gets a layout: which mesh dimension cuts which of its iteration letters (each mesh
dimension of size > 1 cuts one letter: every operator uses every rank, the reference design's
device-matrix rule). An annotated operator's layout is fixed by its strategy; the others are
chosen to minimise the bytes the redistributions between producers and consumers move. The cost
of an edge is the bytes per rank of the collectives DTensor issues for it (:func:`edge_bytes`,
priced by :func:`hetero.parallel.comm.collective_bytes`): Replicate->Shard is a local slice,
Shard->Replicate an all-gather, Partial->Replicate an all-reduce, Partial->Shard a
reduce-scatter, Shard(a)->Shard(b) an all-to-all. The search is dynamic programming over the graph in
topological order: exact where every value has one consumer (chains, in-trees); with fan-out a
shared producer's cost is counted per consumer (an upper bound). Reference: the reference
design's sharding propagation; Alpa's intra-operator ILP (Zheng et al. 2022) and GSPMD
(Xu et al. 2021) for the cost model.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from hetero.parallel.comm import Collective, collective_bytes
from hetero.parallel.operator import OpSignature, Strategy, assign_sizes

ELEMENTWISE = {operator.add, operator.mul, operator.sub, operator.truediv, torch.add, torch.mul, torch.sub,
               torch.relu, torch.tanh, torch.sigmoid, nn.functional.relu, nn.functional.gelu}
ELEMENTWISE_MODULES = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU)
MATMUL = {torch.matmul, operator.matmul}

# A placement per mesh dimension: ("R",), ("S", dim) or ("P",)
Place = tuple


@dataclasses.dataclass(frozen=True)
class OpLayout:
    """One operator's layout: the letter each mesh dimension cuts (``None``: not cut)."""

    cuts: tuple[str | None, ...]


@dataclasses.dataclass
class _Op:
    node: fx.Node
    inputs: tuple[str, ...]  # letters of each tensor input that is itself an op's output or a graph input
    output: str
    args: list[fx.Node]  # the producers of those inputs, in order
    strategy_letters: tuple[str, ...]  # the letters of each input of a strategy (nn.Linear: the input and its weight)


@dataclasses.dataclass
class Propagation:
    """The result: every operator's layout, its output placements, and the redistributions.

    Attributes:
        layouts: node name -> :class:`OpLayout`.
        output_placements: node name -> placement per mesh dimension of its output.
        redistributions: ``(producer, consumer, from, to, bytes, collectives)`` per edge that
            moves data (collectives in the order DTensor issues them).
        total_bytes: their sum, per rank and step.
    """

    layouts: dict[str, OpLayout]
    output_placements: dict[str, tuple[Place, ...]]
    redistributions: list[tuple[str, str, tuple[Place, ...], tuple[Place, ...], float, tuple[Collective, ...]]]
    total_bytes: float

    def __str__(self) -> str:
        def text(places: tuple[Place, ...]) -> str:
            return "[" + ", ".join("R" if p[0] == "R" else "P" if p[0] == "P" else f"S({p[1]})" for p in places) + "]"

        lines = [f"{name}: output {text(self.output_placements[name])}" for name in self.layouts]
        lines += [f"redistribute {a} -> {b}: {text(x)} -> {text(y)} by {' + '.join(c.value for c in calls)}, "
                  f"{n:.0f} B per rank" for a, b, x, y, n, calls in self.redistributions]
        lines.append(f"per step: {self.total_bytes:.0f} B redistributed per rank")
        return "\n".join(lines)


def signature_of(node: fx.Node, root: nn.Module) -> OpSignature | None:
    """The einsum signature of a node, or ``None`` for an operator propagation does not model."""
    if node.op == "call_function" and node.target in MATMUL:
        return OpSignature.parse("mk,kn->mn")
    if node.op == "call_function" and node.target in ELEMENTWISE:
        return OpSignature(None, None)
    if node.op == "call_method" and node.target in ("relu", "tanh", "sigmoid", "add", "mul"):
        return OpSignature(None, None)
    if node.op == "call_module":
        m = root.get_submodule(str(node.target))
        if isinstance(m, nn.Linear):
            return OpSignature.parse("mk->mn")  # the weight is the module's: its layout follows the cut
        if isinstance(m, ELEMENTWISE_MODULES):
            return OpSignature(None, None)
    return None


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = getattr(node, "meta", {}).get("tensor_meta") if isinstance(node, fx.Node) else None
    return tuple(meta.shape) if meta is not None else None


def _bytes(node: fx.Node) -> float:
    meta = node.meta["tensor_meta"]
    return math.prod(meta.shape) * meta.dtype.itemsize


def _ops(gm: fx.GraphModule) -> list[_Op]:
    out = []
    for node in gm.graph.nodes:
        sig = signature_of(node, gm)
        if sig is None or _shape(node) is None:
            continue
        producers = [a for a in node.args if isinstance(a, fx.Node) and _shape(a) is not None]
        ranks = [len(_shape(a)) for a in producers]
        linear = node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.Linear)
        if linear and len(ranks) == 1 and ranks[0] >= 2:
            batch = "abcdefgh"[: ranks[0] - 2] + "m"  # (..., m, k): every leading dimension is a batch letter
            out.append(_Op(node, (batch + "k",), batch + "n", producers, (batch + "k", "kn")))
            continue
        letters, out_letters = sig.letters(ranks)
        if len(letters) != len(producers) or any(len(a) != r for a, r in zip(letters, ranks)):
            continue  # not modelled: DTensor decides at run time
        out.append(_Op(node, tuple(letters), out_letters, producers, tuple(letters)))
    return out


def candidates(op: _Op, mesh_dims: Sequence[int]) -> list[OpLayout]:
    """Every layout of ``op``: each mesh dimension cuts a distinct letter of the operator."""
    letters = sorted(set("".join(op.strategy_letters) + op.output))
    return [OpLayout(tuple(c)) for c in itertools.permutations(letters, len(mesh_dims))]


def output_place(op: _Op, layout: OpLayout) -> tuple[Place, ...]:
    out = []
    for letter in layout.cuts:
        if letter in op.output:
            out.append(("S", op.output.index(letter)))
        elif any(letter in ins for ins in op.strategy_letters):
            out.append(("P",))  # a contraction letter: partial sums
        else:
            out.append(("R",))
    return tuple(out)


def input_place(letters: str, layout: OpLayout) -> tuple[Place, ...]:
    return tuple(("S", letters.index(c)) if c in letters else ("R",) for c in layout.cuts)


def edge_bytes(src: tuple[Place, ...], dst: tuple[Place, ...], nbytes: float, sizes: Sequence[int],
               all_to_all: bool = True) -> float:
    """Bytes per rank to turn a tensor of ``nbytes`` (global) from placements ``src`` into ``dst``
    (the sum over :func:`edge_collectives`)."""
    return sum(b for _, _, b in edge_collectives(src, dst, nbytes, sizes, all_to_all))


def edge_collectives(src: tuple[Place, ...], dst: tuple[Place, ...], nbytes: float, sizes: Sequence[int],
                     all_to_all: bool = True) -> list[tuple[int, Collective, float]]:
    """The collectives (mesh dimension, kind, bytes per rank) that turn a tensor of ``nbytes``
    (global) from placements ``src`` into ``dst``.

    The mesh dimensions change one at a time, as DTensor's ``redistribute`` does them (torch
    2.13, measured): from the innermost mesh dimension out, each collective on the local tensor
    of that moment (a gather of an inner dimension moves less while outer dimensions still cut
    the tensor; an outer reduction after an inner gather reduces the gathered tensor).
    ``Shard(a) -> Shard(b)`` is an all-to-all, or with ``all_to_all=False`` (gloo, which has
    none) an all-gather and a local slice; when several mesh dimensions change their sharded
    dimension at once, DTensor gathers them all first. Replicate -> Shard is a local slice.
    """
    place = list(src)
    n_dims = len(sizes)

    def local() -> float:
        return nbytes / math.prod(sizes[e] for e in range(n_dims) if place[e][0] == "S")

    out: list[tuple[int, Collective, float]] = []
    swaps = [d for d in range(n_dims) if sizes[d] > 1 and src[d][0] == dst[d][0] == "S" and src[d] != dst[d]]
    if len(swaps) > 1:
        for d in reversed(swaps):
            out.append((d, Collective.ALL_GATHER, collective_bytes(Collective.ALL_GATHER, local(), sizes[d])))
            place[d] = ("R",)
    for d in reversed(range(n_dims)):
        a, b, n = place[d], dst[d], sizes[d]
        if a == b or n == 1:
            continue
        if a[0] == "S" and b[0] == "S":
            kind = Collective.ALL_TO_ALL if all_to_all else Collective.ALL_GATHER
        elif a[0] == "S" and b[0] == "R":
            kind = Collective.ALL_GATHER
        elif a[0] == "P":
            kind = Collective.ALL_REDUCE if b[0] == "R" else Collective.REDUCE_SCATTER
        else:
            kind = None  # Replicate -> Shard: a local slice
        if kind is not None:
            out.append((d, kind, collective_bytes(kind, local(), n)))
        place[d] = b
    return out


def layout_of_strategy(op: _Op, strategy: Strategy, sizes: Sequence[int], mesh_dims: Sequence[int]) -> OpLayout:
    """The layout an annotated operator's strategy implies (letters cut in order onto the mesh
    dimensions of their slice counts, as :func:`hetero.parallel.operator.assign_mesh` does).

    Raises:
        ValueError: slice counts that do not fit the mesh (see :func:`assign_sizes`)."""
    matrix: dict[str, int] = {}
    for letters, slices in zip(op.strategy_letters, strategy):
        for c, k in zip(letters, slices):
            matrix.setdefault(c, k)
    assignment = assign_sizes(op.node.name, matrix, {d: sizes[d] for d in mesh_dims})
    return OpLayout(tuple(next(c for c, dim in assignment.items() if dim == d) for d in mesh_dims))


def propagate(gm: fx.GraphModule, strategies: dict[str, Strategy], sizes: Sequence[int], all_to_all: bool = True,
              training: bool = False) -> Propagation:
    """Choose every modelled operator's layout (see the module docstring).

    Args:
        gm: a traced module whose nodes carry ``tensor_meta`` (``ShapeProp`` on example inputs).
        strategies: node name -> strategy of the annotated operators.
        sizes: the mesh's dimension sizes (all of them; those of size 1 cut nothing).
        all_to_all: whether the backend has all-to-all (NCCL); gloo has not (see :func:`edge_bytes`).
        training: an ``nn.Linear`` whose layout leaves its weight whole on a mesh dimension that
            cuts its input also pays its weight gradient's all-reduce there (the partial sums of
            its rows' gradients); without it, the forward's redistributions alone are priced.
    """
    mesh_dims = [d for d, n in enumerate(sizes) if n > 1]
    ops = _ops(gm)
    by_node = {op.node: op for op in ops}
    best: dict[fx.Node, dict[OpLayout, tuple[float, dict[fx.Node, OpLayout]]]] = {}
    for op in ops:
        name = op.node.name
        cands = [layout_of_strategy(op, strategies[name], sizes, mesh_dims)] if name in strategies else candidates(op, mesh_dims)
        table = {}
        for c in cands:
            cost, choice = (_weight_gradient_bytes(gm, op, c, sizes, mesh_dims) if training else 0.0), {op.node: c}
            for letters, prod in zip(op.inputs, op.args):
                need = _expand(input_place(letters, c), sizes, mesh_dims)
                nbytes = _bytes(prod)
                if prod not in by_node:
                    continue  # a graph input: whole on every rank, sliced locally
                options = [(sub + edge_bytes(_expand(output_place(by_node[prod], pc), sizes, mesh_dims), need, nbytes, sizes, all_to_all),
                            picks) for pc, (sub, picks) in best[prod].items()]
                sub, picks = min(options, key=lambda o: o[0])
                cost += sub
                choice = {**picks, **choice}
            table[c] = (cost, choice)
        best[op.node] = table
    sinks = [op for op in ops if not any(u in by_node for u in op.node.users)]
    layouts: dict[fx.Node, OpLayout] = {}
    for op in sinks:
        _, choice = min(best[op.node].values(), key=lambda v: v[0])
        layouts.update(choice)
    return _report(ops, by_node, layouts, sizes, mesh_dims, all_to_all)


def _weight_gradient_bytes(gm: fx.GraphModule, op: _Op, layout: OpLayout, sizes: Sequence[int],
                           mesh_dims: Sequence[int]) -> float:
    """Bytes per rank of the all-reduces an ``nn.Linear``'s weight gradient needs under ``layout``:
    on each mesh dimension that cuts a batch letter (the weight is whole there)."""
    if op.node.op != "call_module" or not isinstance(m := gm.get_submodule(str(op.node.target)), nn.Linear):
        return 0.0
    local = float(sum(p.numel() * p.element_size() for p in m.parameters()))
    for d, letter in zip(mesh_dims, layout.cuts):
        if letter in ("k", "n"):
            local /= sizes[d]  # the weight is cut there: a smaller piece to reduce elsewhere
    return sum(collective_bytes(Collective.ALL_REDUCE, local, sizes[d]) for d, letter in zip(mesh_dims, layout.cuts)
               if letter not in ("k", "n"))


def _expand(places: tuple[Place, ...], sizes: Sequence[int], mesh_dims: Sequence[int]) -> tuple[Place, ...]:
    """Placements over every mesh dimension (those of size 1 replicate) from those over ``mesh_dims``."""
    out = [("R",)] * len(sizes)
    for d, p in zip(mesh_dims, places):
        out[d] = p
    return tuple(out)


def _report(ops, by_node, layouts, sizes, mesh_dims, all_to_all=True) -> Propagation:  # noqa: ANN001
    out_places = {op.node.name: _expand(output_place(op, layouts[op.node]), sizes, mesh_dims) for op in ops}
    moves, total = [], 0.0
    for op in ops:
        for letters, prod in zip(op.inputs, op.args):
            if prod not in by_node:
                continue
            src = out_places[prod.name]
            dst = _expand(input_place(letters, layouts[op.node]), sizes, mesh_dims)
            calls = edge_collectives(src, dst, _bytes(prod), sizes, all_to_all)
            b = sum(c[2] for c in calls)
            if b:
                moves.append((prod.name, op.node.name, src, dst, b, tuple(c[1] for c in calls)))
                total += b
    return Propagation({op.node.name: layouts[op.node] for op in ops}, out_places, moves, total)
