"""Row-sparse optimizers whose state lives beside the table in host memory.

Each optimizer reads the :class:`~hetero.embedding.SparseGrad` of every table it owns (unique row
ids + coalesced gradient rows), gathers those rows of the weight and of each state tensor, applies
its published update rule, and writes them back. Rows absent from the batch are untouched, state
included ("lazy" updates). All arithmetic is fp32 on the host.

Update rules (``g`` is the coalesced gradient of a row, all ops elementwise):

* :class:`LazyAdam` - Adam (Kingma & Ba 2015) applied lazily to the touched rows, as TensorFlow
  Addons' ``LazyAdam`` and MindSpore's ``FusedSparseLazyAdam``; the step count ``t`` is per table
  and advances once per step in which the table received a gradient:
  ``m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  w -= lr sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps)``.
* :class:`FTRL` - FTRL-Proximal, Algorithm 1 of McMahan et al., "Ad Click Prediction: a View from
  the Trenches", KDD 2013 (the optimizer of the wide part in Wide & Deep):
  ``sigma = (sqrt(n + g^2) - sqrt(n)) / lr;  z += g - sigma w;  n += g^2;``
  ``w = 0 if |z| <= l1 else -(z - sign(z) l1) / ((beta + sqrt(n)) / lr + l2)``.
  (TensorFlow/MindSpore ``ApplyFtrl`` with ``lr_power=-0.5`` is the same rule with ``beta=0`` and
  their ``l2`` equal to half of this ``l2``.)
* :class:`Adagrad` - Duchi et al. 2011, as ``torch.optim.Adagrad`` (no lr decay):
  ``s += g^2;  w -= lr * g / (sqrt(s) + eps)``.
* :class:`SGD` - ``w -= lr * g``.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from hetero.embedding import HostEmbedding


@dataclasses.dataclass(frozen=True)
class LazyAdamConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8


@dataclasses.dataclass(frozen=True)
class FTRLConfig:
    lr: float = 0.05  # alpha in McMahan et al.
    l1: float = 0.0
    l2: float = 0.0
    beta: float = 1.0
    initial_accumulator: float = 0.0  # initial n


@dataclasses.dataclass(frozen=True)
class AdagradConfig:
    lr: float = 0.01
    eps: float = 1e-10
    initial_accumulator: float = 0.0


@dataclasses.dataclass(frozen=True)
class SGDConfig:
    lr: float = 0.01


class SparseOptimizer(abc.ABC):
    """Base class: owns host tables, their per-row state, and a per-table step count.

    Args:
        tables: the tables to train, as ``{qualified name: table}`` (use
            :func:`hetero.embedding.host_tables`) or an iterable (keyed by table name).
        config: the optimizer's hyper-parameters (its ``Config`` dataclass); default if ``None``.

    Use like ``torch.optim``: ``zero_grad()`` before the forward, ``loss.backward()``, ``step()``.
    """

    Config: ClassVar[type]
    state_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tables: Mapping[str, HostEmbedding] | Iterable[HostEmbedding], config: Any = None) -> None:
        if not isinstance(tables, Mapping):
            tables = {t.name: t for t in tables}
        if not tables:
            raise ValueError(f"{type(self).__name__}: no host tables to optimize")
        self.config = config if config is not None else self.Config()
        if not isinstance(self.config, self.Config):
            raise TypeError(f"{type(self).__name__} takes a {self.Config.__name__}, got {type(self.config).__name__}")
        self.tables: dict[str, HostEmbedding] = dict(tables)
        self.steps: dict[str, int] = {name: 0 for name in self.tables}
        # State beside the table: same shape, same (host) device, fp32.
        self.state: dict[str, dict[str, Tensor]] = {
            name: {s: self._initial_state(s, t.weight) for s in self.state_names} for name, t in self.tables.items()
        }

    def _initial_state(self, name: str, weight: Tensor) -> Tensor:
        return torch.zeros_like(weight, dtype=torch.float32)

    def zero_grad(self) -> None:
        for table in self.tables.values():
            table.zero_grad_sparse()

    @torch.no_grad()
    def step(self) -> None:
        """Apply the pending sparse gradient of every table; tables without one are skipped."""
        for name, table in self.tables.items():
            grad = table.pop_sparse_grad()
            if grad is None or grad.ids.numel() == 0:
                continue
            self.steps[name] += 1
            self._update(table.weight.data, self.state[name], grad.ids, grad.rows, self.steps[name])

    @abc.abstractmethod
    def _update(self, weight: Tensor, state: dict[str, Tensor], ids: Tensor, grad: Tensor, step: int) -> None:
        """Update rows ``ids`` (unique, int64) of ``weight`` and ``state`` from ``grad`` ``(U, D)``."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": type(self).__name__,
            "config": dataclasses.asdict(self.config),
            "steps": dict(self.steps),
            "state": {name: dict(s) for name, s in self.state.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore state saved by :meth:`state_dict`.

        Raises:
            ValueError: the saved optimizer type, tables or state shapes differ from this one.
        """
        kind = type(self).__name__
        if state_dict["optimizer"] != kind:
            raise ValueError(f"sparse optimizer state is for {state_dict['optimizer']}, not {kind}")
        saved, ours = set(state_dict["state"]), set(self.state)
        if saved != ours:
            raise ValueError(f"{kind} state holds tables {sorted(saved)}, this optimizer has {sorted(ours)}")
        for name, tensors in state_dict["state"].items():
            for s, t in tensors.items():
                mine = self.state[name][s]
                if t.shape != mine.shape:
                    raise ValueError(
                        f"{kind} state {s!r} of table {name!r} has shape {tuple(t.shape)} in the checkpoint "
                        f"and {tuple(mine.shape)} here"
                    )
                mine.copy_(t)
        self.steps = {name: int(n) for name, n in state_dict["steps"].items()}
        self.config = self.Config(**state_dict["config"])


class LazyAdam(SparseOptimizer):
    Config = LazyAdamConfig
    state_names = ("exp_avg", "exp_avg_sq")

    def _update(self, weight, state, ids, grad, step):
        c = self.config
        m = state["exp_avg"].index_select(0, ids).mul_(c.beta1).add_(grad, alpha=1 - c.beta1)
        v = state["exp_avg_sq"].index_select(0, ids).mul_(c.beta2).addcmul_(grad, grad, value=1 - c.beta2)
        step_size = c.lr * math.sqrt(1 - c.beta2**step) / (1 - c.beta1**step)
        w = weight.index_select(0, ids).addcdiv_(m, v.sqrt().add_(c.eps), value=-step_size)
        state["exp_avg"].index_copy_(0, ids, m)
        state["exp_avg_sq"].index_copy_(0, ids, v)
        weight.index_copy_(0, ids, w)


class FTRL(SparseOptimizer):
    Config = FTRLConfig
    state_names = ("accumulator", "linear")  # n and z in McMahan et al.

    def _initial_state(self, name, weight):
        fill = self.config.initial_accumulator if name == "accumulator" else 0.0
        return torch.full_like(weight, fill, dtype=torch.float32)

    def _update(self, weight, state, ids, grad, step):
        c = self.config
        n = state["accumulator"].index_select(0, ids)
        z = state["linear"].index_select(0, ids)
        w = weight.index_select(0, ids)
        n_new = n + grad * grad
        sqrt_n_new = n_new.sqrt()
        z.add_(grad).sub_((sqrt_n_new - n.sqrt()).div_(c.lr).mul_(w))
        w = torch.where(
            z.abs() <= c.l1,
            torch.zeros_like(z),
            -(z - torch.sign(z) * c.l1) / ((c.beta + sqrt_n_new) / c.lr + c.l2),
        )
        state["accumulator"].index_copy_(0, ids, n_new)
        state["linear"].index_copy_(0, ids, z)
        weight.index_copy_(0, ids, w)


class Adagrad(SparseOptimizer):
    Config = AdagradConfig
    state_names = ("sum",)

    def _initial_state(self, name, weight):
        return torch.full_like(weight, self.config.initial_accumulator, dtype=torch.float32)

    def _update(self, weight, state, ids, grad, step):
        c = self.config
        s = state["sum"].index_select(0, ids).addcmul_(grad, grad)
        w = weight.index_select(0, ids).addcdiv_(grad, s.sqrt().add_(c.eps), value=-c.lr)
        state["sum"].index_copy_(0, ids, s)
        weight.index_copy_(0, ids, w)


class SGD(SparseOptimizer):
    Config = SGDConfig

    def _update(self, weight, state, ids, grad, step):
        weight.index_add_(0, ids, grad, alpha=-self.config.lr)


class SparseOptimizerKind(enum.Enum):
    """The sparse optimizers by name, for configs and the command line."""

    LAZY_ADAM = "lazy_adam"
    FTRL = "ftrl"
    ADAGRAD = "adagrad"
    SGD = "sgd"

    @property
    def optimizer(self) -> type[SparseOptimizer]:
        return {"lazy_adam": LazyAdam, "ftrl": FTRL, "adagrad": Adagrad, "sgd": SGD}[self.value]
