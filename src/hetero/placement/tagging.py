"""Autograd nodes marked with the work they belong to, so their backward can be attributed.

:func:`tag_between` walks back from a region's outputs to its inputs and sets a key of every
autograd node the region created (``Node.metadata``); during backward,
``torch._C._current_autograd_node()`` names the node that runs, and its metadata says whose
work it is. The partitioner marks its host subgraphs' nodes (:data:`TARGET`: the target's value)
- which the planner's meter reads on a host-only machine, where host and device backward share
one thread - and the planner's capture marks each unit's nodes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

TARGET = "hetero.target"  # metadata key: the Target value of the work that created a node


def tag_between(outputs: Iterable[torch.Tensor], inputs: Iterable[torch.Tensor], key: str, value: object) -> None:
    """Set ``metadata[key] = value`` on the autograd nodes between ``inputs`` and ``outputs``
    (the nodes reachable from the outputs' ``grad_fn`` without passing an input's, and not
    already tagged with ``key``), gradient accumulators of the region's parameters included."""
    stop = {t.grad_fn for t in inputs if t.grad_fn is not None}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in stop or key in node.metadata:
            continue
        node.metadata[key] = value
        stack.extend(n for n, _ in node.next_functions)
