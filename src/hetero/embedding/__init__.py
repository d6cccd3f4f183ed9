"""Host-resident embedding tables: lookup on the host, only the looked-up rows go to the device.

The counterpart of MindSpore's ``EmbeddingLookup(target="CPU", sparse=True)``; the tables are
trained by the sparse optimizers in :mod:`hetero.optim`.
"""

from hetero.embedding.collection import (
    HostEmbeddingCollection,
    drop_started_lookups,
    move_tables_to_device,
    move_tables_to_ssd,
    start_lookups,
)
from hetero.embedding.exchange import LocalRows, RowExchange, RowPlacement, RowSpace
from hetero.embedding.grad import PendingGrads, SparseGrad
from hetero.embedding.kernels import set_num_threads
from hetero.embedding.prefetch import PrefetchConfig, Prefetcher
from hetero.embedding.config import INIT_CHUNK, Pooling, TableConfig, init_rows
from hetero.embedding.table import (
    DeviceEmbedding,
    HostEmbedding,
    defer_tables,
    dense_parameters,
    device_tables,
    host_tables,
    table_groups,
)

__all__ = [
    "INIT_CHUNK",
    "DeviceEmbedding",
    "HostEmbedding",
    "HostEmbeddingCollection",
    "LocalRows",
    "PendingGrads",
    "Pooling",
    "PrefetchConfig",
    "Prefetcher",
    "RowExchange",
    "RowPlacement",
    "RowSpace",
    "SparseGrad",
    "TableConfig",
    "defer_tables",
    "drop_started_lookups",
    "dense_parameters",
    "device_tables",
    "host_tables",
    "init_rows",
    "move_tables_to_device",
    "move_tables_to_ssd",
    "set_num_threads",
    "start_lookups",
    "table_groups",
]
