"""Automatic host/device partitioning of a model's forward graph, and its concurrent execution.

Capture: ``torch.fx`` symbolic tracing. It needs no example inputs, keeps ``nn.Module`` calls,
parameters and the module path of every op (``nn_module_stack``), and its graphs are plain
Python that ``split_module`` cuts into subgraphs; torch.export would demand static shapes and
functionalised ops, and a Dynamo backend sees graphs only at the first call and splits them at
graph breaks. Where symbolic tracing fails (data-dependent control flow), hetero falls back to
module-level placement with hooks and warns, naming the reason.

Steps: (1) assign a :class:`Target` to every op (see :mod:`hetero.placement.annotate` for the
precedence); (2) insert a transfer op on every edge whose ends have different targets - the copy
is differentiable, so gradients flow back across it and land where their parameters live;
(3) group ops into subgraphs: ``stage(op) = max over inputs of stage(input) + (1 if the input's
target differs)``, and ops of equal (target, stage) form one subgraph - maximal same-target
groups whose dependency graph is acyclic by construction; (4) run the subgraphs in order, host
subgraphs on a worker thread and device subgraphs on the caller's thread, each starting as soon
as its inputs are ready, so independent host and device subgraphs run concurrently.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import operator
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module
from torch.utils import _pytree as pytree

from hetero.placement.annotate import PlacementSpec, module_target
from hetero.placement.assign import assign_targets, check_names, check_pins_honoured, host_resident
from hetero.placement.capture import PlacementTracer, module_path, modules_on_path, op_type
from hetero.placement.tagging import TARGET, tag_between
from hetero.placement.target import Target, copy_to, resolve_device
from hetero.placement.threads import ThreadContext, host_worker


@torch.fx.wrap
def transfer(x: torch.Tensor, target: str) -> torch.Tensor:
    """Copy ``x`` to the device of ``target`` (differentiable). Host->device is pinned and async.

    On a host-only machine (the device is the CPU too) the copy is made all the same, memory to
    memory: each side then owns its tensors as it would beside an accelerator (the device's copy
    is freed when the device is done with it, whatever the host keeps), so the device part's
    memory - as :mod:`hetero.planner.meter` counts it - and the planner's model of it agree with
    an accelerator's. It costs one memcpy of the boundary's bytes per crossing."""
    device = resolve_device(Target(target))
    if _recorder.active is not None:  # logical bytes across the boundary, also where both are the CPU
        _recorder.add(target, x.numel() * x.element_size())
    if x.device == device:
        if x.is_leaf and x.requires_grad and target == Target.DEVICE.value:
            return _stream_parameter(x)  # a host parameter streamed in: its gradient streams back
        return x.clone()  # copy: a host-only machine's stand-in for the host<->device copy
    if device.type == "cpu":
        return x.to(device)  # device -> host; on CUDA a sync point: the host subgraph needs the values
    return copy_to(x, device)


class _StreamedParameter(torch.autograd.Function):
    """A host parameter's copy on a host-only machine's device, its gradient copied back to the
    host in backward - as ``to(device)``'s backward does beside an accelerator - so the device's
    gradient is freed and the host owns what accumulates into ``.grad`` (the backward is tagged
    host work: :mod:`hetero.planner.meter` counts it as the host's)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN401
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN401
        return grad.clone()


def _stream_parameter(x: torch.Tensor) -> torch.Tensor:
    y = _StreamedParameter.apply(x)
    if y.grad_fn is not None:  # (none under no_grad)
        y.grad_fn.metadata[TARGET] = Target.HOST.value
    return y


class _Recorder:
    """Bytes crossing the boundary while ``explain`` runs; shared by the caller and the host worker."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: dict[str, int] | None = None

    def add(self, target: str, nbytes: int) -> None:
        with self.lock:
            if self.active is not None:
                self.active[target] += nbytes


_recorder = _Recorder()


@dataclasses.dataclass
class Subgraph:
    name: str
    target: Target
    ops: list[tuple[str, str]]  # (op type, module path)
    inputs: list[str]  # names of the subgraphs it consumes


class HeteroModule(nn.Module):
    """A model whose forward runs as host and device subgraphs (see the module docstring).

    Build with :func:`partition`. Parameters live on their target (host: CPU memory; device: the
    resolved accelerator, or the CPU on a host-only machine). ``subgraphs`` describes the split.
    """

    def __init__(self, model: nn.Module, split: fx.GraphModule | None, subgraphs: list[Subgraph], concurrent: bool) -> None:
        super().__init__()
        self.model = model  # the original module: owns the parameters (state_dict keys unchanged)
        self.split = split
        self.subgraphs = subgraphs
        self._targets = {s.name: s.target for s in subgraphs}
        self.concurrent = concurrent
        self._order = _schedule(split.graph, self._targets) if split is not None else []
        self._pool: ThreadPoolExecutor | None = None
        self.fallback_reason: str | None = None
        self.param_targets: dict[str, Target] = {}  # qualified parameter name -> where it lives

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - placement decides where parameters live
        raise RuntimeError("a HeteroModule's parameters live where their placement puts them; "
                           "call .to()/.cuda() on the model before hetero.placement.partition()")

    # The original model owns the parameters: names and state_dict keys stay the user's.
    def named_parameters(self, *args, **kwargs):
        return self.model.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self.model.named_buffers(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            # One thread: host subgraphs run in submission (topological) order, so a task only ever
            # waits on tasks submitted before it and the pool cannot deadlock.
            self._pool = host_worker("hetero-host")  # (its OpenMP team: what the device's leaves)
        return self._pool

    def forward(self, *args: Any) -> Any:
        if self.split is None:  # fallback: the model's own forward, with placement hooks
            return self.model(*args)
        env: dict[fx.Node, Any] = {}
        inputs = iter(args)
        context = ThreadContext.capture()  # grad mode, CUDA device and stream, autocast: per thread

        def resolve(a):
            return fx.node.map_aggregate(fx.node.map_arg(a, lambda n: env[n]), _value)

        for node in self._order:
            if node.op == "placeholder":
                env[node] = next(inputs)
            elif node.op == "call_module":
                sub = self.split.get_submodule(str(node.target))
                if self.concurrent and self._targets.get(str(node.target)) is Target.HOST:
                    env[node] = self._worker().submit(_run, sub, node.args, node.kwargs, env.copy(), context)
                else:
                    env[node] = sub(*resolve(node.args), **resolve(node.kwargs))
            elif node.op == "get_attr":  # a parameter handed to a subgraph as an input
                env[node] = functools.reduce(getattr, str(node.target).split("."), self.split)
            elif node.op == "call_function" and node.target is operator.getitem:
                src, idx = node.args
                env[node] = _Item(env[src], idx)  # stays lazy: no wait for a host subgraph here
            elif node.op == "output":
                return resolve(node.args[0])  # sync point: wait for the last host subgraphs
            else:
                assert node.op == "call_function", f"unexpected top-level node {node.op} {node.target}"
                env[node] = node.target(*resolve(node.args), **resolve(node.kwargs))
        raise AssertionError("graph without output")


@dataclasses.dataclass
class _Item:
    source: Any
    index: Any


def _value(x: Any) -> Any:
    if isinstance(x, _Item):
        return _value(x.source)[x.index]
    if isinstance(x, Future):
        return x.result()  # sync point: the consumer needs this host subgraph's output
    return x


def _schedule(graph: fx.Graph, targets: dict[str, Target]) -> list[fx.Node]:
    """A topological order of the top-level graph that enqueues host subgraphs as early as their
    inputs allow, so the worker starts them before device work that does not depend on them."""
    position = {n: i for i, n in enumerate(graph.nodes)}

    def priority(n: fx.Node) -> tuple[int, int]:
        host = n.op == "call_module" and targets.get(str(n.target)) is Target.HOST
        rank = {"placeholder": 0, "get_attr": 1, "output": 4}.get(n.op, 1 if host else 3)
        return rank, position[n]

    waiting = {n: len(n.all_input_nodes) for n in graph.nodes}
    ready = [(priority(n), n.name, n) for n in graph.nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        *_, n = heapq.heappop(ready)
        order.append(n)
        for user in n.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (priority(user), user.name, user))
    assert len(order) == len(graph.nodes), "the subgraph graph has a cycle"
    return order


def _run(sub: nn.Module, args, kwargs, env, context: ThreadContext):
    with context.applied():  # the caller's grad mode, device, stream and autocast, on this worker
        res = lambda a: fx.node.map_aggregate(fx.node.map_arg(a, lambda n: env[n]), _value)  # noqa: E731
        inputs, named = res(args), res(kwargs)
        out = sub(*inputs, **named)
        if torch.is_grad_enabled():  # its backward is host work too (hetero.placement.tagging)
            leaves = lambda x: [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]  # noqa: E731
            tag_between(leaves(out), leaves((inputs, named)), TARGET, Target.HOST.value)
        return out


def partition(model: nn.Module, spec: PlacementSpec | None = None, concurrent: bool = True) -> HeteroModule:
    """Split ``model`` into host and device subgraphs per ``spec`` and the marks in the model.

    Moves each parameter to its target (host: CPU; device: :func:`resolve_device`). The returned
    :class:`HeteroModule` shares the parameters with ``model`` (optimizers may be built on either).

    Raises:
        ValueError: an unknown module, parameter or op type in ``spec`` (the message lists the
            valid ones), or a conflicting pin.
    """
    spec = spec or PlacementSpec()
    try:
        tracer = PlacementTracer(frozenset(name.rpartition(".")[0] for name in spec.params))
        graph = tracer.trace(model)
    except Exception as e:  # noqa: BLE001 - any failure of symbolic tracing means: no graph
        return _fallback(model, spec, f"{type(e).__name__}: {e}")
    check_names(model, spec, graph)
    gm = fx.GraphModule(model, graph)
    targets = assign_targets(model, spec, gm.graph)
    check_pins_honoured(model, spec, gm.graph, targets)

    # (2) transfers on every edge whose ends differ in target
    for node in list(gm.graph.nodes):
        if node not in targets or node.op == "get_attr":
            continue
        for arg in list(node.all_input_nodes):
            src_target = targets.get(arg)  # placeholders have none: inputs are moved where used
            if src_target is targets[node] and arg.op != "placeholder":
                continue
            with gm.graph.inserting_before(node):
                copy = gm.graph.call_function(transfer, (arg, targets[node].value))
            targets[copy] = targets[node]
            node.replace_input_with(arg, copy)

    # (3) stages and subgraphs
    stage: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node in targets and node.op != "get_attr":
            stage[node] = max([stage[a] + (targets[a] is not targets[node]) for a in node.all_input_nodes if a in stage],
                              default=0)
    keys = sorted({(stage[n], targets[n].value) for n in stage})
    index = {k: i for i, k in enumerate(keys)}
    gm.recompile()
    split = split_module(gm, model, lambda n: index[(stage[n], targets[n].value)])  # topologically sorted

    # parameters and buffers to their targets
    param_names = {p: n for n, p in model.named_parameters()}  # tensors hash by identity
    param_targets: dict[str, Target] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            owner_name, _, attr = str(node.target).rpartition(".")
            tensor = getattr(model.get_submodule(owner_name), attr)
            tensor.data = tensor.data.to(resolve_device(targets[node]))
            streamed = targets[node] is Target.HOST and any(targets.get(u) is Target.DEVICE for u in node.users)
            if streamed and resolve_device(Target.DEVICE).type == "cuda" and not tensor.is_pinned():
                # a host tensor copied to the device every pass: pinned once here (one copy), so each
                # pass's copy is one async DMA, not a pinning copy and then the DMA
                tensor.data = tensor.data.pin_memory()
            if tensor in param_names:
                param_targets[param_names[tensor]] = targets[node]
        elif node.op == "call_module":  # a leaf module runs on its node's target, its tensors with it
            prefix = str(node.target)
            for name, m in model.get_submodule(prefix).named_modules(prefix=prefix):
                _move_own(m, resolve_device(targets[node]))
                for n, _ in m.named_parameters(recurse=False):
                    param_targets[f"{name}.{n}"] = Target.HOST if host_resident(m) else targets[node]

    subgraphs = []
    for name, _ in split.named_children():
        if not name.startswith("submod_"):
            continue
        i = int(name[len("submod_"):])
        tv = keys[i][1]
        ops = [(op_type(n, model), module_path(n)) for n in gm.graph.nodes
               if n in stage and n.target is not transfer and index[(stage[n], targets[n].value)] == i]
        call = next(n for n in split.graph.nodes if n.op == "call_module" and n.target == name)
        deps = sorted({str(a.target) for a in _producers(call)})
        subgraphs.append(Subgraph(name, Target(tv), ops, deps))
    hm = HeteroModule(model, split, subgraphs, concurrent)
    hm.param_targets = param_targets
    return hm


def _move_own(m: nn.Module, device: torch.device, parameters: bool = True) -> None:
    """Move ``m``'s own parameters and buffers to ``device`` (one copy each, once, at partition
    time). A host-resident module keeps its parameters on the host; its buffers move, so a
    ``HostEmbedding`` placed on the device delivers its lookups there (its anchor buffer)."""
    if parameters and not host_resident(m):
        for p in m.parameters(recurse=False):
            p.data = p.data.to(device)
    for name, b in m.named_buffers(recurse=False):
        m._buffers[name] = b.to(device)


def _producers(node: fx.Node) -> list[fx.Node]:
    out = []
    for a in node.all_input_nodes:
        if a.op == "call_module":
            out.append(a)
        elif a.op == "call_function":  # getitem of a subgraph's outputs
            out.extend(_producers(a))
    return out


def _fallback(model: nn.Module, spec: PlacementSpec, reason: str) -> HeteroModule:
    warnings.warn(
        f"hetero: cannot capture the forward graph of {type(model).__name__} ({reason}); falling back to "
        f"module-level placement with hooks (op rules and on() regions are ignored)",
        stacklevel=3,
    )
    placed = {name: t for name, m in model.named_modules() if (t := module_target(m)) is not None}
    placed.update(spec.modules)
    for name, m in model.named_modules():
        owners = [p for p in modules_on_path(name) if p in placed]
        t = placed[owners[-1]] if owners else spec.default
        for p_name, p in m.named_parameters(recurse=False):
            full = f"{name}.{p_name}" if name else p_name
            if not host_resident(m):
                p.data = p.data.to(resolve_device(spec.params.get(full, t)))
        _move_own(m, resolve_device(t), parameters=False)
        if (name in placed or not name) and not _on_the_worker(spec, name, m):
            m.register_forward_pre_hook(lambda mod, args, t=t: tuple(
                transfer(a, t.value) if isinstance(a, torch.Tensor) else a for a in args))
    hm = HeteroModule(model, None, [], concurrent=False)
    hm.fallback_reason = reason
    for name, m in model.named_modules():  # host modules run as host subgraphs do: on the worker
        if _on_the_worker(spec, name, m):
            m.forward = _on_worker(hm, m.forward)  # (its name and state unchanged)
    return hm


def _on_the_worker(spec: PlacementSpec, name: str, module: nn.Module) -> bool:
    """A module the spec places on the host, which does not manage its own residency (a table)."""
    return spec.modules.get(name) is Target.HOST and not host_resident(module)


def _on_worker(hm: HeteroModule, forward: Any) -> Any:  # noqa: ANN401 - a module's bound forward
    """``forward`` run on ``hm``'s host worker thread (the caller waits), as a host subgraph runs:
    its inputs copied to the host there, its autograd nodes marked as host work, its outputs
    copied back to the device."""
    def moved(tree: Any, target: Target) -> Any:  # noqa: ANN401
        return pytree.tree_map(lambda t: transfer(t, target.value) if isinstance(t, torch.Tensor) else t, tree)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        context = ThreadContext.capture()

        def work() -> Any:  # noqa: ANN401
            with context.applied():
                inputs, named = moved((args, kwargs), Target.HOST)
                out = forward(*inputs, **named)
                if torch.is_grad_enabled():
                    leaves = lambda x: [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]  # noqa: E731
                    tag_between(leaves(out), leaves((inputs, named)), TARGET, Target.HOST.value)
                return out

        return moved(hm._worker().submit(work).result(), Target.DEVICE)  # sync point: the caller needs it

    return run
