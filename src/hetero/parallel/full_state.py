"""A model's and its optimizers' state gathered whole, and a whole state cut back to this rank's
part: the integrated checkpoint's layout, which any world size and layout loads (row-sharded host
tables, a row-sharded dynamic table's key map, DTensor parameters and their optimizer state, ZeRO's
partitions)."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hetero.embedding.group import TableGroup
from hetero.parallel.operator import to_dtensor
from hetero.parallel.row_sharded import gather_rows, local_table_rows, sharded_tables, table_rows
from hetero.parallel.sharded_keys import KEYMAP_ROWS, full_keymap_state, local_keymap_state, sharded_keymaps
from hetero.parallel.tree_comm import broadcast_tree


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every row-sharded table and every DTensor (operator-parallel)
    parameter gathered whole (collectives: every rank calls it)."""
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    done: dict[TableGroup, torch.Tensor] = {}  # groups hash by identity
    for name, t in sharded_tables(model).items():
        g = t.group
        if not g.rows_in_state_dict:  # (the SSD tier's snapshots hold them)
            continue
        if g not in done:
            done[g] = gather_rows(g.local_weight(), g.exchange.global_rows)
        state[f"{name}.weight"] = table_rows(t, done[g])
    keyed = sharded_keymaps(model)
    for name in keyed:  # (this rank's part of a row-sharded dynamic table's key map: gone before the whole comes)
        for k in [k for k in state if k.startswith(f"{name}.keymap.")]:
            del state[k]
    for name, t in keyed.items():
        state.update(full_keymap_state(name, t))
    return state


def local_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full model state (from :func:`full_model_state`, any world size and layout) cut to this
    rank's rows and to the shards of its DTensor parameters (local slices, no communication).
    A row-sharded dynamic table's keys are given their rows at this world size first
    (:func:`~hetero.parallel.sharded_keys.local_keymap_state`)."""
    state = dict(state)
    for name, t in sharded_keymaps(model).items():
        local_keymap_state(name, t, state)
    for key, v in model.state_dict().items():
        if isinstance(v, DTensor) and key in state:
            state[key] = to_dtensor(state[key], v.device_mesh, v.placements)
    for name, t in sharded_tables(model).items():
        key = f"{name}.weight"
        if key in state:
            state[key] = local_table_rows(t, state[key])
    return state


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with the state of DTensor (operator-parallel) parameters
    gathered whole (collectives: every rank calls it); the same on every rank."""
    # ZeRO stage 1 (hetero.parallel.zero): its module is loaded if such an optimizer exists (importing
    # it otherwise would load torch.distributed.optim's TorchScript machinery for nothing)
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):  # each rank holds its partition
        optimizer.consolidate_state_dict(to=0)  # collective over its group
        group = optimizer.process_group
        # every rank gets the same whole state (tensors as tensors: pickling one writes its whole storage)
        return broadcast_tree(optimizer.state_dict() if dist.get_rank(group) == 0 else None, 0, group)
    sd = optimizer.state_dict()
    sd["state"] = {i: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in st.items()}
                   for i, st in sd["state"].items()}
    return sd


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a :func:`full_optimizer_state` (any world size and layout) into ``optimizer``: the
    state of a DTensor parameter is cut to its shards first (a local slice); torch's own
    ``load_state_dict`` then checks the groups and casts to the parameters' devices."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {**state, "state": dict(state["state"])}
    for i, st in state["state"].items():
        p = params[i] if i < len(params) else None
        if isinstance(p, DTensor):
            state["state"][i] = {k: to_dtensor(v, p.device_mesh, p.placements) if isinstance(v, torch.Tensor)
                                 and v.shape == p.shape else v for k, v in st.items()}
    optimizer.load_state_dict(state)


def global_shapes(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with sharded tables replaced by meta tensors of their full shape
    (to check a checkpoint against the model without gathering)."""
    state = dict(model.state_dict())
    for name, t in sharded_tables(model).items():
        if t.group.rows_in_state_dict:
            state[f"{name}.weight"] = torch.empty(t.config.num_rows, t.config.embedding_dim, device="meta")
    for name, t in sharded_keymaps(model).items():
        for k in KEYMAP_ROWS:
            state[f"{name}.keymap.{k}"] = torch.empty(t.config.num_embeddings, dtype=state[f"{name}.keymap.{k}"].dtype,
                                                      device="meta")
    return state
