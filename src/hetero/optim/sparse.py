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
* :class:`RowWiseAdagrad` - Adagrad with one accumulator per row (the mean of ``g^2`` over the
  row), as FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` used by TorchRec/DLRM: ``s_r += mean(g^2);
  w -= lr * g / (sqrt(s_r) + eps)``; its state is ``D`` times smaller.
* :class:`SGD` - ``w -= lr * g``.

The updates run as fused numba kernels (:mod:`hetero.embedding._numba_kernels`), one call per
table group and step, parallel over rows. For fp32 tables every weight and state row is read and
written once, in place; for bf16/fp16 tables the rows are gathered, updated in fp32 and written
back with round-to-nearest. Rows are independent, so results do not depend on the thread count.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from hetero.embedding import HostEmbedding
from hetero.embedding.exchange import RowSpace
from hetero.embedding.group import TableGroup
from hetero.embedding.kernels import kernels
from hetero.placement import host_empty

f32 = np.float32
_NO_ROWS = np.empty((0, 1), np.float32)  # an absent (U, D) or (N, D) gradient argument
_NO_IDX = np.empty(0, np.int64)
_NO_SCALE = np.empty(0, np.float32)


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
class RowWiseAdagradConfig:
    lr: float = 0.01
    eps: float = 1e-10
    initial_accumulator: float = 0.0


@dataclasses.dataclass(frozen=True)
class SGDConfig:
    lr: float = 0.01


class SparseOptimizer(torch.optim.Optimizer, abc.ABC):
    """Base class: owns host tables, their per-row state, and a step count per table group.

    Args:
        tables: the tables to train, as ``{qualified name: table}`` (use
            :func:`hetero.embedding.host_tables`) or an iterable (keyed by table name). Tables that
            share storage (a :class:`~hetero.embedding.HostEmbeddingCollection` group) must all be
            given to the same optimizer.
        config: the optimizer's hyper-parameters (its ``Config`` dataclass); default if ``None``.

    Use like ``torch.optim``: ``zero_grad()`` before the forward, ``loss.backward()``, ``step()``.
    It is a ``torch.optim.Optimizer`` with one param group (the tables' weights) that carries the
    config's hyper-parameters: ``torch.optim.lr_scheduler`` schedules act on it, and every step
    reads the group's current values. ``state[table.weight]`` (torch's per-parameter state) and
    :attr:`table_state` (by table name) are views of the per-row state.

    Raises:
        ValueError: no tables, only part of a table group, or a learning rate that is negative or
            not finite (also from ``step()``, when a schedule produced one).
        TypeError: a config of another optimizer.
    """

    Config: ClassVar[type]
    state_names: ClassVar[tuple[str, ...]] = ()
    rowwise_state: ClassVar[bool] = False  # one state value per row instead of per element

    def __init__(self, tables: Mapping[str, HostEmbedding] | Iterable[HostEmbedding], config: Any = None) -> None:
        if not isinstance(tables, Mapping):
            tables = {t.name: t for t in tables}
        if not tables:
            raise ValueError(f"{type(self).__name__}: no host tables to optimize")
        self.config = config if config is not None else self.Config()
        if not isinstance(self.config, self.Config):
            raise TypeError(f"{type(self).__name__} takes a {self.Config.__name__}, got {type(self.config).__name__}")
        self.tables: dict[str, HostEmbedding] = dict(tables)
        super().__init__([t.weight for t in self.tables.values()], dataclasses.asdict(self.config))
        self._check_lr()
        owned = set(self.tables.values())  # modules hash by identity
        self.groups: list[TableGroup] = []
        for t in (t for t in self.tables.values() if not any(g is t.group for g in self.groups)):
            if others := [o.name for o in t.group.tables if o not in owned]:
                raise ValueError(
                    f"{type(self).__name__}: table {t.name!r} shares storage with tables {others} (same "
                    f"collection, dim and dtype), which this optimizer was not given; give all of them to one optimizer"
                )
            self.groups.append(t.group)
        self._group_steps: dict[TableGroup, int] = {g: 0 for g in self.groups}  # groups hash by identity
        # State beside the table: same rows, host memory, fp32.
        self.group_state: dict[TableGroup, dict[str, Tensor]] = {
            g: {s: self._initial_state(s, g) for s in self.state_names} for g in self.groups
        }
        for g in self.groups:
            if g.ssd_config is not None:  # each row's record: the row, then this optimizer's state
                g.ssd_layout({s: (self.rowwise_state, self.state_initial(s)) for s in self.state_names})
        for name, views in self._state_views().items():
            self.state[self.tables[name].weight] = views

    @property
    def hyper(self) -> dict[str, Any]:
        """The hyper-parameters the next step uses: the param group (a schedule may change them)."""
        return self.param_groups[0]

    def _check_lr(self) -> None:
        lr = self.hyper["lr"]
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
            raise ValueError(f"{type(self).__name__}: learning rate must be a finite number >= 0, got {lr!r}")

    def state_initial(self, name: str) -> float:
        """The value every row of state ``name`` starts from."""
        return 0.0

    def _initial_state(self, name: str, group: TableGroup) -> Tensor:
        shape = (group.num_rows,) if self.rowwise_state else (group.num_rows, group.dim)
        if group.storage.is_meta:  # the rows live on parameter servers or the SSD tier, and so does their state
            return torch.empty(shape, device="meta")
        return host_empty(shape, torch.float32).fill_(self.state_initial(name))

    @property
    def steps(self) -> dict[str, int]:
        """Steps applied per table (tables of one group share the count; LazyAdam's ``t``)."""
        return {name: self._group_steps[t.group] for name, t in self.tables.items()}

    def _state_views(self) -> dict[str, dict[str, Tensor]]:
        out = {}
        for name, t in self.tables.items():
            a = t.group.local_start(t)  # (a row-sharded group: the shard's rows of the table)
            out[name] = {s: x[a : a + t.weight.shape[0]] for s, x in self.group_state[t.group].items()}
        return out

    @property
    def table_state(self) -> dict[str, dict[str, Tensor]]:
        """Per-table views of the state: ``{table name: {state name: (V, D) or (V,) tensor}}``;
        for a table on the SSD tier, copies read from it (every row: tables that fit in memory), or
        nothing where its group's ``rows_in_state_dict`` is off (a checkpoint's tier snapshots hold it)."""
        views, g = self._state_views(), {name: t.group for name, t in self.tables.items()}
        return {name: g[name].ssd_read(g[name].local_start(t), t.weight.shape[0], tuple(self.state_names))
                if g[name].ssd_here else views[name]
                for name, t in self.tables.items() if g[name].rows_in_state_dict}

    def count_step(self, group: TableGroup) -> None:
        """Count a step of ``group`` that changed none of its rows here: a parameter-server shard
        whose rows the batch missed while the table's other shards were updated. Keeps LazyAdam's
        per-table step ``t`` (its bias correction) the same on every shard."""
        self._group_steps[group] += 1

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - torch.optim's signature
        for group in self.groups:
            group.pending.clear()
            group.exchange.clear()

    def step(self, closure=None) -> None:  # noqa: ANN001 - torch.optim's signature; no closure support
        """Apply the pending sparse gradient of every table group; groups without one are skipped."""
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step() takes no closure")
        self._check_lr()
        for group in self.groups:
            self.step_group(group)

    @torch.no_grad()
    def step_group(self, group: TableGroup) -> None:
        """:meth:`step` for ``group`` alone (a parameter server applies one push at a time); without a
        gradient too, its dynamic tables' clock advances and new rows' state is reset (``begin_step``)."""
        grad = group.dynamic.begin_step(group.pending.take(), self.group_state[group], self.state_initial)  # (new keys)
        if grad is None or grad.ids.numel() == 0:
            return
        # The kernels index this process's storage: group rows only where they are the same.
        assert grad.space is RowSpace.LOCAL or group.exchange.placement.rows_here, (grad.space, group.exchange)
        step = self._group_steps[group] = self._group_steps[group] + 1
        ids = grad.ids.numpy()
        src, _, offsets, scale = grad.per_id if grad.per_id is not None else (None,) * 4
        if grad.is_coalesced or offsets.numel() or grad.chain is None or not grad.chain[0].numel():
            # pooled bags, or no occurrence chains (torch.unique deduped: row-sharded, SSD tier): coalesce first
            g = (grad.rows.contiguous().numpy(), _NO_ROWS, _NO_IDX, _NO_IDX, _NO_SCALE, kernels().num_threads())
        else:  # per-id gradient: the kernel sums each row's occurrences as it updates the row
            first, nxt = (t.numpy() for t in grad.chain)
            g = (_NO_ROWS, src.numpy(), first, nxt, scale.numpy(), kernels().num_threads())
        if group.ssd_config is not None:
            self._step_cached(group, grad.ids, g, step)
            return
        state = [x.numpy() for x in self.group_state[group].values()]
        if group.dtype == torch.float32:
            self._update(group.storage.numpy(), ids, state, ids, g, step)
        else:  # low-precision storage: update an fp32 copy of the rows, write back rounded
            rows = group.storage.index_select(0, grad.ids).float()
            self._update(rows.numpy(), np.arange(len(ids)), state, ids, g, step)
            group.storage.index_copy_(0, grad.ids, rows.to(group.dtype))
        group.note_update(grad.ids)

    def _step_cached(self, group: TableGroup, ids: Tensor, grad: tuple, step: int) -> None:
        """The update of rows ``ids`` of a group on the SSD tier, in its row cache: the same
        kernel on the rows' cache slots (resident again if a later lookup gave them up: the
        file holds their written-back records), which become dirty."""
        cache = group.ssd_rows().cache
        slots = cache.acquire(ids.numpy(), used=False)
        w, state = cache.fields["weight"], [cache.fields[s].numpy() for s in self.state_names]
        if group.dtype == torch.float32:
            self._update(w.numpy(), slots, state, slots, grad, step)
        else:  # low-precision rows: updated in fp32, written back rounded (as in memory)
            at = torch.from_numpy(slots)
            rows = w.index_select(0, at).float()
            self._update(rows.numpy(), np.arange(len(slots)), state, slots, grad, step)
            w.index_copy_(0, at, rows.to(group.dtype))
        cache.mark_dirty(slots)
        group.note_update(ids)

    @abc.abstractmethod
    def _update(self, w: np.ndarray, widx: np.ndarray, state: list[np.ndarray], ids: np.ndarray, grad: tuple, step: int) -> None:
        """Run the kernel on rows ``ids`` of the state and rows ``widx`` of ``w``.

        ``grad`` is the kernels' gradient arguments: ``(grad, src, first, next, scale, nthreads)``.
        """

    def state_dict(self, include_state: bool = True) -> dict[str, Any]:
        """Type, hyper-parameters (``config``: the param group's current values), steps per table
        and (``include_state``) the per-table row state views."""
        config = {k: self.hyper[k] for k in dataclasses.asdict(self.config)}
        out = {"optimizer": type(self).__name__, "config": config, "steps": self.steps}
        if include_state:
            out["state"] = self.table_state
        return out

    def check_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Check, without changing anything, that a :meth:`state_dict` of whole tables (any world
        size) fits this optimizer: its type, its tables and each state's global shape.

        Raises:
            ValueError: naming the first difference.
        """
        kind = type(self).__name__
        if state_dict["optimizer"] != kind:
            raise ValueError(f"sparse optimizer state is for {state_dict['optimizer']}, not {kind}")
        saved, ours = set(state_dict["steps"]), set(self.tables)
        if saved != ours:
            raise ValueError(f"{kind} state holds tables {sorted(saved)}, this optimizer has {sorted(ours)}")
        for name, tensors in state_dict.get("state", {}).items():
            t = self.tables[name]
            for s, x in tensors.items():
                want = (t.config.num_rows,) if self.rowwise_state else (t.config.num_rows, t.config.embedding_dim)
                if tuple(x.shape) != want:
                    raise ValueError(f"{kind} state {s!r} of table {name!r} has shape {tuple(x.shape)} in the checkpoint "
                                     f"and {want} here")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore state saved by :meth:`state_dict`. Without ``"state"``, only the configuration
        and step counts are restored (a distributed checkpoint restores the per-row state in place).

        Raises:
            ValueError: the saved optimizer type, tables or state shapes differ from this one.
        """
        kind = type(self).__name__
        if state_dict["optimizer"] != kind:
            raise ValueError(f"sparse optimizer state is for {state_dict['optimizer']}, not {kind}")
        if "state" not in state_dict:
            self._load_counts(state_dict)
            return
        saved, ours = set(state_dict["state"]), {k for k, t in self.tables.items() if t.group.rows_in_state_dict}
        if saved != ours:
            raise ValueError(f"{kind} state holds tables {sorted(saved)}, this optimizer has {sorted(ours)}")
        views = self._state_views()
        for name, tensors in state_dict["state"].items():
            for s, t in tensors.items():
                mine = views[name][s]
                if t.shape != mine.shape:
                    raise ValueError(
                        f"{kind} state {s!r} of table {name!r} has shape {tuple(t.shape)} in the checkpoint "
                        f"and {tuple(mine.shape)} here"
                    )
        for name, tensors in state_dict["state"].items():
            table = self.tables[name]
            for s, t in tensors.items():
                if table.group.ssd_config is not None:
                    table.group.ssd_assign(s, table.group.local_start(table), t)
                else:
                    views[name][s].copy_(t)
        self._load_counts(state_dict)

    def _load_counts(self, state_dict: Mapping[str, Any]) -> None:
        saved, ours = set(state_dict["steps"]), set(self.tables)
        if saved != ours:
            raise ValueError(f"{type(self).__name__} state holds tables {sorted(saved)}, this optimizer has {sorted(ours)}")
        for name, t in self.tables.items():
            self._group_steps[t.group] = int(state_dict["steps"][name])
        self.hyper.update(state_dict["config"])


class LazyAdam(SparseOptimizer):
    Config = LazyAdamConfig
    state_names = ("exp_avg", "exp_avg_sq")

    def _update(self, w, widx, state, ids, grad, step):
        c = self.hyper
        step_size = c["lr"] * math.sqrt(1 - c["beta2"] ** step) / (1 - c["beta1"] ** step)
        kernels().lazy_adam(w, widx, *state, ids, *grad, f32(step_size), f32(c["beta1"]), f32(c["beta2"]), f32(c["eps"]))


class FTRL(SparseOptimizer):
    Config = FTRLConfig
    state_names = ("accumulator", "linear")  # n and z in McMahan et al.

    def state_initial(self, name):
        return self.config.initial_accumulator if name == "accumulator" else 0.0

    def _update(self, w, widx, state, ids, grad, step):
        c = self.hyper
        kernels().ftrl(w, widx, *state, ids, *grad, f32(c["lr"]), f32(c["l1"]), f32(c["l2"]), f32(c["beta"]))


class Adagrad(SparseOptimizer):
    Config = AdagradConfig
    state_names = ("sum",)

    def state_initial(self, name):
        return self.config.initial_accumulator

    def _update(self, w, widx, state, ids, grad, step):
        kernels().adagrad(w, widx, *state, ids, *grad, f32(self.hyper["lr"]), f32(self.hyper["eps"]))


class RowWiseAdagrad(Adagrad):
    Config = RowWiseAdagradConfig
    rowwise_state = True

    def _update(self, w, widx, state, ids, grad, step):
        kernels().rowwise_adagrad(w, widx, *state, ids, *grad, f32(self.hyper["lr"]), f32(self.hyper["eps"]))


class SGD(SparseOptimizer):
    Config = SGDConfig

    def _update(self, w, widx, state, ids, grad, step):
        kernels().sgd(w, widx, ids, *grad, f32(self.hyper["lr"]))


class SparseOptimizerKind(enum.Enum):
    """The sparse optimizers by name, for configs and the command line."""

    LAZY_ADAM = "lazy_adam"
    FTRL = "ftrl"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    SGD = "sgd"

    @property
    def optimizer(self) -> type[SparseOptimizer]:
        return {"lazy_adam": LazyAdam, "ftrl": FTRL, "adagrad": Adagrad, "rowwise_adagrad": RowWiseAdagrad,
                "sgd": SGD}[self.value]
