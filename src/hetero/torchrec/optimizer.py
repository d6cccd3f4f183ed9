"""TorchRec's sparse optimizers as hetero's, and the container that runs them as TorchRec runs its
fused ones: inside ``loss.backward()``.

TorchRec configures a table's optimizer three ways, and :func:`rule_of` reads each:
``FusedEmbeddingBagCollection(optimizer_type=, optimizer_kwargs=)``,
``apply_optimizer_in_backward(cls, params, kwargs)`` (attributes on the weights) and a sharder's
``fused_params`` (``{"optimizer": EmbOptimType, "learning_rate": ...}``). The rules and their
hetero kernels (:mod:`hetero.optim.sparse`): ``torch.optim.SGD`` / ``EXACT_SGD`` -> SGD,
``torch.optim.Adagrad`` / ``EXACT_ADAGRAD`` -> Adagrad, ``torchrec.optim.RowWiseAdagrad`` /
``EXACT_ROWWISE_ADAGRAD`` -> exact row-wise Adagrad, ``torch.optim.Adam`` / ``ADAM`` -> LazyAdam
(FBGEMM's Adam updates only the looked-up rows too). Settings hetero's kernels do not have
(weight decay, momentum, lr decay, AMSGrad) are refused, naming them. Defaults are the source's:
FBGEMM's (``eps`` 1e-8) for fused modules and ``fused_params``, the torch class's for
``apply_optimizer_in_backward``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad as TorchRecRowWiseAdagrad

from hetero.embedding import HostEmbedding
from hetero.optim import SparseOptimizer, SparseOptimizerKind
from hetero.optim.container import OptimizersContainer
from hetero.planner.table_plan import SparseRule

# FBGEMM's table-batched embedding defaults (split_table_batched_embeddings_ops_training.py)
FBGEMM_DEFAULTS = {"lr": 0.01, "eps": 1.0e-8, "betas": (0.9, 0.999)}
_KIND_OF_CLASS = {torch.optim.SGD: SparseOptimizerKind.SGD, torch.optim.Adagrad: SparseOptimizerKind.ADAGRAD,
                  TorchRecRowWiseAdagrad: SparseOptimizerKind.ROWWISE_ADAGRAD, torch.optim.Adam: SparseOptimizerKind.LAZY_ADAM}
_KIND_OF_FUSED = {"exact_sgd": SparseOptimizerKind.SGD, "sgd": SparseOptimizerKind.SGD,
                  "exact_adagrad": SparseOptimizerKind.ADAGRAD,
                  "exact_row_wise_adagrad": SparseOptimizerKind.ROWWISE_ADAGRAD, "adam": SparseOptimizerKind.LAZY_ADAM}
# settings without a hetero counterpart, with the value that means "off"
_OFF = {"weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "lr_decay": 0.0, "amsgrad": False,
        "maximize": False}
_IGNORED = {"foreach", "differentiable", "fused", "capturable"}  # torch's implementation switches


def _rule(kind: SparseOptimizerKind, settings: Mapping[str, Any], source: str) -> SparseRule:
    settings = dict(settings)
    for key, off in _OFF.items():
        if key in settings and (value := settings.pop(key)) != off:
            raise ValueError(f"{source}: {key}={value!r} has no hetero counterpart yet; drop it (or train the table "
                             f"with one of hetero's own rules in the plan)")
    for key in _IGNORED:
        settings.pop(key, None)
    if "initial_accumulator_value" in settings:
        settings["initial_accumulator"] = settings.pop("initial_accumulator_value")
    if "betas" in settings:
        settings["beta1"], settings["beta2"] = settings.pop("betas")
    fields = {f.name for f in dataclasses.fields(kind.optimizer.Config)}
    if unknown := sorted(set(settings) - fields):
        raise ValueError(f"{source}: settings {unknown} are not {kind.value}'s (it takes {sorted(fields)})")
    return SparseRule(kind, kind.optimizer.Config(**settings))


def rule_of_class(cls: type, kwargs: Mapping[str, Any], fbgemm: bool, source: str) -> SparseRule:
    """The rule of a torch optimizer class and its kwargs, defaults FBGEMM's (``fbgemm``: a fused
    module's) or the class's own (``apply_optimizer_in_backward`` on an unsharded collection).

    Raises:
        ValueError: a class or setting hetero has no kernel for, named.
    """
    if cls not in _KIND_OF_CLASS:
        raise ValueError(f"{source}: the sparse optimizer {cls.__module__}.{cls.__qualname__} has no hetero kernel; use "
                         f"SGD, Adagrad, torchrec.optim.RowWiseAdagrad or Adam, or a hetero rule in the plan")
    kind = _KIND_OF_CLASS[cls]
    if fbgemm:
        defaults = dict(FBGEMM_DEFAULTS)
    else:
        defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                    if k in ("lr", "eps", "betas", "initial_accumulator_value") and p.default is not inspect.Parameter.empty}
    fields = {f.name for f in dataclasses.fields(kind.optimizer.Config)}
    fields |= {"betas"} if "beta1" in fields else set()
    fields |= {"initial_accumulator_value"} if "initial_accumulator" in fields else set()
    return _rule(kind, {**{k: v for k, v in defaults.items() if k in fields}, **kwargs}, source)


def rule_of_fused_params(params: Mapping[str, Any], source: str) -> SparseRule:
    """The rule of a TorchRec sharder's ``fused_params`` (``optimizer``: an ``EmbOptimType``)."""
    params = dict(params)
    optimizer = params.pop("optimizer", None)
    name = getattr(optimizer, "value", optimizer)
    if name not in _KIND_OF_FUSED:
        raise ValueError(f"{source}: fused optimizer {name!r} has no hetero kernel; use one of {sorted(_KIND_OF_FUSED)}")
    kind = _KIND_OF_FUSED[name]
    settings = {"lr": params.pop("learning_rate", FBGEMM_DEFAULTS["lr"])}
    if kind is not SparseOptimizerKind.SGD:
        settings["eps"] = params.pop("eps", FBGEMM_DEFAULTS["eps"])
    if kind is SparseOptimizerKind.LAZY_ADAM:
        settings["beta1"], settings["beta2"] = params.pop("beta1", 0.9), params.pop("beta2", 0.999)
    return _rule(kind, {**settings, **params}, source)


class FusedTables(KeyedOptimizer):
    """The sparse optimizers of a converted model's tables, as TorchRec's ``fused_optimizer``: a
    ``KeyedOptimizer`` (it goes into ``CombinedOptimizer`` and LR schedulers beside the dense one).

    With ``in_backward`` (the default, TorchRec's semantics) the update runs at the end of each
    ``loss.backward()`` that reached the collection's output, once for all its tables (autograd's
    end-of-backward callback, queued by the output's gradient hook: :meth:`queue`; it runs on
    autograd's thread after every table's gradient was captured, whatever the rows' placement),
    and :meth:`step` does nothing; without it, :meth:`step` updates.

    Args:
        tables: the tables by qualified name (``ebc.embedding_bags.t1``).
        optimizers: their sparse optimizers by stable name (``<collection>.<rule>.<i>``, the keys of
            :func:`hetero.parallel.save_distributed_checkpoint`'s and a parameter server's) and what
            steps each over the ranks or servers (:class:`~hetero.optim.container.OptimizersContainer`).
    """

    def __init__(self, tables: Mapping[str, HostEmbedding], optimizers: OptimizersContainer,
                 in_backward: bool = True) -> None:
        params = {f"{name}.weight": t.weight for name, t in tables.items()}
        sparse = list(optimizers.sparse.values())
        state = {p: st for o in sparse for p, st in o.state.items()}
        super().__init__(params, state, [g for o in sparse for g in o.param_groups])
        self.optimizers, self.in_backward = optimizers, in_backward
        self._queued = -1  # the graph task (backward) whose update is queued

    def queue(self, grad: Tensor | None = None) -> None:
        """Queue the update for the end of the running backward (a gradient hook of the
        collection's output; ``grad`` is passed through). Once per backward, however many outputs:
        the backward is told by its graph task id, so one that failed before its end (its queued
        update dropped with it) leaves the next one to queue its own."""
        task = torch._C._current_graph_task_id()
        if self.in_backward and task != self._queued:
            self._queued = task
            torch.autograd.Variable._execution_engine.queue_callback(self._update)

    def _update(self) -> None:
        self.optimizers.step()

    def step(self, closure: Any = None) -> None:  # noqa: ANN401 - torch.optim's signature
        if closure is not None:
            raise ValueError("FusedTables.step() takes no closure")
        if not self.in_backward:
            self._update()

    def zero_grad(self, set_to_none: bool = False) -> None:  # noqa: ARG002 - torch.optim's signature
        if not self.in_backward:  # (in backward: each update consumed its gradients)
            self.optimizers.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """hetero's sparse optimizers' state by name (type, settings, steps and per-row state)."""
        return {"sparse": self.optimizers.sparse_state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Restore a :meth:`state_dict`.

        Raises:
            ValueError: a sparse optimizer it lacks, or one whose type, tables or shapes differ.
        """
        self.optimizers.check_sparse_state(state_dict["sparse"])
        self.optimizers.load_sparse_state_dict(state_dict["sparse"])

    def named_optimizers(self) -> dict[str, SparseOptimizer]:
        """hetero's sparse optimizers by their stable names."""
        return dict(self.optimizers.sparse)

    def table_state(self) -> dict[str, dict[str, Tensor]]:
        """Each table's per-row state by table name (views of host memory)."""
        return {k: v for o in self.optimizers.sparse.values() for k, v in o.table_state.items()}
