"""Placement: where a tensor lives and where an op runs, and the host/device partitioner.

Targets are typed (:class:`Target`, :class:`StorageTier`); strings are parsed once at the edge
(CLI, config files) with :meth:`Target.parse` and never passed around inside hetero.
"""

from hetero.placement.annotate import OpRule, PlacementSpec, device_ops, host_ops, on, place
from hetero.placement.explainer import explain
from hetero.placement.partitioner import HeteroModule, partition
from hetero.placement.memory import host_empty
from hetero.placement.target import StorageTier, Target, copy_to, resolve_device

__all__ = [
    "HeteroModule",
    "OpRule",
    "PlacementSpec",
    "StorageTier",
    "Target",
    "copy_to",
    "device_ops",
    "explain",
    "host_empty",
    "host_ops",
    "on",
    "partition",
    "place",
    "resolve_device",
]

