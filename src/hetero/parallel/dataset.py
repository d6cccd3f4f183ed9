"""Dataset strategy: how a batch's inputs feed the mesh's data dimension.

The reference design's ``dataset_strategy``: ``full_batch`` (every rank reads the whole batch),
``data_parallel`` (each rank one slice of the batch), or per input a tuple of slice counts, each
input sliced in at most one dimension. :func:`shard_batch` turns the global batch (every rank
holds it, as every rank reads the same file) into DTensors whose local part is what the rank
computes on; the slicing is local (no communication).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from hetero.parallel.mesh import MeshDim
from hetero.parallel.operator import to_dtensor


class DatasetStrategy(enum.Enum):
    """Whole batches on every rank, or the batch cut over the data-parallel dimension."""

    FULL_BATCH = "full_batch"
    DATA_PARALLEL = "data_parallel"


def batch_placements(strategy: DatasetStrategy | Sequence[Sequence[int]], shapes: Sequence[Sequence[int]],
                     mesh: DeviceMesh) -> list[list[Placement]]:
    """Placements of each input under ``strategy``.

    A slice count ``k`` of a dimension takes the ``dp`` dimension when ``k`` is its size, or
    ``dp`` and ``tp`` together when ``k`` is ``dp x tp`` (every rank a slice).

    Raises:
        ValueError: an input sliced in two dimensions, a slice count that is neither size or does
            not divide its dimension, or a strategy for another number of inputs - naming the
            input, the dimension and the valid choices.
    """
    names = mesh.mesh_dim_names
    dp, tp = names.index(MeshDim.DP.value), names.index(MeshDim.TP.value)
    if strategy is DatasetStrategy.FULL_BATCH:
        return [[Replicate()] * mesh.ndim for _ in shapes]
    if strategy is DatasetStrategy.DATA_PARALLEL:
        strategy = [(mesh.size(dp),) + (1,) * (len(s) - 1) for s in shapes]
    if len(strategy) != len(shapes):
        raise ValueError(f"dataset strategy: {len(strategy)} tuples for {len(shapes)} inputs; give one per input")
    choices = sorted({1, mesh.size(dp), mesh.size(dp) * mesh.size(tp)})
    out = []
    for i, (slices, shape) in enumerate(zip(strategy, shapes)):
        if len(slices) != len(shape):
            raise ValueError(f"dataset strategy: input {i} has {len(shape)} dimensions {tuple(shape)}, its strategy "
                             f"{tuple(slices)} has {len(slices)}")
        cut = [d for d, k in enumerate(slices) if k != 1]
        if len(cut) > 1:
            raise ValueError(f"dataset strategy: input {i} is sliced in dimensions {cut}; an input is sliced in at most "
                             f"one dimension (valid: one slice count from {choices[1:]}, the others 1)")
        place: list[Placement] = [Replicate()] * mesh.ndim
        for d in cut:
            k = slices[d]
            if k not in choices or shape[d] % k:
                raise ValueError(f"dataset strategy: input {i} dimension {d} (size {shape[d]}) cannot be cut in {k}; "
                                 f"valid slice counts are the data-parallel sizes {choices} that divide {shape[d]}")
            place[dp] = Shard(d)
            if k == mesh.size(dp) * mesh.size(tp) and mesh.size(tp) > 1:
                place[tp] = Shard(d)
        out.append(place)
    return out


def shard_batch(inputs: Sequence[torch.Tensor], strategy: DatasetStrategy | Sequence[Sequence[int]],
                mesh: DeviceMesh) -> list[DTensor]:
    """The global batch ``inputs`` (the same on every rank) as DTensors laid out by ``strategy``."""
    place = batch_placements(strategy, [tuple(x.shape) for x in inputs], mesh)
    return [to_dtensor(x, mesh, p) for x, p in zip(inputs, place)]
