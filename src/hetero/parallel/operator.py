"""Operator-level parallelism (semi-auto): sharding strategies on ``torch.distributed.tensor``.

A strategy gives, for each tensor input of an operator, the number of slices of each of its
dimensions - the reference design's ``shard(((2, 1), (1, 4)))`` on a MatMul: rows of the first
input in 2, columns of the second in 4. The operator's *signature* (einsum letters per input,
e.g. ``mk,kn->mn``) says which input dimensions are the same iteration dimension; the slice
counts of the sliced letters form the operator's device matrix, whose product must be the size of
the mesh's ``dp x tp`` part, and each sliced letter takes the next mesh dimension of its size
(outermost first). An input dimension whose letter is sliced becomes ``Shard(d)`` on that mesh
dimension, everything else ``Replicate()``; DTensor then computes every op exactly as the
unsharded one (a sliced contraction letter gives a ``Partial`` output, reduced on demand).

:func:`shard` wraps a function or module this way. Inputs that are plain tensors are taken as the
same global tensor on every rank (replicated); turning them into shards is a local slice, no
communication. Reference: MindSpore's semi-auto parallel ``Primitive.shard``; torch's
``distribute_tensor`` / ``redistribute``; GSPMD-style dimension mapping.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from hetero.parallel.mesh import MeshDim

Strategy = tuple[tuple[int, ...], ...]  # per tensor input: slices per dimension


@dataclasses.dataclass(frozen=True)
class OpSignature:
    """Einsum letters of each input's dimensions and of the output's, e.g. ``mk,kn->mn``.

    ``None`` means elementwise: inputs of any rank, right-aligned as broadcasting aligns them.
    """

    inputs: tuple[str, ...] | None
    output: str | None

    @staticmethod
    def parse(spec: str | None) -> "OpSignature":
        if spec is None:
            return OpSignature(None, None)
        lhs, _, rhs = spec.partition("->")
        return OpSignature(tuple(lhs.split(",")), rhs)

    def letters(self, ranks: Sequence[int]) -> tuple[tuple[str, ...], str]:
        """Each input's letters and the output's, for inputs of ``ranks`` dimensions."""
        if self.inputs is None:
            width = max(ranks, default=0)
            names = "abcdefghij"[:width]
            return tuple(names[width - r :] for r in ranks), names
        return self.inputs, self.output


SIGNATURES = {"matmul": "mk,kn->mn", "linear": "mk,nk->mn", "bmm": "bmk,bkn->bmn"}


def _fail(op: str, what: str) -> ValueError:
    return ValueError(f"sharding strategy of {op}: {what}")


def device_matrix(op: str, signature: OpSignature, strategy: Strategy, shapes: Sequence[Sequence[int]]) -> dict[str, int]:
    """Slice count of every iteration letter, checked against the input shapes.

    Raises:
        ValueError: a strategy for another number of inputs or dimensions, a slice count below 1
            or not dividing its dimension, or one letter sliced differently by two inputs - naming
            the op, the input, the dimension and the valid choices.
    """
    if len(strategy) != len(shapes):
        raise _fail(op, f"{len(strategy)} input strategies for {len(shapes)} tensor inputs; give one tuple per input")
    letters, _ = signature.letters([len(s) for s in shapes])
    matrix: dict[str, int] = {}
    for i, (slices, shape, names) in enumerate(zip(strategy, shapes, letters)):
        if len(slices) != len(shape):
            raise _fail(op, f"input {i} has {len(shape)} dimensions {tuple(shape)}, its strategy {tuple(slices)} "
                            f"has {len(slices)}; give one slice count per dimension")
        for d, (k, size, name) in enumerate(zip(slices, shape, names)):
            valid = [c for c in range(1, size + 1) if size % c == 0]
            if not isinstance(k, int) or k < 1 or size % k:
                raise _fail(op, f"input {i} dimension {d} (size {size}) cannot be cut in {k} slices; valid slice counts "
                                f"are the divisors of {size}: {valid}")
            if size == 1 and k == 1 and name in matrix:
                continue  # a broadcast dimension takes the other input's slicing
            if matrix.setdefault(name, k) != k:
                raise _fail(op, f"input {i} dimension {d} is cut in {k} slices, but another input cuts the same "
                                f"dimension ({name!r} of {signature.inputs or 'the elementwise op'}) in {matrix[name]}; "
                                f"give both the same slice count")
    return matrix


def assign_mesh(op: str, matrix: dict[str, int], mesh: DeviceMesh, exact: bool = True) -> dict[str, int]:
    """The mesh dimension (index) of every sliced letter: the next unused ``dp``/``tp`` dimension of
    its size, in letter order (the reference's device matrix, outermost first). A mesh may lack
    ``dp`` (``mesh["tp"]``: the operator-parallel ranks of one data-parallel replica).

    ``exact=False`` (an output layout): the product may be smaller; the mesh dimensions left over
    replicate.

    Raises:
        ValueError: the device matrix's product is not the size of the mesh's ``dp x tp`` part,
            or a slice count matches no mesh dimension.
    """
    names = [d.value for d in (MeshDim.DP, MeshDim.TP) if d.value in mesh.mesh_dim_names]
    dims = [mesh.mesh_dim_names.index(n) for n in names]
    return assign_sizes(op, matrix, {i: mesh.size(i) for i in dims}, exact, tuple(names))


def assign_sizes(op: str, matrix: dict[str, int], sizes: dict[int, int], exact: bool = True,
                 names: tuple[str, ...] = ("dp", "tp")) -> dict[str, int]:
    """:func:`assign_mesh` over mesh dimension index -> size (no mesh needed: planning, explain);
    ``names``: those dimensions' names (for errors)."""
    total = math.prod(sizes.values())
    sliced = {name: k for name, k in matrix.items() if k > 1}
    if (math.prod(sliced.values()) != total) if exact else (total % math.prod(sliced.values())):
        raise _fail(op, f"the device matrix {tuple(matrix.values())} multiplies to {math.prod(sliced.values())}, the mesh's "
                        f"{' x '.join(names)} part has {total} ranks ({dict(zip(names, sizes.values()))}); the slice counts "
                        f"must multiply to {total}")
    free, out = list(sizes), {}
    for name, k in sliced.items():
        match = next((i for i in free if sizes[i] == k), None)
        if match is None:
            raise _fail(op, f"{k} slices match no free mesh dimension; valid slice counts are the sizes of dp and tp: "
                            f"{sorted(set(sizes.values()))}")
        free.remove(match)
        out[name] = match
    return out


def placements(letters: str, assignment: dict[str, int], mesh: DeviceMesh) -> list[Placement]:
    """DTensor placements (one per mesh dimension) of a tensor whose dimensions are ``letters``."""
    out: list[Placement] = [Replicate()] * mesh.ndim
    for name, mesh_dim in assignment.items():
        if name in letters:
            out[mesh_dim] = Shard(letters.index(name))
    return out


def to_dtensor(x: torch.Tensor, mesh: DeviceMesh, place: Sequence[Placement]) -> DTensor:
    """``x`` with ``place``: a DTensor is redistributed; a plain tensor is taken as the same global
    value on every rank, so sharding it is a local slice (no communication)."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return x.redistribute(mesh, list(place))


def shard(fn: Callable[..., Any], in_strategy: Strategy, out_strategy: tuple[int, ...] | None = None, *,
          mesh: DeviceMesh, signature: str | None = None, name: str | None = None) -> Callable[..., Any]:
    """``fn`` (a function or module) with its tensor inputs sharded by ``in_strategy``.

    Args:
        fn: e.g. ``torch.mul``, ``torch.matmul``, an ``nn.Module``.
        in_strategy: per tensor input (in call order), its slices per dimension.
        out_strategy: slices per dimension of the output (``None``: whatever DTensor computes,
            a ``Partial`` output for a sliced contraction included).
        mesh: from :func:`hetero.parallel.mesh.build_mesh`.
        signature: einsum letters (``"mk,kn->mn"``) or a name in :data:`SIGNATURES`; ``None``:
            elementwise with broadcasting.
        name: the op's name in error messages.

    Returns a callable with ``fn``'s signature whose output is a ``DTensor`` on ``mesh``.

    Raises:
        ValueError: (at the first call, when the shapes are known) see :func:`device_matrix` and
            :func:`assign_mesh`.
    """
    sig = OpSignature.parse(SIGNATURES.get(signature, signature))
    op = name or getattr(fn, "__name__", type(fn).__name__)

    @functools.wraps(fn)
    def sharded(*args: Any, **kwargs: Any) -> Any:
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        shapes = [tuple(args[i].shape) for i in tensors]
        matrix = device_matrix(op, sig, in_strategy, shapes)
        assignment = assign_mesh(op, matrix, mesh)
        letters, out_letters = sig.letters([len(s) for s in shapes])
        args = list(args)
        for i, names in zip(tensors, letters):
            args[i] = to_dtensor(args[i], mesh, placements(names, assignment, mesh))
        out = fn(*args, **kwargs)
        if out_strategy is not None:
            out_matrix = {n: k for n, k in zip(out_letters, out_strategy)}
            out = out.redistribute(mesh, placements(out_letters, assign_mesh(f"{op} output", out_matrix, mesh, exact=False),
                                                    mesh))
        return out

    return sharded
