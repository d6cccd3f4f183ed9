"""What each unit of a model costs, read from one forward and backward pass on fake tensors.

The model runs once under ``FakeTensorMode`` (shapes and dtypes, no data, no compute) with
``torch.func.functional_call`` over fake copies of its parameters, so nothing of the model
changes and a model of any size captures in about a second. A dispatch mode records every aten
op of the forward and backward passes with its FLOPs (torch's ``flop_counter`` formulas) and the
bytes of its tensors, and ``torch.utils.module_tracker.ModuleTracker`` says which unit runs it
(in backward too). ``saved_tensors_hooks`` record the activations each unit keeps for backward
(each storage once, parameters left out).

**Units** are what the planner decides about: the model's children, a container child
(``nn.Sequential``, ``nn.ModuleDict``, ``nn.ModuleList``) opened one level - the layers of a
stack - in the order they first run. Ops outside every unit (the root's own: a residual add, the loss) form
the unit ``""``. A unit holding host tables (:class:`~hetero.embedding.HostEmbedding`) lists
them; its lookups run shape-only under fake tensors (no row is read) and their costs come from
the id statistics of real batches (:func:`table_traffic`).

Reference: torch's ``FlopCounterMode`` and ``torch.distributed._tools`` estimators (the same
fake-tensor capture); Paleo (Qi et al. 2017) for per-layer cost models.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from hetero.embedding import HostEmbedding, HostEmbeddingCollection
from hetero.placement.tagging import tag_between


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


def _replay(func: Any, args: tuple, kwargs: dict) -> tuple[str, Replay]:  # noqa: ANN401 - an OpOverload
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
    """

    name: str
    rows: int
    dim: int
    row_bytes: int
    pooled: bool


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


def plan_units(model: nn.Module) -> dict[str, nn.Module]:
    """``model``'s units by qualified name (see the module docstring), in registration order:
    its children, a container child (``nn.Sequential``, ``nn.ModuleDict``, ``nn.ModuleList``)
    replaced by its own children (one level: a block that is itself a container stays whole)."""
    out: dict[str, nn.Module] = {}
    for name, child in model.named_children():
        if isinstance(child, (nn.Sequential, nn.ModuleDict, nn.ModuleList)):
            out.update({f"{name}.{sub}": grandchild for sub, grandchild in child.named_children()})
        else:
            out[name] = child
    return out


_TAG = "hetero.planner.unit"  # autograd node metadata: the unit whose forward created the node


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records each op's family, FLOPs and bytes under the unit that runs it: in the forward pass
    the unit whose forward hooks bracket it, in backward the unit that tagged the running node."""

    def __init__(self, units: dict[str, Unit]) -> None:
        super().__init__()
        self.units = units
        self.forward_unit = ""
        self.order: list[str] = []
        self.replays: dict[str, Replay] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        flops = op_flops(func, args, kwargs, out)
        leaves = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in leaves)
        node = torch._C._current_autograd_node()
        if node is None:
            unit, ops = self.forward_unit, self.units[self.forward_unit].forward
            if unit not in self.order:
                self.order.append(unit)
        else:
            unit = node.metadata.get(_TAG, "")
            ops = self.units[unit].backward
            made = [t.untyped_storage().nbytes() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.units[unit].grad_bytes = max([self.units[unit].grad_bytes, *made])
        family, signature = op_family(str(packet)), ""
        if family is not OpFamily.VIEW:
            signature, replay = _replay(func, args, kwargs)
            self.replays.setdefault(signature, replay)
        ops.append(OpCost(family, int(flops), int(nbytes), signature))
        return out


def capture(model: nn.Module, example_inputs: tuple[Any, ...],
            loss_fn: Callable[[Any], torch.Tensor] | None = None,
            sample_batches: tuple[tuple[Any, ...], ...] = ()) -> ModelGraph:
    """Capture ``model``'s units and their costs on ``example_inputs`` (see the module docstring).

    Args:
        example_inputs: one training batch as the model's ``forward`` takes it (tensors anywhere
            in tuples, lists and dicts, e.g. W&D's ``(features, dense)``); copied to fake tensors.
        loss_fn: the training loss of the model's output (default: the sum of its floating
            outputs; its own cost is small beside a model's).
        sample_batches: more batches of the same size whose table ids join the statistics
            (:class:`TableTraffic`); their forward runs shape-only too.

    Raises:
        ValueError: the model has no parameters to train and no host tables, or the forward
            fails on fake tensors (the message says which op; e.g. data-dependent control flow).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef

    start = time.perf_counter()
    modules = plan_units(model)
    units = {name: _static(name, m) for name, m in modules.items()}
    units[""] = Unit("", linear=False)
    owned = {p for m in modules.values() for p in m.parameters()} | _table_weights(model)  # (tensors hash by identity)
    root = [p for p in model.parameters() if p not in owned]
    units[""].params = sum(p.numel() for p in root)
    units[""].param_bytes = sum(p.numel() * p.element_size() for p in root)
    units[""].param_tensors = len(root)
    tensors = [t for t in pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor)]
    batch = int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 1
    seen_ids: dict[str, list[torch.Tensor]] = {}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        state = {n: mode.from_tensor(p).requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
        state.update({n: mode.from_tensor(b) for n, b in model.named_buffers()})
        real: list[tuple[torch.Tensor, torch.Tensor]] = []  # (fake, real) input pairs: the tables' real ids

        def fake(x: Any) -> Any:  # noqa: ANN401
            if not isinstance(x, torch.Tensor):
                return x
            f = mode.from_tensor(x)
            real.append((f, x))
            return f

        id_hooks = _table_hooks(model, real, seen_ids)
        try:
            with torch.no_grad():
                for batch in sample_batches:  # forward only: their ids
                    more = pytree.tree_map(fake, batch)
                    torch.func.functional_call(model, state, more if isinstance(more, tuple) else (more,))
        except BaseException:
            for h in id_hooks:
                h.remove()
            raise
        inputs = pytree.tree_map(fake, example_inputs)
        param_storages = {StorageWeakRef(t.untyped_storage()) for t in state.values()}
        saved: dict[Any, tuple[set[str], int]] = {}  # storage -> (the units that saved it, bytes)
        inputs_of: dict[str, set[Any]] = {name: set() for name in units}
        sizes: dict[Any, int] = {}  # input storage -> bytes
        with _Recorder(units) as recorder:
            hooks = _unit_hooks(modules, units, inputs_of, sizes, recorder)

            def pack(t: torch.Tensor) -> torch.Tensor:
                ref = StorageWeakRef(t.untyped_storage())
                if ref not in param_storages:
                    saved.setdefault(ref, (set(), t.untyped_storage().nbytes()))[0].add(recorder.forward_unit)
                return t

            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = torch.func.functional_call(model, state, inputs if isinstance(inputs, tuple) else (inputs,))
                    loss = loss_fn(out) if loss_fn is not None else _default_loss(out)
                trainable = [t for t in state.values() if t.requires_grad]
                if not trainable and not any(u.tables for u in units.values()):
                    raise ValueError(f"{type(model).__name__} has no parameters to train: nothing to plan")
                if loss.requires_grad:
                    torch.autograd.grad(loss, trainable or [loss], allow_unused=True)
            finally:
                for h in hooks + id_hooks:
                    h.remove()
    order = [n for n in recorder.order if n] + [n for n in units if n and n not in recorder.order]
    _boundaries(units, order, saved, inputs_of, sizes)
    traffic = {}
    for name, batches in seen_ids.items():
        _, counts = torch.unique(torch.cat(batches), return_counts=True)
        traffic[name] = TableTraffic(sum(b.numel() for b in batches) / len(batches),
                                     sum(torch.unique(b).numel() for b in batches) / len(batches),
                                     tuple(sorted(counts.tolist(), reverse=True)))
    graph = [units[n] for n in order] + [units[""]]
    return ModelGraph(graph, batch, sum(t.numel() * t.element_size() for t in tensors), time.perf_counter() - start,
                      recorder.replays, traffic)


def _static(name: str, module: nn.Module) -> Unit:
    """A unit's parameters, tables and kind (nothing of its ops yet)."""
    tables = tuple(TableInfo(f"{name}.{q}" if q else name, t.config.num_embeddings, t.config.embedding_dim,
                             t.config.embedding_dim * t.weight.element_size(),
                             t.config.pooling.value != "none")
                   for q, t in module.named_modules() if isinstance(t, HostEmbedding))
    weights = _table_weights(module)
    params = [p for p in module.parameters() if p not in weights]
    return Unit(name, params=sum(p.numel() for p in params), param_bytes=sum(p.numel() * p.element_size() for p in params),
                param_tensors=len(params), largest_param_bytes=max((p.numel() * p.element_size() for p in params), default=0),
                linear=isinstance(module, nn.Linear), tables=tables)


def _table_weights(module: nn.Module) -> set[nn.Parameter]:
    """The host tables' weights in ``module`` (their rows and state are the host's, not a unit's)."""
    return {t.weight for t in module.modules() if isinstance(t, HostEmbedding)}


def _boundaries(units: dict[str, Unit], order: list[str], saved: dict[Any, tuple[set[str], int]],
                inputs_of: dict[str, set[Any]], sizes: dict[Any, int]) -> None:
    """Split the saved activations into each unit's own (``saved_bytes``) and the sets of its
    inputs that it, the unit before it, or the ops of no unit keep (see :class:`Unit`)."""
    boundary: set[Any] = set()
    for i, name in enumerate(order):
        prev = order[i - 1] if i else None
        free = {r for r in inputs_of[name] if "" not in saved.get(r, ((), 0))[0]}  # the root keeps the rest
        own = {r for r in free if name in saved.get(r, ((), 0))[0]}
        before = {r for r in free if prev is not None and prev in saved.get(r, ((), 0))[0]}
        u = units[name]
        u.input_free_bytes = sum(sizes[r] for r in free)
        u.input_own_bytes = sum(sizes[r] for r in own)
        u.input_prev_bytes = sum(sizes[r] for r in before)
        u.input_either_bytes = sum(sizes[r] for r in own | before)
        boundary |= own | before
    for ref, (savers, nbytes) in saved.items():
        if ref in boundary:
            continue
        # kept on the device when the ops of no unit keep it, else where it was first saved
        first = "" if "" in savers else next((n for n in order if n in savers), "")
        units[first].saved_bytes += nbytes


def _unit_hooks(modules: dict[str, nn.Module], units: dict[str, Unit], inputs_of: dict[str, set],
                sizes: dict[Any, int], recorder: _Recorder) -> list:
    """Forward hooks that bracket each unit's forward for ``recorder``, record its input and
    output bytes (and input storages), and tag the autograd nodes its forward created."""
    from torch.multiprocessing.reductions import StorageWeakRef

    hooks = []
    for name, module in modules.items():
        def before(m: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            recorder.forward_unit = name
            for t in _tensors((args, kwargs)):
                ref = StorageWeakRef(t.untyped_storage())
                if ref not in inputs_of[name]:
                    inputs_of[name].add(ref)
                    sizes[ref] = t.untyped_storage().nbytes()
                    units[name].input_bytes += sizes[ref]

        def after(m: nn.Module, args: tuple, kwargs: dict, out: Any, name: str = name) -> None:  # noqa: ANN401
            recorder.forward_unit = ""
            units[name].output_bytes += sum(t.numel() * t.element_size() for t in _tensors(out))
            tag_between(_tensors(out), _tensors((args, kwargs)), _TAG, name)  # its backward's nodes

        hooks.append(module.register_forward_pre_hook(before, with_kwargs=True))
        hooks.append(module.register_forward_hook(after, with_kwargs=True))
    return hooks


def _table_hooks(model: nn.Module, real: list[tuple[torch.Tensor, torch.Tensor]],
                 seen: dict[str, list[torch.Tensor]]) -> list:
    """Forward pre-hooks on host tables and table collections recording the real ids behind
    the fake ones they are called with, by table (qualified name)."""
    def real_of(t: torch.Tensor) -> torch.Tensor:
        return next(r for f, r in real if f is t)

    hooks = []
    for qualified, module in model.named_modules():
        if isinstance(module, HostEmbeddingCollection):
            def collection(m: HostEmbeddingCollection, args: tuple, prefix: str = qualified) -> None:
                for key, table in m.tables.items():
                    x = args[0][table.config.feature_name]
                    seen.setdefault(f"{prefix}.tables.{key}", []).append(real_of(x[0] if isinstance(x, tuple) else x))

            hooks.append(module.register_forward_pre_hook(collection))
        elif isinstance(module, HostEmbedding):
            def table(m: HostEmbedding, args: tuple, name: str = qualified) -> None:
                seen.setdefault(name, []).append(real_of(args[0]))

            hooks.append(module.register_forward_pre_hook(table))
    return hooks


def _tensors(tree: Any) -> Iterator[torch.Tensor]:  # noqa: ANN401 - any pytree
    return (t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point())


def _default_loss(out: Any) -> torch.Tensor:  # noqa: ANN401 - any pytree of outputs
    floats = [t.float().sum() for t in _tensors(out)]
    if not floats:
        raise ValueError("the model's output has no floating tensor to train on; give loss_fn")
    return torch.stack(floats).sum()
