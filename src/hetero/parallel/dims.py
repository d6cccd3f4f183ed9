"""The job's parallel dimensions as one validated value, and the mesh and groups it builds.

:class:`ParallelDims` holds the sizes of the dimensions, outermost first - ``pp`` (pipeline
stages), ``dp`` (data-parallel replicas, also ZeRO's sharding group), ``tp`` (operator-parallel
ranks) - and the parameter servers beside them: ``pp * dp * tp + servers == world size``. A
dimension of size 1 is still there; world size 1 is ``(1, 1, 1)``. :meth:`ParallelDims.build`
makes its device mesh (``hetero.parallel.mesh``) and its data-parallel group
(:class:`~hetero.parallel.env.DataParallelGroup`), which the composition root
(:func:`hetero.parallel.parallelize.parallelize`) and the trainer receive: no process group is
chosen by module state. Reference: torchtitan's ``ParallelDims``.
"""

from __future__ import annotations

import dataclasses
from torch.distributed.device_mesh import DeviceMesh

from hetero.parallel.env import DataParallelGroup, world_size
from hetero.parallel.mesh import MeshConfig, MeshDim, build_mesh, mesh_size


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """The sizes of a job's parallel dimensions (see the module docstring).

    Attributes:
        pp: pipeline stages, one rank each.
        dp: data-parallel replicas (the workers of a parameter-server job).
        tp: operator-parallel ranks per replica.
        zero: the ZeRO stage over ``dp`` (0: none).
        servers: parameter-server processes (the job's last ranks).
        row_sharded: host tables' rows cut over the ``dp`` ranks (else whole on every rank).
        world: the job's processes (``pp * dp * tp + servers``).
        mesh: the ``pp x dp x tp`` device mesh once built (:meth:`build`; ``None`` before, and
            where no dimension needs one).
        dp_group: the data-parallel ranks once built - DDP's, the sparse-gradient exchange's,
            the loss average's (before: the whole job).
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    zero: int = 0
    servers: int = 0
    row_sharded: bool = False
    world: int = 1
    mesh: DeviceMesh | None = dataclasses.field(default=None, compare=False, repr=False)
    dp_group: DataParallelGroup = dataclasses.field(default=DataParallelGroup(), compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "world"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel dimension {name} = {getattr(self, name)}: give a size >= 1")
        if self.pp * self.dp * self.tp + self.servers != self.world:
            raise ValueError(f"pp {self.pp} x dp {self.dp} x tp {self.tp} + {self.servers} servers is not the job's "
                             f"{self.world} ranks: start torchrun --nproc-per-node "
                             f"{self.pp * self.dp * self.tp + self.servers}")
        if not 0 <= self.zero <= 3:
            raise ValueError(f"ZeRO stage {self.zero}: give 0, 1, 2 or 3")
        if self.servers and (self.pp > 1 or self.tp > 1 or self.zero or self.row_sharded):
            raise ValueError("a parameter-server job trains its workers data-parallel with replicated dense parts: "
                             "drop pp, tp, zero and row sharding, or the servers")
        if self.row_sharded and self.dp != self.world:
            raise ValueError(f"row-sharded tables span every rank of the job: dp {self.dp} of {self.world} ranks; "
                             f"drop pp and tp, or shard no rows")

    @classmethod
    def of_job(cls, pp: int = 1, tp: int = 1, zero: int = 0, servers: int = 0, row_sharded: bool = False,
               world: int | None = None) -> "ParallelDims":
        """The dimensions of a job of ``world`` ranks (default: the process group's): ``dp`` is
        what ``pp``, ``tp`` and the servers leave.

        Raises:
            ValueError: the ranks do not divide (naming the sizes and the torchrun command).
        """
        world = world_size() if world is None else world
        workers = world - servers
        if workers < 1 or workers % (pp * tp):
            raise ValueError(f"pp {pp} x tp {tp} does not divide the job's {workers} worker ranks ({world} ranks, "
                             f"{servers} servers): start torchrun --nproc-per-node {pp * tp + servers} (or a "
                             f"multiple of pp x tp, plus the servers)")
        return cls(pp, workers // (pp * tp), tp, zero, servers, row_sharded, world)

    @classmethod
    def of_mesh(cls, mesh: DeviceMesh, zero: int = 0) -> "ParallelDims":
        """The built dimensions of a ``pp x dp x tp`` mesh made by the caller (``build_mesh``)."""
        pp, dp, tp = (mesh_size(mesh, d) for d in (MeshDim.PP, MeshDim.DP, MeshDim.TP))
        return cls(pp, dp, tp, zero, world=mesh.size(), mesh=mesh,
                   dp_group=DataParallelGroup(mesh[MeshDim.DP.value].get_group()))

    @classmethod
    def of_group(cls, group: DataParallelGroup) -> "ParallelDims":
        """The built dimensions of one data-parallel group alone (``dp`` its ranks): what a
        trainer handed a model and its group composes."""
        return cls(dp=group.size, world=group.size, dp_group=group)

    @property
    def meshed(self) -> bool:
        """Whether the job needs a device mesh (operator sharding, a pipeline or ZeRO)."""
        return self.pp > 1 or self.tp > 1 or self.zero > 0

    def build(self, dp_group: DataParallelGroup | None = None, mesh: bool | None = None) -> "ParallelDims":
        """These dimensions with their mesh (``pp x dp x tp`` over the process group; where no
        dimension needs one, none unless ``mesh``) and data-parallel group: the mesh's ``dp``
        dimension, else ``dp_group`` (a parameter-server job's workers), else the whole job.
        Collective: every rank calls it (a server of a parameter-server job builds nothing)."""
        mesh = build_mesh(MeshConfig(pp=self.pp, tp=self.tp)) if (self.meshed if mesh is None else mesh) else None
        if mesh is not None:
            dp_group = DataParallelGroup(mesh[MeshDim.DP.value].get_group())
        return dataclasses.replace(self, mesh=mesh, dp_group=dp_group if dp_group is not None else DataParallelGroup())
