"""The job's device mesh: one ``DeviceMesh`` with named dimensions, outermost first.

``pp`` (pipeline stages), ``dp`` (data parallel, also the ZeRO sharding group), ``tp`` (operator
parallel). A dimension of size 1 is still there, so code never special-cases a missing one; a
single process is the mesh ``(1, 1, 1)`` over a one-rank gloo group (DTensor needs a process
group even then). Reference: torchtitan's ``ParallelDims``; the reference design's device matrix.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class MeshDim(enum.Enum):
    """The mesh's dimensions, in mesh order (outermost first)."""

    PP = "pp"
    DP = "dp"
    TP = "tp"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh's dimensions; ``dp`` is what the world size leaves.

    Attributes:
        tp: ranks that split each sharded operator (operator / tensor parallel degree).
        pp: pipeline stages.
    """

    tp: int = 1
    pp: int = 1

    def shape(self, world_size: int) -> tuple[int, int, int]:
        """``(pp, dp, tp)`` for ``world_size`` ranks.

        Raises:
            ValueError: a size below 1, or ``pp * tp`` that does not divide the world size.
        """
        for name, size in (("tp", self.tp), ("pp", self.pp)):
            if size < 1:
                raise ValueError(f"mesh dimension {name} must be >= 1, got {size}")
        if world_size % (self.pp * self.tp):
            raise ValueError(f"a mesh of pp={self.pp} x tp={self.tp} does not divide the world size {world_size}; "
                             f"choose pp * tp among the divisors of {world_size}: "
                             f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}")
        return self.pp, world_size // (self.pp * self.tp), self.tp


def build_mesh(config: MeshConfig = MeshConfig()) -> DeviceMesh:
    """The job's ``DeviceMesh`` with dimensions named ``pp``, ``dp``, ``tp``.

    Joins a one-rank gloo group when no process group exists (a single process). CUDA meshes
    when the default group is NCCL, CPU meshes otherwise. Collective: every rank calls it.

    Raises:
        ValueError: as :meth:`MeshConfig.shape`.
    """
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    shape = config.shape(dist.get_world_size())
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, shape, mesh_dim_names=tuple(d.value for d in MeshDim))


def mesh_size(mesh: DeviceMesh, dim: MeshDim) -> int:
    return mesh.size(mesh.mesh_dim_names.index(dim.value))


def torch_device(mesh: DeviceMesh) -> torch.device:
    return torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
