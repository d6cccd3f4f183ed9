"""TorchRec models on hetero's tables (``pip install hetero[torchrec]``): a model's
``EmbeddingBagCollection`` / ``EmbeddingCollection`` become hetero's (host DRAM, the SSD tier,
dynamic tables, row-sharded), with TorchRec's inputs, outputs, state_dict keys and sparse
optimizers. See docs/torchrec.md. ``import hetero`` does not import this package.
"""

from hetero.torchrec.model_parallel import DistributedModelParallel, shard_modules
from hetero.torchrec.modules import EmbeddingBagCollection, EmbeddingCollection, table_config
from hetero.planner.table_plan import SparseRule, TablePlan
from hetero.torchrec.optimizer import FusedTables

__all__ = [
    "DistributedModelParallel",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "FusedTables",
    "SparseRule",
    "TablePlan",
    "shard_modules",
    "table_config",
]
