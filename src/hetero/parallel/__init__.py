"""Distributed training on torch.distributed: the process group, the device mesh, data
parallelism, row-sharded host tables, operator-level sharding on DTensor, recompute, ZeRO,
communication fusion, and ``parallelize`` (one order for the dimensions: operator sharding, recompute, ZeRO).


"""

from hetero.parallel.data_parallel import (
    DataParallelConfig,
    DistributedSparse,
    HostReplicaOptimizer,
    check_replicas,
    data_parallel,
)
from hetero.parallel.full_state import (
    full_model_state,
    full_optimizer_state,
    global_shapes,
    load_full_optimizer_state,
    local_model_state,
)
from hetero.parallel.comm_fusion import CommFusion, FusionMode
from hetero.parallel.dataset import DatasetStrategy, shard_batch
from hetero.parallel.mesh import MeshConfig, MeshDim, build_mesh
from hetero.parallel.operator import shard
from hetero.parallel.operator_plan import (
    ShardingPlan,
    apply_sharding,
    infer_predict_layout,
    load_strategy,
    save_strategy,
)
from hetero.parallel.checkpoint_state import load_distributed_checkpoint, save_distributed_checkpoint
from hetero.parallel.dims import ParallelDims
from hetero.parallel.parallelize import ParallelPlan, Parallelized, parallelize
from hetero.parallel.recompute import RecomputeConfig, RecomputeOp, apply_recompute, recompute
from hetero.parallel.row_sharded import gather_rows, shard_rows, sharded_tables
from hetero.parallel.zero import ZeroConfig, ZeroStage, apply_zero, zero_optimizer
from hetero.parallel.env import (
    DataParallelGroup,
    DistConfig,
    active,
    barrier,
    global_batch_mean,
    global_mean,
    global_rank,
    init,
    local_rank,
    rank,
    shutdown,
    world_size,
)

__all__ = [
    "CommFusion",
    "DataParallelConfig",
    "DatasetStrategy",
    "DataParallelGroup",
    "DistConfig",
    "DistributedSparse",
    "FusionMode",
    "HostReplicaOptimizer",
    "MeshConfig",
    "MeshDim",
    "ParallelDims",
    "ParallelPlan",
    "Parallelized",
    "RecomputeConfig",
    "RecomputeOp",
    "ShardingPlan",
    "ZeroConfig",
    "ZeroStage",
    "active",
    "apply_recompute",
    "apply_sharding",
    "apply_zero",
    "barrier",
    "build_mesh",
    "check_replicas",
    "data_parallel",
    "full_model_state",
    "full_optimizer_state",
    "load_full_optimizer_state",
    "gather_rows",
    "global_batch_mean",
    "global_mean",
    "global_rank",
    "global_shapes",
    "infer_predict_layout",
    "load_distributed_checkpoint",
    "load_strategy",
    "local_model_state",
    "init",
    "local_rank",
    "parallelize",
    "rank",
    "recompute",
    "save_distributed_checkpoint",
    "save_strategy",
    "shard",
    "shard_batch",
    "shard_rows",
    "sharded_tables",
    "shutdown",
    "world_size",
    "zero_optimizer",
]
