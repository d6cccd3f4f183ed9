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

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from torch._subclasses.fake_tensor import unset_fake_temporarily

from hetero.embedding import HostEmbedding, HostEmbeddingCollection
from hetero.placement.tagging import tag_between
from hetero.planner.graph import Granularity, ModelGraph, OpCost, OpFamily, TableInfo, TableTraffic, Unit, op_family, \
    op_flops, plan_units, replay
from hetero.placement.capture import capture_failure


_TAG = "hetero.planner.unit"  # autograd node metadata: the unit whose forward created the node


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records each op's family, FLOPs and bytes under the unit that runs it: in the forward pass
    the unit whose forward hooks bracket it, in backward the unit that tagged the running node."""

    def __init__(self, units: dict[str, Unit]) -> None:
        super().__init__()
        self.units = units
        self.forward_unit = ""
        self.order: list[str] = []
        self.replays: dict[str, Any] = {}  # signature -> graph.Replay

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
            signature, spec = replay(func, args, kwargs)
            self.replays.setdefault(signature, spec)
        ops.append(OpCost(family, int(flops), int(nbytes), signature))
        return out


def capture(model: nn.Module, example_inputs: tuple[Any, ...],
            loss_fn: Callable[[Any], torch.Tensor] | None = None,
            sample_batches: tuple[tuple[Any, ...], ...] = (),
            granularity: Granularity = Granularity.BLOCKS) -> ModelGraph:
    """Capture ``model``'s units and their costs on ``example_inputs`` (see the module docstring).

    Args:
        example_inputs: one training batch as the model's ``forward`` takes it (tensors anywhere
            in tuples, lists and dicts, e.g. W&D's ``(features, dense)``); copied to fake tensors.
        loss_fn: the training loss of the model's output (default: the sum of its floating
            outputs; its own cost is small beside a model's).
        sample_batches: more batches of the same size whose table ids join the statistics
            (:class:`TableTraffic`); their forward runs shape-only too.
        granularity: what one unit is (:func:`~hetero.planner.graph.plan_units`).

    Raises:
        ValueError: the model has no parameters to train and no host tables, or the forward
            fails on fake tensors (the message says which op; e.g. data-dependent control flow).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef

    start = time.perf_counter()
    modules = plan_units(model, granularity)
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

        id_hooks = _table_hooks(model, real, seen_ids, mode)
        try:
            with torch.no_grad():
                for sample in sample_batches:  # forward only: their ids
                    more = pytree.tree_map(fake, sample)
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


def streamable_units(model: nn.Module, names: list[str]) -> frozenset[str]:
    """The units of ``names`` whose weights the partitioner can keep on the host and stream in:
    it traces through every module owning one of their parameters (its ops then take them from
    ``get_attr`` nodes), which a forward branching on its input (``BatchNorm``'s input check)
    does not allow - such a unit would run through the hook fallback, whose copies no plan prices.
    Each module type is traced once, alone."""

    traces: dict[type, bool] = {}
    out = set()
    for name in names:
        owners = [m for m in model.get_submodule(name).modules() if next(m.parameters(recurse=False), None) is not None]
        for m in owners:
            if type(m) not in traces:
                traces[type(m)] = capture_failure(m) is None
        if owners and all(traces[type(m)] for m in owners):
            out.add(name)
    return frozenset(out)


def _static(name: str, module: nn.Module) -> Unit:
    """A unit's parameters, tables and kind (nothing of its ops yet)."""
    found = [(f"{name}.{q}" if q else name, t) for q, t in module.named_modules() if isinstance(t, HostEmbedding)]
    first = {}  # a group's first table's name, by group (groups hash by identity)
    for qualified, t in found:
        first.setdefault(t.group, qualified)
    tables = tuple(TableInfo(qualified, t.config.num_rows, t.config.embedding_dim,
                             t.config.embedding_dim * t.weight.element_size(), t.config.pooling.value != "none",
                             first[t.group], *((t.keymap.nbytes, t.keymap.sketch.nbytes) if t.keymap is not None else (0, 0)))
                   for qualified, t in found)
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
                 seen: dict[str, list[torch.Tensor]], mode: Any) -> list:  # noqa: ANN401 - a FakeTensorMode
    """Forward pre-hooks on host tables and table collections recording the real ids behind
    the fake ones they are called with, by table (qualified name). A collection's input is read
    as it reads it (:meth:`~hetero.embedding.HostEmbeddingCollection.feature_inputs`) from the real
    input behind the fake one - a TorchRec ``KeyedJaggedTensor``'s features need its lengths'
    values - and the collection then takes those features, fake."""
    def real_of(t: torch.Tensor) -> torch.Tensor:
        return next((r for f, r in real if f is t), t)

    hooks = []
    for qualified, module in model.named_modules():
        if isinstance(module, HostEmbeddingCollection):
            def collection(m: HostEmbeddingCollection, args: tuple, prefix: str = qualified) -> tuple:
                given = pytree.tree_map(lambda t: real_of(t) if isinstance(t, torch.Tensor) else t, args[0])
                with unset_fake_temporarily():  # (the real input read as real: its lengths' values)
                    features = dict(m.feature_inputs(given))
                for feature, key in m.lookups:
                    x = features[feature]
                    seen.setdefault(f"{prefix}.{m.tables_attribute}.{key}", []).append(x[0] if isinstance(x, tuple) else x)
                fake_features = pytree.tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t,
                                                features)
                return (fake_features, *args[1:])

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
