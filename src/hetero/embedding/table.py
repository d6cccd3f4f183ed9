"""Host embedding table (:class:`HostEmbedding`) and a collection of them.

Data flow of one training step, for a batch of ids (all on the host until marked):

1. check the ids against the vocab (or hash them into it), then ``unique`` -> ``U`` unique ids and
   the inverse map ``inverse`` (each id's position among the unique ids);
2. gather the ``U`` unique rows from the host table (one copy) and send them, with ``inverse``, to
   the device (one host->device copy, async on CUDA);
3. on the device, ``embedding``/``embedding_bag`` over the ``U`` rows with ``inverse`` produces the
   per-id (or pooled) output; autograd's backward of that gather *coalesces* the gradient of
   repeated ids into one ``(U, D)`` block on the device;
4. a hook copies that ``(U, D)`` block back to the host (one device->host copy) as a
   :class:`SparseGrad`, which a sparse optimizer in :mod:`hetero.optim` applies to the ``U`` rows.

So the table, its optimizer state and every update stay in host memory; per step only ``U`` rows
cross the host/device link in each direction.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hetero.placement import copy_to


class Pooling(enum.Enum):
    """How the embeddings of one bag (a multi-hot feature of one sample) are combined."""

    NONE = "none"  # one output row per id
    SUM = "sum"
    MEAN = "mean"


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    Attributes:
        name: table name; used in error messages, checkpoints and optimizer state.
        num_embeddings: vocab size (rows). Valid ids are ``0 <= id < num_embeddings``.
        embedding_dim: row width ``D`` (1 for the wide part of Wide & Deep).
        feature: key of the input feature this table looks up (defaults to ``name``).
        pooling: how bags are pooled (:class:`Pooling`).
        hashed: map any int64 id into range with ``id mod num_embeddings`` (the hashing trick)
            instead of raising :class:`IndexError` for out-of-range ids.
        init_std: rows are initialised from ``N(0, init_std**2)``; 0 gives a zero table.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature: str | None = None
    pooling: Pooling = Pooling.NONE
    hashed: bool = False
    init_std: float = 0.01

    def __post_init__(self) -> None:
        if self.num_embeddings <= 0 or self.embedding_dim <= 0:
            raise ValueError(
                f"table {self.name!r}: num_embeddings and embedding_dim must be positive, got "
                f"{self.num_embeddings} x {self.embedding_dim}"
            )

    @property
    def feature_name(self) -> str:
        return self.feature or self.name


@dataclasses.dataclass
class SparseGrad:
    """Gradient of a host table for one step: only the rows the batch touched.

    Attributes:
        ids: ``(U,)`` int64, host, unique row ids (sorted ascending).
        rows: ``(U, D)`` float32, host, the coalesced gradient of each of those rows.
        ready: on CUDA, the event recorded after the async device->host copy of ``rows``;
            :meth:`wait` blocks on it before the host reads ``rows``. ``None`` on CPU.
    """

    ids: Tensor
    rows: Tensor
    ready: "torch.cuda.Event | None" = None

    def wait(self) -> "SparseGrad":
        if self.ready is not None:
            self.ready.synchronize()  # sync point: host waits for the device->host gradient copy
            self.ready = None
        return self

    @staticmethod
    def coalesce(grads: list["SparseGrad"]) -> "SparseGrad":
        """Sum several sparse gradients of one table (gradient accumulation over micro-batches)."""
        if len(grads) == 1:
            return grads[0].wait()
        for g in grads:
            g.wait()
        ids, inverse = torch.unique(torch.cat([g.ids for g in grads]), return_inverse=True)
        rows = torch.zeros(ids.numel(), grads[0].rows.shape[1], dtype=grads[0].rows.dtype)
        rows.index_add_(0, inverse, torch.cat([g.rows for g in grads]))
        return SparseGrad(ids, rows)


class HostEmbedding(nn.Module):
    """An embedding table that lives in host memory and never moves to the device.

    ``module.to(device)`` / ``.cuda()`` / ``.half()`` leave the table where and as it is (fp32 on
    the host) and only change where (and in which dtype) the looked-up rows are delivered: the
    output follows the rest of the model.

    The table is an ``nn.Parameter`` with ``requires_grad=False`` so that it is in ``state_dict``
    and ``named_parameters`` but no dense ``torch.optim`` optimizer ever touches it; it is trained
    by a sparse optimizer from :mod:`hetero.optim`, which consumes :meth:`pop_sparse_grad`.

    Forward inputs (ids must be int64 or int32, on the host or the device):

    * ``ids`` of shape ``(B, F)`` (or any shape) with ``Pooling.NONE`` -> ``(*ids.shape, D)``;
    * ``ids`` of shape ``(B, L)`` with ``Pooling.SUM``/``MEAN`` -> ``(B, D)``, pooled over ``L``;
    * 1-D ``ids`` with ``offsets`` of shape ``(B + 1,)``, ``offsets[0] == 0`` and
      ``offsets[-1] == len(ids)``; bag ``b`` is ``ids[offsets[b]:offsets[b + 1]]`` (TorchRec's jagged
      layout; ``nn.EmbeddingBag`` with ``include_last_offset=True``) -> ``(B, D)``; an empty bag
      pools to zeros.

    Raises:
        IndexError: an id is negative or ``>= num_embeddings`` and the table is not ``hashed``;
            the message names the table, the id and the vocab size. Raised before any state changes.
        ValueError: ids of a non-integer dtype, malformed ``offsets``, or ``offsets`` with
            ``Pooling.NONE``.
    """

    def __init__(self, config: TableConfig) -> None:
        super().__init__()
        self.config = config
        weight = torch.empty(config.num_embeddings, config.embedding_dim, dtype=torch.float32)
        if config.init_std > 0:
            weight.normal_(0.0, config.init_std)
        else:
            weight.zero_()
        self.weight = nn.Parameter(weight, requires_grad=False)
        # Zero-size probe that follows .to()/.cuda()/.half(): it records where and in which dtype
        # the rest of the model lives, i.e. where the looked-up rows must be delivered.
        self.register_buffer("_device_anchor", torch.empty(0), persistent=False)
        self._pending: list[SparseGrad] = []

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def output_device(self) -> torch.device:
        return self._device_anchor.device

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - signature of nn.Module._apply
        # Host residency is the point of this module: hide the table from .to()/.cuda()/.half().
        table = self._parameters.pop("weight")
        try:
            return super()._apply(fn, recurse)
        finally:
            self._parameters["weight"] = table

    def extra_repr(self) -> str:
        c = self.config
        return f"{c.name!r}, {c.num_embeddings}, {c.embedding_dim}, pooling={c.pooling.value}, host-resident"

    def checked_ids(self, ids: Tensor) -> Tensor:
        """Return ``ids`` as int64 on the host, hashed into range or validated.

        Raises:
            IndexError: an out-of-range id on a table that is not ``hashed``.
            ValueError: ids of a non-integer dtype.
        """
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"table {self.name!r}: ids must be int64 or int32, got {ids.dtype}")
        ids = ids.to("cpu", torch.int64)  # sync point if ids live on the device: lookups run on the host
        vocab = self.config.num_embeddings
        if self.config.hashed:
            return torch.remainder(ids, vocab)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise IndexError(
                f"table {self.name!r}: id {bad} is out of range for vocab size {vocab} "
                f"(valid ids are 0..{vocab - 1}); fix the feature encoding or set hashed=True "
                f"on this table to hash ids into range"
            )
        return ids

    def forward(self, ids: Tensor, offsets: Tensor | None = None) -> Tensor:
        pooling = self.config.pooling
        if offsets is not None and pooling is Pooling.NONE:
            raise ValueError(f"table {self.name!r}: offsets given but pooling is 'none'; use SUM or MEAN")
        flat = self.checked_ids(ids).reshape(-1)
        unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        rows = self.weight.detach().index_select(0, unique)  # host gather: the only read of the table
        device, dtype = self._device_anchor.device, self._device_anchor.dtype
        rows_dev = copy_to(rows, device).to(dtype)  # host -> device: U rows, not B*F
        inverse_dev = copy_to(inverse, device)
        if torch.is_grad_enabled():
            rows_dev.requires_grad_(True)
            rows_dev.register_hook(lambda grad, unique=unique: self._capture_grad(unique, grad))
        if offsets is not None:
            offsets = offsets.to("cpu", torch.int64)
            if offsets.dim() != 1 or offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != flat.numel():
                raise ValueError(
                    f"table {self.name!r}: offsets must be 1-D of length B + 1 with offsets[0] == 0 and "
                    f"offsets[-1] == len(ids) == {flat.numel()}, got {offsets.tolist()[:8]}"
                )
            return F.embedding_bag(
                inverse_dev, rows_dev, copy_to(offsets, device), mode=pooling.value, include_last_offset=True
            )
        if pooling is Pooling.NONE:
            return F.embedding(inverse_dev.view(ids.shape), rows_dev)
        if ids.dim() != 2:
            raise ValueError(f"table {self.name!r}: pooled lookup without offsets needs 2-D ids (B, L), got {tuple(ids.shape)}")
        return F.embedding_bag(inverse_dev.view(ids.shape), rows_dev, mode=pooling.value)

    def _capture_grad(self, unique: Tensor, grad: Tensor) -> None:
        # Runs inside backward. ``grad`` is already coalesced per unique id (backward of the gather).
        if grad.device.type == "cuda":
            rows = torch.empty(grad.shape, dtype=torch.float32, pin_memory=True)
            rows.copy_(grad, non_blocking=True)  # device -> host into pinned memory, async
            ready = torch.cuda.Event()
            ready.record()
            self._pending.append(SparseGrad(unique, rows, ready))
        else:
            self._pending.append(SparseGrad(unique, grad.detach().to(torch.float32)))

    def pop_sparse_grad(self) -> SparseGrad | None:
        """Take the sparse gradient accumulated since the last call (``None`` if there is none)."""
        if not self._pending:
            return None
        grads, self._pending = self._pending, []
        return SparseGrad.coalesce(grads)

    def zero_grad_sparse(self) -> None:
        self._pending = []


class HostEmbeddingCollection(nn.Module):
    """Several host tables looked up together; ``forward`` maps feature name -> ids.

    Input: a mapping from feature name to ids (a tensor) or to ``(ids, offsets)`` for bags.
    Output: a dict from table name to the table's output (see :class:`HostEmbedding`).
    """

    def __init__(self, tables: list[TableConfig] | tuple[TableConfig, ...]) -> None:
        super().__init__()
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {names}")
        self.tables = nn.ModuleDict({t.name: HostEmbedding(t) for t in tables})

    def forward(self, features: Mapping[str, Tensor | tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        out = {}
        for name, table in self.tables.items():
            key = table.config.feature_name
            if key not in features:
                raise KeyError(f"table {name!r} looks up feature {key!r}, which is not in the batch; "
                               f"batch features: {sorted(features)}")
            x = features[key]
            out[name] = table(*x) if isinstance(x, tuple) else table(x)
        return out


def host_tables(module: nn.Module) -> dict[str, HostEmbedding]:
    """All host tables in ``module`` by qualified name (stable keys for optimizers and checkpoints)."""
    return {name: m for name, m in module.named_modules() if isinstance(m, HostEmbedding)}


def dense_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """Trainable parameters of ``module`` that are not host tables: what a dense optimizer takes."""
    table_ids = {id(t.weight) for t in host_tables(module).values()}
    return (p for p in module.parameters() if p.requires_grad and id(p) not in table_ids)

