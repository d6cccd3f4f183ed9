"""Placement: where a tensor lives and where an op runs, and the host/device partitioner.

Targets are typed (:class:`Target`, :class:`StorageTier`); strings are parsed once at the edge
(CLI, config files) with :meth:`Target.parse` and never passed around inside hetero.
"""

from hetero.placement.annotate import OpRule, PlacementSpec, device_ops, host_ops, on, place
from hetero.placement.memory import host_empty
from hetero.placement.target import StorageTier, Target, copy_to, resolve_device

__all__ = [
    "OpRule",
    "PlacementSpec",
    "StorageTier",
    "Target",
    "copy_to",
    "device_ops",
    "host_empty",
    "host_ops",
    "on",
    "place",
    "resolve_device",
]


def __getattr__(name: str):
    # The partitioner imports torch.fx machinery: load it on first use, not with hetero.
    if name in ("partition", "HeteroModule", "explain"):
        from hetero.placement import explainer, partitioner

        return {"partition": partitioner.partition, "HeteroModule": partitioner.HeteroModule,
                "explain": explainer.explain}[name]
    raise AttributeError(name)
