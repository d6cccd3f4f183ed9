"""Placement vocabulary: where a tensor lives and where an op runs.

Targets are typed (:class:`Target`, :class:`StorageTier`); strings are parsed once at the edge
(CLI, config files) with :meth:`Target.parse` and never passed around inside hetero.
"""

from hetero.placement.memory import host_empty
from hetero.placement.target import StorageTier, Target, copy_to, resolve_device

__all__ = ["StorageTier", "Target", "copy_to", "host_empty", "resolve_device"]
