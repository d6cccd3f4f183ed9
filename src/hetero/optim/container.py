"""A model's optimizers as one (:class:`OptimizersContainer`): its dense optimizer, its host tables'
sparse ones (and what steps them across ranks or servers), its device tables' and host units' own,
and their learning-rate schedules. The models are torchtitan's ``OptimizersContainer``
(torchtitan/components/optimizer.py) and TorchRec's ``CombinedOptimizer``: one ``zero_grad``, one
``step`` in one documented order, one place for the checks and state a checkpoint needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hetero.optim.sparse import SparseOptimizer


class OptimizersContainer:
    """A model's optimizers, stepped in one order.

    Args:
        dense: the dense optimizer of the device parameters (torch's, ``HostAdamW``,
            ``PartialOffloadAdamW``; ``None``: there are none).
        sparse: hetero's sparse optimizers by name (their state, checks and hyper-parameters).
        steppers: what steps each of ``sparse``, by the same name: a wrapper that exchanges the
            sparse gradients over the ranks (``DistributedSparse``) or pushes them to parameter
            servers (``PSSparse``); default: the optimizer itself.
        device_tables: torch's sparse optimizers of tables moved to the device.
        host_dense: the host units' dense optimizers (a partitioned model's).
        schedulers: ``torch.optim.lr_scheduler`` schedules over any of the above, stepped after
            every :meth:`step`.
        remote: the sparse optimizers push to parameter servers: :meth:`step` pushes first (the
            servers work while the dense optimizer steps), then calls ``between`` (the next
            batch's pulls), then steps the rest.

    Order of :meth:`step`: dense, device tables, host units (inside ``host_work``), sparse; with
    ``remote``: sparse, ``between``, dense, device tables, host units. Then the schedules.
    """

    def __init__(self, dense: torch.optim.Optimizer | None = None, sparse: Mapping[str, SparseOptimizer] | None = None,
                 steppers: Mapping[str, Any] | None = None, device_tables: Sequence[torch.optim.Optimizer] = (),
                 host_dense: Sequence[Any] = (), schedulers: Sequence[Any] = (), remote: bool = False) -> None:
        self.dense, self.sparse = dense, dict(sparse or {})
        self.steppers = {k: (steppers or {}).get(k, o) for k, o in self.sparse.items()}
        if unknown := sorted(set(steppers or {}) - set(self.sparse)):
            raise ValueError(f"steppers {unknown} step no sparse optimizer of this container ({sorted(self.sparse)})")
        self.device_tables, self.host_dense = list(device_tables), list(host_dense)
        self.schedulers, self.remote = list(schedulers), remote

    def _own_dense(self) -> list[Any]:
        return ([self.dense] if self.dense is not None else []) + self.device_tables

    def zero_grad(self) -> None:
        """Every optimizer's ``zero_grad`` (the dense ones set gradients to ``None``)."""
        for s in self.steppers.values():
            s.zero_grad()
        for o in self._own_dense() + self.host_dense:
            o.zero_grad(set_to_none=True) if isinstance(o, torch.optim.Optimizer) else o.zero_grad()

    def step(self, between: Callable[[], None] | None = None,
             host_work: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
        """Every optimizer's update, in the class's order; then every schedule's step."""
        if self.remote:
            for s in self.steppers.values():
                s.step()
            if between is not None:
                between()
        for o in self._own_dense():
            o.step()
        with host_work():
            for o in self.host_dense:
                o.step()
            if not self.remote:
                for s in self.steppers.values():
                    s.step()
        for s in self.schedulers:
            s.step()

    def flush(self) -> None:
        """Send what parameter-server steppers hold back (the last step's pushes)."""
        for s in self.steppers.values():
            if hasattr(s, "flush"):
                s.flush()

    def sparse_state_dict(self, include_state: bool = True) -> dict[str, Any]:
        """Each sparse optimizer's state by name, through its stepper (a distributed one gathers)."""
        return {k: s.state_dict(include_state=include_state) for k, s in self.steppers.items()}

    def load_sparse_state_dict(self, state: Mapping[str, Any]) -> None:
        for k, s in self.steppers.items():
            s.load_state_dict(state[k])

    def check_sparse_state(self, state: Mapping[str, Any]) -> None:
        """Check, changing nothing, that ``state`` (:meth:`sparse_state_dict`) fits every sparse optimizer.

        Raises:
            ValueError: a sparse optimizer it lacks, or the first difference (type, tables, shapes).
        """
        for k, opt in self.sparse.items():
            if k not in state:
                raise ValueError(f"it has no sparse optimizer {k!r}")
            opt.check_state_dict(state[k])

    def hyper_parameters(self) -> dict[str, dict[str, Any]]:
        """Every optimizer's hyper-parameters now, by where they live (the dense groups, each sparse optimizer)."""
        out = {f"dense_optimizer group {i}": {k: v for k, v in g.items() if k != "params"}
               for i, g in enumerate(self.dense.param_groups if self.dense is not None else [])}
        out.update({f"sparse optimizer {k!r}": dict(o.hyper) for k, o in self.sparse.items()})
        return out

    def set_hyper_parameters(self, values: Mapping[str, Mapping[str, Any]],
                             changed: Callable[[str, str, Any, Any], None] | None = None) -> None:
        """Set hyper-parameters :meth:`hyper_parameters` returned (a resume keeps the run's own),
        calling ``changed(where, key, new, old)`` for each that differs."""
        targets = {f"dense_optimizer group {i}": g
                   for i, g in enumerate(self.dense.param_groups if self.dense is not None else [])}
        targets.update({f"sparse optimizer {k!r}": o.hyper for k, o in self.sparse.items()})
        for where, group_values in values.items():
            group = targets[where]
            for key, value in group_values.items():
                if group.get(key) != value:
                    if changed is not None:
                        changed(where, key, value, group.get(key))
                    group[key] = value

    def scheduler_state_dict(self) -> list[dict[str, Any]]:
        return [s.state_dict() for s in self.schedulers]

    def load_scheduler_state_dict(self, state: Sequence[Mapping[str, Any]]) -> None:
        if len(state) != len(self.schedulers):
            raise ValueError(f"the state holds {len(state)} learning-rate schedules, this run has {len(self.schedulers)}")
        for s, st in zip(self.schedulers, state):
            s.load_state_dict(st)
