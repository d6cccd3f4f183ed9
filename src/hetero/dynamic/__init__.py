"""Dynamic embedding tables: looked up by raw int64 keys, each admitted key a row of its own,
bounded by a capacity with admission and eviction (``docs/dynamic-tables.md``).

A table is made dynamic with ``TableConfig(keys=Keys.DYNAMIC, dynamic=DynamicConfig(...))``; its
``num_embeddings`` is its capacity.
"""

from hetero.dynamic.config import DynamicConfig, Eviction, Keys
from hetero.dynamic.keymap import Assignment, DynamicStats, KeyMap

__all__ = ["Assignment", "DynamicConfig", "DynamicStats", "Eviction", "KeyMap", "Keys"]
