"""Distributed checkpoints of a model's whole state: DTensor-sharded (operator-parallel)
parameters, host tables (replicated, row-sharded or on parameter servers) and their sparse
optimizers' per-row state, in one DCP layout that any world size and layout loads.

Layout (shared with the trainer's ``checkpoint.dcp``, :mod:`hetero.train.checkpointing`):

* ``tables.<group>``: per table group (``<group>``: its tables' qualified names, comma-joined)
  the ``weight`` storage and each sparse optimizer's state as ``<optimizer>.<state>``; a
  ``DTensor`` of row blocks for a row-sharded group, a plain tensor otherwise;
* ``model``: every other entry of ``model.state_dict()`` (DTensors: each rank writes its shards);
* ``optim``: a dense optimizer's state keyed by parameter name (torch's
  ``get_optimizer_state_dict``), when one is given;
* ``extra``: a ``torch.save`` blob with the table ``layout`` and each sparse optimizer's
  configuration and step counts (the trainer adds its run state).

DCP reshards on load: what 4 ranks wrote as 2 data x 2 operator-parallel loads into 1 rank, or
into 2 operator-parallel ranks. A pipeline stage (:mod:`hetero.parallel.pipeline`) keeps the
whole model's names, so each stage's rank writes its part of ``model`` and ``optim`` and any
pipeline degree loads them (each stage reads its names). Reference: ``torch.distributed.checkpoint``; the reference
design's ``load_distributed_checkpoint``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Placement

from hetero.embedding import RowPlacement, host_tables, table_groups
from hetero.embedding.group import TableGroup
from hetero.optim import SparseOptimizer
from hetero.parallel.env import active, host_group, rank, world_size
from hetero.parallel.operator_plan import first_difference, infer_predict_layout
from hetero.parallel.sharded_keys import load_rank_keymap, rank_keymap_state, sharded_keymaps
from hetero.checkpoint.sharded import save_sharded, load_sharded, read_bytes
from hetero.checkpoint.io import CheckpointError


def _mesh():  # noqa: ANN202 - a DeviceMesh over the host group
    from torch.distributed.device_mesh import DeviceMesh

    group = host_group()
    if group is None:
        group = torch.distributed.group.WORLD
    return DeviceMesh.from_group(group, "cpu")


def _wrap(x: torch.Tensor, group: TableGroup, mesh) -> torch.Tensor:  # noqa: ANN001 - a DeviceMesh
    """A row-sharded group's local block as a DTensor (no copy: loads write into ``x``)."""
    if group.exchange.placement is not RowPlacement.ROW_SHARDED:
        return x
    from torch.distributed.tensor import DTensor, Shard

    shape = (group.exchange.global_rows, *x.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(x, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)


def model_state(model: nn.Module, sparse_optimizers: Mapping[str, SparseOptimizer]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``tables`` and ``model`` parts of the layout (live tensors: a load fills them in
    place) and the table ``layout`` record (which table is where in which group)."""
    tables = host_tables(model)
    table_keys = {f"{q}.weight" for q in tables}
    mesh = _mesh() if active() and any(t.group.exchange.placement is RowPlacement.ROW_SHARDED
                                       for t in tables.values()) else None
    names = {t: q for q, t in tables.items()}  # modules hash by identity
    out_tables, keys, layout = {}, {}, {"groups": {}, "sparse": {}, "ps": {}, "keys": {}}
    for key, group in table_groups(model).items():
        layout["groups"][key] = [(names[t], t.group_row, t.config.num_rows) for t in group.tables]
        if group.exchange.placement is RowPlacement.PARAMETER_SERVER:  # the servers write these rows
            layout["ps"][key] = len(group.exchange.servers)
            if group.ssd_config is not None:  # each server's shard as the tier's snapshot (hetero.ps.server)
                layout.setdefault("ps_tier", {})[key] = group.ssd_name
            continue
        for t in group.tables:  # a row-sharded dynamic table's map: each rank's part (hetero.parallel.sharded_keys)
            if t.key_shard is not None:
                keys[names[t]] = {f"rank{rank()}": rank_keymap_state(t)}
                layout["keys"][names[t]] = world_size()
        entry = {"weight": _wrap(group.storage, group, mesh)}
        for opt_key, opt in sparse_optimizers.items():
            for s, x in opt.group_state.get(group, {}).items():
                entry[f"{opt_key}.{s}"] = _wrap(x, group, mesh)
        out_tables[key] = entry
    for opt_key, opt in sparse_optimizers.items():
        layout["sparse"][opt_key] = {name: names[t] for name, t in opt.tables.items()}
    # tables first: a table that does not fit is the first error reported
    own = tuple(f"{q}.keymap." for q in keys)  # (the ranks' parts: in "keys")
    state = {"tables": out_tables, "model": {k: v for k, v in model.state_dict().items()
                                             if k not in table_keys and not k.startswith(own)}}
    return {**state, "keys": keys} if keys else state, layout


def check_key_ranks(model: nn.Module, layout: Mapping[str, Any], path: str | Path) -> None:
    """Refuse a sharded checkpoint whose row-sharded dynamic tables' maps this model cannot take
    as saved: saved at another world size, or saved row-sharded and loaded not (or the reverse).
    Each rank's own check, before anything loads.

    Raises:
        CheckpointError: naming the tables, the world sizes and the fix.
    """
    saved = dict(layout.get("keys", {}))
    here = {q: world_size() for q in sharded_keymaps(model)}
    dynamic = {q for q, t in host_tables(model).items() if t.keymap is not None}
    if {q: n for q, n in saved.items() if q in dynamic} != {q: n for q, n in here.items()}:
        raise CheckpointError(
            f"checkpoint {path} holds the key maps of dynamic tables {sorted(saved) or sorted(here)} row-sharded over "
            f"{sorted(set(saved.values())) or 'no'} ranks, this run shards them over {sorted(set(here.values())) or 'no'}: "
            f"resume as they were saved, or merge the checkpoint (hetero checkpoint merge CKPT checkpoint.pt) and "
            f"resume from that integrated checkpoint (--checkpoint-format integrated), which moves keys to their owners")


def restore_keymaps(model: nn.Module, state: Mapping[str, Any], path: str | Path) -> None:
    """Restore ``model``'s dynamic tables' key maps from a loaded sharded checkpoint ``state``:
    from its ``model`` part (``<table>.keymap.*``: loaded into copies of the maps, which a load in
    place does not reach), a row-sharded table's from this rank's part of ``keys``
    (parameter-server workers hold no maps).

    Raises:
        CheckpointError: a map missing from ``entries``, naming it.
    """
    missing: list[str] = []
    for name, t in host_tables(model).items():
        if t.key_shard is not None:  # (row-sharded: this rank's own part, check_key_ranks checked)
            load_rank_keymap(t, state["keys"][name][f"rank{rank()}"])
        elif t.keymap is not None:
            t.load_keymap(dict(state["model"]), f"{name}.", missing)
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks the key maps {missing}; it was saved by another model")


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    # flattened: one key per parameter and value ("state.<name>.exp_avg", "param_groups.<name>.lr"),
    # so ranks holding different parameters (pipeline stages) write and read disjoint keys;
    # an empty state is initialised first (a template to load into)
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))


def save_distributed_checkpoint(model: nn.Module, path: str | Path,
                                sparse_optimizers: Mapping[str, SparseOptimizer] | None = None,
                                optimizer: torch.optim.Optimizer | None = None) -> Path:
    """Write ``model``'s state - DTensor shards, host tables - ``sparse_optimizers``' state and
    a dense ``optimizer``'s as one sharded DCP checkpoint (every rank writes its shards; atomic,
    with checksums: :func:`hetero.checkpoint.sharded.save_sharded`). Collective."""

    sparse = dict(sparse_optimizers or {})
    state, layout = model_state(model, sparse)
    if optimizer is not None:
        state["optim"] = _optimizer_state(model, optimizer)
    blob = io.BytesIO()
    torch.save({"layout": layout, "sparse_optimizers": {k: o.state_dict(include_state=False) for k, o in sparse.items()}},
               blob)
    return save_sharded({**state, "extra": blob}, path)


def load_distributed_checkpoint(model: nn.Module, path: str | Path, layout: dict[str, list[Placement]] | None = None,
                                sparse_optimizers: Mapping[str, SparseOptimizer] | None = None,
                                optimizer: torch.optim.Optimizer | None = None) -> Path:
    """Load a checkpoint of :func:`save_distributed_checkpoint` (or the trainer's sharded one),
    saved at any world size and layout, into ``model`` as it is sharded now, with its host
    tables and, given ``sparse_optimizers``, their per-row state and step counts, and given
    ``optimizer``, its state (by parameter name: the parameters this model holds). With
    ``layout`` (from :func:`~hetero.parallel.operator_plan.infer_predict_layout`) the model's
    layout is checked first. Collective.

    Raises:
        ValueError: ``model``'s layout differs from ``layout`` (naming the first parameter).
        hetero.checkpoint.CheckpointError: a missing, corrupted or other-model checkpoint, or a
            sparse optimizer it does not hold; nothing is loaded then.
    """

    diff = None if layout is None else first_difference(layout, infer_predict_layout(model))
    if diff is not None:
        name, a, b = diff
        raise ValueError(f"model's layout differs from the predict layout at {name!r}: {a} asked, {b} in the model")
    sparse = dict(sparse_optimizers or {})
    saved = {}
    if sparse:  # checked before anything loads; read by each rank alone (no collective)
        blob = read_bytes(path, "extra")
        blob.seek(0)
        saved = torch.load(blob, map_location="cpu", weights_only=True)["sparse_optimizers"]
        for k, opt in sparse.items():
            if k not in saved:
                raise CheckpointError(f"checkpoint {path} has no sparse optimizer {k!r}; it holds {sorted(saved)}")
            try:
                opt.check_state_dict(saved[k])
            except ValueError as e:
                raise CheckpointError(f"checkpoint {path}, sparse optimizer {k!r}: {e}") from e
    blob = read_bytes(path, "extra")
    blob.seek(0)
    check_key_ranks(model, torch.load(blob, map_location="cpu", weights_only=True)["layout"], path)
    state, _ = model_state(model, sparse)
    if optimizer is not None:
        state["optim"] = _optimizer_state(model, optimizer)  # the template the load fills
    path = load_sharded(state, path)
    restore_keymaps(model, state, path)
    if optimizer is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state["optim"],
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))
    for k, opt in sparse.items():
        opt.load_state_dict(saved[k])  # configuration and step counts; the rows were loaded in place
    return path
