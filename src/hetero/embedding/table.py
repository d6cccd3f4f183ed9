"""Host embedding table (:class:`HostEmbedding`).

Data flow of one training step, for a batch of ids (all on the host until marked):

1. check the ids against the vocab (or hash them into it) and dedup them -> ``U`` unique rows
   and the inverse map (:meth:`TableGroup.plan`; numba kernels, no table read; when the device
   is the host, the dedup runs inside the pooling kernel of step 3, beside the pooling);
2. gather the ``U`` unique rows from the host table (one copy, into pinned memory on CUDA) and
   send them to the device (one host->device copy, async on CUDA);
3. on the device, pool (or expand) the ``U`` rows into the per-id or per-bag output; autograd's
   backward of that op *coalesces* the gradient of repeated ids into one ``(U, D)`` block;
4. a hook brings that block back to the host (one device->host copy) as a :class:`SparseGrad`,
   which a sparse optimizer in :mod:`hetero.optim` applies to the ``U`` rows.

So the table, its optimizer state and every update stay in host memory; per step only ``U`` rows
cross the host/device link in each direction.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from hetero.dynamic import KeyMap, Keys
from hetero.dynamic.sharding import KeyShard
from hetero.embedding.config import INIT_CHUNK, Pooling, TableConfig, init_rows
from hetero.embedding.grad import SparseGrad
from hetero.embedding.group import TableGroup
from hetero.embedding.plan import Request
from hetero.placement import StorageTier, Target, host_empty


_DEFERRED = [False]


def defer_tables(deferred: bool = True) -> None:
    """Tables built from now on (``deferred=True``) hold no rows in this process: their weight is
    a ``meta`` tensor of the full shape (a parameter-server job, :mod:`hetero.ps`, where servers
    build the rows they own). Draws from the global RNG are unchanged, so the rest of the model
    initialises as in a plain process."""
    _DEFERRED[0] = deferred


class HostEmbedding(nn.Module):
    """An embedding table that lives in host memory and never moves to the device.

    ``module.to(device)`` / ``.cuda()`` / ``.half()`` leave the table where and as it is and only
    change where (and in which dtype) the looked-up rows are delivered: the output follows the
    rest of the model.

    The table is an ``nn.Parameter`` with ``requires_grad=False`` so that it is in ``state_dict``
    and ``named_parameters`` but no dense ``torch.optim`` optimizer touches it; it is trained by a
    sparse optimizer from :mod:`hetero.optim`.

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

    group: TableGroup
    group_row: int  # this table's first row in its group's storage
    hetero_target = Target.HOST  # the lookup is a host op: the placement system keeps it there

    def __init__(self, config: TableConfig) -> None:
        super().__init__()
        self.config = config
        # One draw from the global RNG seeds this table's rows (see init_rows): any subset of the
        # rows can then be initialised alone - a parameter server builds only its shard - and
        # the global random stream advances the same whether or not the rows are built here.
        self.init_seed = int(torch.randint(0, 1 << 62, (1,)))
        shape = (config.num_rows, config.embedding_dim)
        # a dynamic table's keys -> rows; its rows start as zeros (each is a key's from admission on:
        # KeyMap.init_rows), but for the last, the default row. Deferred: the servers hold the maps.
        self.keymap = KeyMap(config.name, config.num_embeddings, config.dynamic, self.init_seed) \
            if config.keys is Keys.DYNAMIC and not _DEFERRED[0] else None
        self.key_first = 0  # the table row of the key map's row 0 (a row-sharded table: its span's first)
        self.key_shard: KeyShard | None = None  # a row-sharded table's part here (hetero.dynamic.sharding)
        if _DEFERRED[0] or config.storage is StorageTier.SSD:
            # no memory: the rows live on parameter servers, or on the SSD tier (the group lays them out)
            weight = torch.empty(shape, dtype=config.dtype, device="meta")
        else:
            try:
                weight = host_empty(shape, config.dtype)
            except (OSError, RuntimeError, MemoryError) as e:  # ENOMEM from mmap, torch's allocator's error
                nbytes = config.num_rows * config.embedding_dim * torch.empty((), dtype=config.dtype).element_size()
                raise MemoryError(f"table {config.name!r} of {config.num_rows} rows x {config.embedding_dim} "
                                  f"({nbytes / 2**30:.1f} GiB) does not fit in host memory ({type(e).__name__}): "
                                  f"give a smaller embedding_dim or hash_buckets, or keep it on the SSD tier "
                                  f"(--table-storage ssd)") from None
            for lo in range(0, config.num_rows, INIT_CHUNK):
                hi = min(lo + INIT_CHUNK, config.num_rows)
                weight[lo:hi] = init_rows(config, self.init_seed, lo, hi)
        self.weight = nn.Parameter(weight, requires_grad=False)
        # Zero-size probe that follows .to()/.cuda()/.half(): it records where and in which dtype
        # the rest of the model lives, i.e. where the looked-up rows must be delivered.
        self.register_buffer("_device_anchor", torch.empty(0), persistent=False)
        TableGroup([self])  # a group of one until a collection merges it

    @property
    def name(self) -> str:
        return self.config.name

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001 - nn.Module's signature
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.keymap is not None:  # a dynamic table's key map, and its clock: the group's optimizer steps
            # (row-sharded: views of this rank's part; a checkpoint holds the whole, gathered by hetero.parallel)
            for name, value in self.keymap.state_dict(copy=self.key_shard is None).items():
                destination[f"{prefix}keymap.{name}"] = torch.from_numpy(value)
            destination[f"{prefix}keymap.step"] = torch.tensor(self.group.dynamic.steps_taken)
        if self.group.ssd_here:  # the rows, not the meta placeholder (read whole: tables that fit)
            del destination[prefix + "weight"]
            if not self.group.rows_in_state_dict:  # (a checkpoint holds them as the tier's snapshots)
                return
            rows = self.group.ssd_read(self.group.local_start(self), self.weight.shape[0], ("weight",))["weight"]
            destination[prefix + "weight"] = rows

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):  # noqa: ANN001 - nn.Module's signature
        if self.keymap is not None:
            self.load_keymap(state_dict, prefix, missing_keys)
        key = prefix + "weight"
        if self.config.storage is StorageTier.SSD and not self.group.rows_in_state_dict:
            return None  # (the rows come from the tier's snapshots)
        if self.config.storage is not StorageTier.SSD or key not in state_dict:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        rows = state_dict[key]
        shape = tuple(self.weight.shape)  # (the rows here: a row-sharded table's part)
        if tuple(rows.shape) != shape:
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(rows.shape)}, the table "
                              f"{self.name!r} has {shape}")
            return None
        self.group.ssd_assign("weight", self.group.local_start(self), rows)
        return None

    def load_keymap(self, state_dict: dict[str, Tensor], prefix: str, missing_keys: list[str]) -> None:
        """Take a dynamic table's key map out of ``state_dict`` (``<prefix>keymap.*``, what
        :meth:`_save_to_state_dict` put there) and restore it, or add its keys to ``missing_keys``."""
        names = [*self.keymap.STATE, "step"]
        found = {n: state_dict.pop(f"{prefix}keymap.{n}") for n in names if f"{prefix}keymap.{n}" in state_dict}
        if len(found) < len(names):
            missing_keys.extend(f"{prefix}keymap.{n}" for n in names if n not in found)
            return
        self.keymap.load_state_dict({n: found[n].numpy() for n in self.keymap.STATE})
        self.group.dynamic.steps_taken = int(found["step"])

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

    def rows_of(self, keys: Tensor) -> Tensor:
        """The rows of a dynamic table's ``keys`` (``(N,)`` int64, host) as ``(N,)`` int64 rows of its
        weight (the default row, ``num_embeddings``, for a key without one). A training lookup (the
        module in training mode, gradients enabled) admits and evicts (:meth:`KeyMap.translate`);
        a new key's row gets its initial value, and its optimizer state is reset at the next step
        (:meth:`TableGroup.reset_rows`). Any other lookup changes nothing.

        Replicated over data-parallel ranks, a training lookup translates every rank's keys
        (``DynamicRows.gather``); row-sharded, each key goes to the rank that owns it
        (``DynamicRows.route``): both are collectives."""
        return self.group.dynamic.rows_of([(self, keys)])[0]

    def own_rows(self, keys: Tensor, training: bool) -> Tensor:
        """:meth:`rows_of` by this process's key map alone: the keys it owns (all of them, unless
        row-sharded), as rows of the table (``(N,)`` int64)."""
        if not training:
            rows = self.keymap.lookup(keys.numpy())
        else:
            rows, new = self.keymap.translate(keys.numpy(), self.group.dynamic.steps_taken)
            if new.rows.shape[0]:
                values = self.keymap.init_rows(new.keys, self.config.embedding_dim, self.config.init_std)
                self.group.reset_rows(torch.from_numpy(self.group_row + self.key_first + new.rows),
                                      torch.from_numpy(values))
        capacity = self.config.num_embeddings
        if self.keymap.capacity != capacity:  # a row-sharded table's span: its map's rows, then the default row
            rows = np.where(rows < self.keymap.capacity, rows + self.key_first, capacity)
        return torch.from_numpy(rows)

    def raise_out_of_range(self, bad: int) -> None:
        vocab = self.config.num_embeddings
        raise IndexError(
            f"table {self.name!r}: id {bad} is out of range for vocab size {vocab} "
            f"(valid ids are 0..{vocab - 1}); fix the feature encoding or set hashed=True "
            f"on this table to hash ids into range"
        )

    def forward(self, ids: Tensor, offsets: Tensor | None = None) -> Tensor:
        return self.group.lookup([Request(self, ids, offsets)])[0]

    def pop_sparse_grad(self) -> SparseGrad | None:
        """Take the group's sparse gradient accumulated since the last call (``None`` if none).

        Its ids are group rows (``RowSpace.GROUP``): for a table in a multi-table group, offset by
        the table's ``group_row``.
        """
        return self.group.pop_sparse_grad()

    def zero_grad_sparse(self) -> None:
        self.group.pending.clear()


class DeviceEmbedding(nn.Module):
    """A table moved to the device (a plan's choice when it fits and looks up faster there):
    torch's ``embedding`` / ``embedding_bag`` with sparse gradients, trained by one of torch's
    sparse optimizers (:func:`hetero.optim.device_sparse_optimizer`). The same inputs, outputs
    and errors as :class:`HostEmbedding` (ids on any device are moved to the table's).

    Args:
        config: the table's configuration (fp32 tables only: torch's sparse optimizers keep
            their state in the weight's dtype, the host's in fp32).
        weight: its rows, ``(num_embeddings, embedding_dim)`` float32, on the device (kept,
            not copied).

    Raises:
        ValueError: a table of another dtype or a weight of another shape.
    """

    hetero_target = Target.DEVICE  # a leaf of the partitioner's trace (its id check reads values), on the device

    def __init__(self, config: TableConfig, weight: Tensor) -> None:
        super().__init__()
        shape = (config.num_embeddings, config.embedding_dim)
        if config.dtype is not torch.float32 or tuple(weight.shape) != shape:
            raise ValueError(f"table {config.name!r}: a device table is float32 of shape {shape}, got "
                             f"{config.dtype} rows of shape {tuple(weight.shape)}; keep it on the host")
        self.config = config
        self.weight = nn.Parameter(weight)

    @staticmethod
    def from_host(table: HostEmbedding, device: torch.device) -> "DeviceEmbedding":
        """``table``'s rows copied to ``device`` (one host->device copy of the whole table).

        Raises:
            ValueError: a table on the SSD tier (it stays there: it may not fit anywhere else).
        """
        if table.config.keys is Keys.DYNAMIC:
            raise ValueError(f"table {table.name!r} is dynamic: its key map is the host's; keep it on the host")
        if table.config.storage is StorageTier.SSD:
            raise ValueError(f"table {table.name!r} is on the SSD tier: it stays on the host; keep it there, or put it "
                             f"in memory (storage=StorageTier.HOST_DRAM) to move it to the device")
        return DeviceEmbedding(table.config, table.weight.detach().to(device, torch.float32, copy=True))

    @property
    def name(self) -> str:
        return self.config.name

    def extra_repr(self) -> str:
        c = self.config
        return f"{c.name!r}, {c.num_embeddings}, {c.embedding_dim}, pooling={c.pooling.value}, device-resident"

    def forward(self, ids: Tensor, offsets: Tensor | None = None) -> Tensor:
        c, w = self.config, self.weight
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"table {c.name!r}: ids must be int64 or int32, got {ids.dtype}")
        ids = ids.to(w.device, torch.int64)
        if c.hashed:
            ids = ids.remainder(c.num_embeddings)  # floor semantics, as the host's hashing
        else:
            bad = ids[(ids < 0) | (ids >= c.num_embeddings)]
            if bad.numel():  # sync point: the check reads the ids on the host
                raise IndexError(f"table {c.name!r}: id {int(bad[0])} is out of range for vocab size "
                                 f"{c.num_embeddings} (valid ids are 0..{c.num_embeddings - 1}); fix the feature "
                                 f"encoding or set hashed=True on this table to hash ids into range")
        if c.pooling is Pooling.NONE:
            if offsets is not None:
                raise ValueError(f"table {c.name!r}: offsets given but pooling is 'none'; use SUM or MEAN")
            return F.embedding(ids, w, sparse=True)
        if offsets is None and ids.dim() != 2:
            raise ValueError(f"table {c.name!r}: pooled lookup without offsets needs 2-D ids (B, L), "
                             f"got {tuple(ids.shape)}")
        if offsets is not None:
            offsets = offsets.to(w.device, torch.int64)
            if offsets.dim() != 1 or not len(offsets) or int(offsets[0]) != 0 or int(offsets[-1]) != len(ids):
                raise ValueError(f"table {c.name!r}: offsets must be 1-D of length B + 1 with offsets[0] == 0 and "
                                 f"offsets[-1] == len(ids) == {len(ids)}, got {offsets.tolist()[:8]}")
        return F.embedding_bag(ids, w, offsets, mode=c.pooling.value, sparse=True,
                               include_last_offset=offsets is not None)


def device_tables(module: nn.Module) -> dict[str, DeviceEmbedding]:
    """All device tables in ``module`` by qualified name."""
    return {name: m for name, m in module.named_modules() if isinstance(m, DeviceEmbedding)}


def host_tables(module: nn.Module) -> dict[str, HostEmbedding]:
    """All host tables in ``module`` by qualified name (stable keys for optimizers and checkpoints)."""
    return {name: m for name, m in module.named_modules() if isinstance(m, HostEmbedding)}


def table_groups(module: nn.Module) -> dict[str, TableGroup]:
    """The table groups of ``module`` in model order, keyed by their tables' qualified names
    (comma-joined): the stable key of a group's storage in checkpoints and parameter servers."""
    tables = host_tables(module)
    names = {t: q for q, t in tables.items()}  # modules hash by identity
    out: dict[str, TableGroup] = {}
    for t in tables.values():
        out.setdefault(",".join(names[x] for x in t.group.tables), t.group)
    return out


def dense_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """Trainable parameters of ``module`` that are not tables (host or device): what a dense
    optimizer takes."""
    tables = {t.weight for t in [*host_tables(module).values(), *device_tables(module).values()]}  # (by identity)
    return (p for p in module.parameters() if p.requires_grad and p not in tables)
