"""The SSD storage tier of host tables: each row with its sparse-optimizer state in a file on a
local disk, under a DRAM row cache with write-back (``docs/ssd-tier.md``).

A table is put there with ``TableConfig(storage=StorageTier.SSD, ssd=SsdConfig(...))`` (or the
job's ``[tables] storage = "ssd"``); its group lays its rows out when its sparse optimizer is built.
"""

from hetero.storage.cache import CachePolicy, CacheStats, RowCache
from hetero.storage.config import SsdConfig
from hetero.storage.layout import Field, RecordLayout, StagedRecords
from hetero.storage.records import RowFile
from hetero.storage.tier import SsdRows

__all__ = ["CachePolicy", "CacheStats", "Field", "RecordLayout", "RowCache", "RowFile", "SsdConfig", "SsdRows",
           "StagedRecords"]
