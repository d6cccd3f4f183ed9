"""What the planner knows of a model: its units (:func:`plan_units`), each unit's ops with their
FLOPs and bytes (:class:`OpCost`, by :class:`OpFamily`), activations, parameters and host tables
(:class:`Unit`), the tables' id statistics (:class:`TableTraffic`), the ops' exact shapes for
timing (:class:`Replay`) - the :class:`ModelGraph` :func:`hetero.planner.capture.capture` makes.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from hetero.embedding import HostEmbedding


class OpFamily(enum.Enum):
    """How an op's time is predicted (:mod:`hetero.planner.calibration` measures each)."""

    MATMUL = "matmul"  # mm, addmm, bmm, baddbmm: FLOP-bound
    CONV = "conv"  # convolution forward
    CONV_BACKWARD = "conv_backward"
    ATTENTION = "attention"  # scaled dot-product attention, forward and backward
    MEMORY = "memory"  # elementwise ops, reductions, norms, copies: bandwidth-bound
    VIEW = "view"  # no data moved (views, metadata): dispatch only


_MATMUL = {"mm", "addmm", "bmm", "baddbmm"}
_VIEW = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "detach", "alias", "as_strided", "slice",
         "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "reshape", "_reshape_alias",
         "lift_fresh", "device", "numel", "sym_size", "sym_stride", "is_same_size", "view_as", "expand_as"}


def op_family(name: str) -> OpFamily:
    """The :class:`OpFamily` of an aten op by its overload packet's name (``"mm"``, ``"add_"``)."""
    base = name.split(".")[-1]
    if base in _MATMUL:
        return OpFamily.MATMUL
    if base == "convolution":
        return OpFamily.CONV
    if base == "convolution_backward":
        return OpFamily.CONV_BACKWARD
    if "scaled_dot_product" in base:
        return OpFamily.ATTENTION
    if base in _VIEW:
        return OpFamily.VIEW
    return OpFamily.MEMORY


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:  # noqa: ANN401 - an aten op and its values
    """FLOPs of one aten op: torch's ``flop_counter`` formulas; for attention kernels it has none
    for (the CPU's flash attention), ``4 B H T S D`` forward and 2.5 times that backward
    (FlashAttention's count: two matmuls forward, five backward)."""
    from torch.utils.flop_counter import flop_registry

    packet = func._overloadpacket
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    name = str(packet)
    if "scaled_dot_product" not in name:
        return 0
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    backward = name.endswith("_backward")
    q, k = (tensors[1], tensors[2]) if backward else (tensors[0], tensors[1])
    b, h, t, d = q.shape
    flops = 4 * b * h * t * k.shape[-2] * d
    return int(flops * 2.5) if backward else flops


@dataclasses.dataclass(frozen=True)
class OpCost:
    """One op: its family, FLOPs and bytes of its tensors (inputs and outputs), and (but for a
    view) the key of its exact shapes (:class:`Replay`)."""

    family: OpFamily
    flops: int
    nbytes: int
    signature: str = ""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor argument's metadata (what a replay builds a random tensor of)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class Replay:
    """An op with its exact argument shapes: :mod:`hetero.planner.calibration` times it once per
    machine (cached by :attr:`OpCost.signature`)."""

    op: Any  # a torch OpOverload
    args: tuple
    kwargs: dict


def replay(func: Any, args: tuple, kwargs: dict) -> tuple[str, Replay]:  # noqa: ANN401 - an OpOverload
    """An op call's signature (its key) and :class:`Replay` (tensors as their specs)."""
    def spec(x: Any) -> Any:  # noqa: ANN401
        return TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype) if isinstance(x, torch.Tensor) else x

    args, kwargs = pytree.tree_map(spec, args), pytree.tree_map(spec, kwargs)
    return f"{func}|{args}|{sorted(kwargs.items())}", Replay(func, args, kwargs)


@dataclasses.dataclass(frozen=True)
class TableInfo:
    """A host table as the planner sees it.

    Attributes:
        name: the table's qualified name in the model.
        rows, dim: its shape; ``row_bytes``: bytes of one row as stored.
        pooled: bags pooled into one output row each (else one output row per id).
        group: its table group (tables of one width and dtype in a collection share one storage
            and one kernel call per pass): the first table's name.
        map_bytes, sketch_bytes: a dynamic table's key map (:class:`hetero.dynamic.KeyMap`) in
            host memory wherever its rows are: for its rows (a row-sharded rank holds its span's),
            and its admission sketch (every rank one whole); 0 for a fixed table. A dynamic table
            stays on the host.
    """

    name: str
    rows: int
    dim: int
    row_bytes: int
    pooled: bool
    group: str = ""
    map_bytes: int = 0
    sketch_bytes: int = 0

    @property
    def dynamic(self) -> bool:
        return self.map_bytes > 0


@dataclasses.dataclass(frozen=True)
class TableTraffic:
    """A host table's ids in sample batches: how many per batch, and their frequencies.

    Attributes:
        ids_per_batch: ids looked up per batch of the captured size (mean over the samples).
        unique_per_batch: distinct ids per batch (mean): the rows a step's update touches.
        counts: how often each distinct id occurred, over all sample batches (descending).
    """

    ids_per_batch: float
    unique_per_batch: float
    counts: tuple[int, ...]

    def unique(self, ids: float) -> float:
        """Expected distinct ids among ``ids`` looked up (a micro-batch's, a rank's share): the
        observed distinct ids per batch, scaled by how the observed frequencies' expectation
        ``sum_i 1 - exp(-n p_i)`` changes from ``ids_per_batch`` to ``ids``."""
        if ids <= 0 or not self.counts:
            return 0.0
        p = np.asarray(self.counts, dtype=np.float64) / sum(self.counts)

        def expected(n: float) -> float:
            return float(np.sum(-np.expm1(-n * p)))

        return self.unique_per_batch * expected(ids) / expected(self.ids_per_batch)


@dataclasses.dataclass
class Unit:
    """What one unit of a model costs at the captured batch.

    Attributes:
        name: the module's qualified name (``""``: the ops of no unit).
        params: parameter elements; ``param_bytes``: their bytes as stored (host tables apart);
            ``param_tensors``: how many parameters.
        largest_param_bytes: the largest parameter's bytes (HostAdamW holds one gradient at a time).
        forward, backward: the ops of each pass, in order.
        saved_bytes: activations its forward keeps for backward that are no unit's input (dropped
            when it recomputes, rebuilt during its backward).
        input_bytes: its input activations (what a recompute keeps); the next four count its
            inputs that the ops of no unit (always on the device) do not keep:
        input_own_bytes: those it keeps itself (``A``); ``input_prev_bytes``: those the unit
            before it keeps (its outputs, ``B``); ``input_either_bytes``: ``|A u B|``;
            ``input_free_bytes``: all of them (``I``). Where the two units run decides where a
            boundary's tensors are kept (:mod:`hetero.planner.cost`).
        output_bytes: its output activations (what crosses a host/device boundary after it).
        grad_bytes: the largest tensor one of its backward ops makes (a gradient in flight).
        linear: an ``nn.Linear`` (operator parallel can cut it).
        tables: host tables it holds (their rows and state are on the host).
    """

    name: str
    params: int = 0
    param_bytes: int = 0
    param_tensors: int = 0
    largest_param_bytes: int = 0
    forward: list[OpCost] = dataclasses.field(default_factory=list)
    backward: list[OpCost] = dataclasses.field(default_factory=list)
    saved_bytes: int = 0
    input_bytes: int = 0
    input_own_bytes: int = 0
    input_prev_bytes: int = 0
    input_either_bytes: int = 0
    input_free_bytes: int = 0
    output_bytes: int = 0
    grad_bytes: int = 0
    linear: bool = False
    tables: tuple[TableInfo, ...] = ()

    @property
    def flops(self) -> int:
        """FLOPs of its forward and backward passes."""
        return sum(o.flops for o in self.forward) + sum(o.flops for o in self.backward)


@dataclasses.dataclass
class ModelGraph:
    """A captured model.

    Attributes:
        units: in the order they first run; the unit ``""`` (ops of no unit) last.
        batch: samples in the captured batch (the first dimension of the first tensor input).
        input_bytes: bytes of the batch's tensors.
        seconds: how long the capture took.
        replays: the ops' exact shapes by signature (views apart).
        traffic: each host table's id statistics, by its qualified name.
    """

    units: list[Unit]
    batch: int
    input_bytes: int
    seconds: float
    replays: dict[str, Replay] = dataclasses.field(default_factory=dict)
    traffic: dict[str, TableTraffic] = dataclasses.field(default_factory=dict)

    def unit(self, name: str) -> Unit:
        """The unit called ``name``.

        Raises:
            ValueError: no such unit (naming the units).
        """
        for u in self.units:
            if u.name == name:
                return u
        raise ValueError(f"the model has no unit {name!r}; its units are {[u.name for u in self.units if u.name]}")


class Granularity(enum.Enum):
    """What the planner places as one unit."""

    BLOCKS = "blocks"  # the model's children, a container's entries (a block stays whole)
    # every leaf module: an op as torch.fx sees a model built of modules (Linear, Conv2d, ReLU,
    # an embedding); the functional ops a forward calls itself stay with the ops of no unit
    LEAF_MODULES = "leaf_modules"


def plan_units(model: nn.Module, granularity: Granularity = Granularity.BLOCKS) -> dict[str, nn.Module]:
    """``model``'s units by qualified name (see the module docstring), in registration order:
    its children, a container child (``nn.Sequential``, ``nn.ModuleDict``, ``nn.ModuleList``)
    replaced by its own children (one level: a block that is itself a container stays whole);
    with :attr:`Granularity.LEAF_MODULES`, every module without children (a host table's
    module whole: its rows are one decision)."""
    if granularity is Granularity.LEAF_MODULES:
        leaves: dict[str, nn.Module] = {}

        def visit(module: nn.Module, prefix: str) -> None:
            for name, child in module.named_children():
                if isinstance(child, HostEmbedding) or not any(True for _ in child.children()):
                    leaves[prefix + name] = child
                else:
                    visit(child, f"{prefix}{name}.")
        visit(model, "")
        return leaves
    out: dict[str, nn.Module] = {}
    for name, child in model.named_children():
        if isinstance(child, (nn.Sequential, nn.ModuleDict, nn.ModuleList)):
            out.update({f"{name}.{sub}": grandchild for sub, grandchild in child.named_children()})
        else:
            out[name] = child
    return out
