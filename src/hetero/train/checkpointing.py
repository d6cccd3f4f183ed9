"""The trainer's checkpoint layouts: integrated (one file) and sharded (a DCP directory).

Integrated (``checkpoint.pt``, :func:`hetero.checkpoint.save_checkpoint`): every tensor whole -
row-sharded tables are gathered first - written by rank 0. What inference loads.

Sharded (``checkpoint.dcp``, :mod:`hetero.checkpoint.sharded`): one DCP directory, each rank
writing its part:

* ``model``: the dense parameters and buffers (replicated: written once);
* ``tables.<group>``: per table group (``<group>`` = its tables' qualified names, comma-joined)
  the ``weight`` storage and every sparse optimizer state as ``<optimizer>.<state>``, each a
  ``DTensor`` of row blocks when the group is row-sharded, else a plain (replicated) tensor;
  stored per group in every layout, so a checkpoint of sharded tables loads into replicated ones
  and back, at any world size;
* ``ps.<group>.shard<s>`` and ``ps_meta.shard<s>`` instead of ``tables.<group>`` in a
  parameter-server job (:mod:`hetero.ps`): server ``s`` writes its hash shard of the rows and
  state, and a blob with the step counts (a group on the SSD tier: its shard as the tier's
  snapshot in ``ps-tier/``, :mod:`hetero.ps.server`), and ``ps_keys.<group>.shard<s>`` its
  dynamic tables' key maps (:mod:`hetero.ps.keys`); such a checkpoint resumes with the same
  number of servers (any number of workers);
* ``extra``: the rest as one ``torch.save`` blob (``io.BytesIO``): data position, RNG, loss
  history, dense optimizer state, sparse optimizer configs and step counts, and the layout of
  the groups (for :func:`to_integrated`).

:func:`to_integrated` turns a sharded checkpoint read whole into the integrated layout; the CLI's
``hetero checkpoint merge`` writes it, bit for bit what an integrated save at the same step holds.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hetero.checkpoint.io import CheckpointError
from hetero.parallel.env import DataParallelGroup
from hetero.parallel.checkpoint_state import model_state
from hetero.parallel.sharded_keys import whole_keymap_of_ranks
from hetero.parallel.tree_comm import gather_tree
from hetero.ps.keys import whole_keymaps
from hetero.optim.container import OptimizersContainer
from hetero.ps.server import PS_TIER
from hetero.storage.snapshot import read_fields


class Checkpointed(Protocol):
    """What a sharded checkpoint reads of a trainer (:class:`hetero.train.trainer.Trainer`)."""

    model: torch.nn.Module
    optimizers: OptimizersContainer  # its sparse optimizers' state goes into the tables' entries
    dp: DataParallelGroup  # the data-parallel ranks it trains on

    def state_dict(self, tables: bool = True) -> dict[str, Any]: ...


def sharded_state(trainer: Checkpointed, blob: bool = True) -> dict[str, Any]:
    """The state :func:`hetero.checkpoint.sharded.save_sharded` writes; with ``blob=False``, the
    template :func:`~hetero.checkpoint.sharded.load_sharded` fills (tensors are live: in place)."""
    tables, layout = model_state(trainer.model, trainer.optimizers.sparse)
    state: dict[str, Any] = {**tables, "extra": io.BytesIO()}
    if blob:
        extra = {k: v for k, v in trainer.state_dict(tables=False).items()}
        extra["layout"] = layout
        extra["saved_world_size"] = trainer.dp.size
        torch.save(extra, state["extra"])
    return state


def read_extra(state: Mapping[str, Any]) -> dict[str, Any]:
    """The blob of a loaded sharded state."""
    buf = state["extra"]
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)


def _interleave(shards: Mapping[str, Any], servers: int) -> dict[str, torch.Tensor]:
    """A group's tensors whole from its parameter-server shards (global row ``g`` is row
    ``g // servers`` of shard ``g % servers``)."""
    out = {}
    for name in shards["shard0"]:
        parts = [shards[f"shard{s}"][name] for s in range(servers)]
        whole = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype)
        for s, p in enumerate(parts):
            whole[s::servers] = p
        out[name] = whole
    return out


def _tier_shards(directory: Path, key: str, name: str, servers: int, layout: Mapping[str, Any]) -> dict[str, Any]:
    """A group's parameter-server shards from their SSD tier snapshots in the checkpoint
    ``directory`` (read whole: tables that fit in memory), named as the DCP's shards are."""
    tables = {q for q, _, _ in layout["groups"][key]}
    owner = next((o for o, names in layout["sparse"].items() if tables & set(names.values())), None)
    shards = {}
    for s in range(servers):
        fields = read_fields(directory / PS_TIER / f"shard{s}of{servers}" / name)
        shards[f"shard{s}"] = {("weight" if f == "weight" else f"{owner}.{f}"): v for f, v in fields.items()}
    return shards


def to_integrated(full: Mapping[str, Any], directory: Path | None = None) -> dict[str, Any]:
    """A sharded checkpoint read whole (:func:`~hetero.checkpoint.sharded.read_full`) in the
    integrated layout: per-table weights in ``model``, per-table state in each sparse optimizer;
    ``directory``: the checkpoint's (for the parameter servers' SSD tier snapshots).

    Raises:
        CheckpointError: a parameter server's SSD tier snapshot missing or damaged, naming it.
    """
    extra = read_extra(full)
    layout = extra.pop("layout")
    extra.pop("saved_world_size", None)  # the trainer's; hetero.parallel.save_distributed_checkpoint has none
    model = dict(full["model"])
    tables = dict(full.get("tables", {}))
    steps = {}
    for key, servers in layout.get("ps", {}).items():
        name = layout.get("ps_tier", {}).get(key)
        if name is not None and directory is None:
            raise CheckpointError(f"tables {key} were on the parameter servers' SSD tier: give the checkpoint's directory")
        shards = _tier_shards(directory, key, name, servers, layout) if name is not None else full["ps"][key]
        tables[key] = _interleave(shards, servers)
        if key in full.get("ps_keys", {}):  # the servers' key maps of its dynamic tables, whole
            model.update(whole_keymaps(full["ps_keys"][key], servers, layout["groups"][key]))
        steps = read_extra({"extra": full["ps_meta"]["shard0"]})["sparse_optimizers"]  # the servers count the steps
    for q, ranks in layout.get("keys", {}).items():  # row-sharded dynamic tables' maps: each rank's part
        model.update(whole_keymap_of_ranks(q, [full["keys"][q][f"rank{r}"] for r in range(ranks)]))
    where: dict[str, tuple[str, int, int]] = {}
    for key, entries in layout["groups"].items():
        for q, start, rows in entries:
            where[q] = (key, start, rows)
            model[f"{q}.weight"] = tables[key]["weight"][start : start + rows]
    sparse = {}
    for opt_key, saved in extra["sparse_optimizers"].items():
        state = {}
        for name, q in layout["sparse"][opt_key].items():
            key, start, rows = where[q]
            prefix = f"{opt_key}."
            state[name] = {k[len(prefix):]: v[start : start + rows] for k, v in tables[key].items() if k.startswith(prefix)}
        sparse[opt_key] = {**saved, **({"steps": steps[opt_key]["steps"]} if opt_key in steps else {}), "state": state}
    return {**extra, "model": model, "sparse_optimizers": sparse}


# --------------------------------------------------------------------------- pipelined jobs
# A pipelined trainer (one stage per rank, stage k on pp rank k) holds part of the model and of
# the dense optimizer; its integrated checkpoint is still the whole model's, as an unpipelined
# run writes it, so it resumes at any pipeline degree. Stages hold contiguous units and the
# model's own parameters go with stage 0, so the stages' dense parameters in pp-rank order are
# the whole model's in its order: optimizer indices concatenate.


def _every_stage(group: dist.ProcessGroup, part: Any, dst: int | None = None) -> list[Any] | None:
    """``part`` of every pp rank, in pp-rank order, on every pp rank (or on pp rank ``dst`` alone,
    ``None`` elsewhere): a collective, the structure pickled, the tensors sent as tensors and
    returned on the host; never pickled (see :mod:`hetero.parallel.tree_comm`)."""
    return gather_tree(part, group, dst)


def whole_model_state(group: dist.ProcessGroup, stage_state: Mapping[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor] | None:
    """The whole model's state from every stage's (name-keyed, disjoint), on pp rank 0 (the
    checkpoint's writer); ``None`` on the other pp ranks, which never hold the whole model."""
    parts = _every_stage(group, dict(stage_state), dst=0)
    return None if parts is None else {k: v for part in parts for k, v in part.items()}


def whole_model_shapes(group: dist.ProcessGroup, stage_shapes: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole model's parameter shapes (meta tensors) from every stage's."""
    parts = _every_stage(group, {k: tuple(v.shape) for k, v in stage_shapes.items()})
    return {k: torch.empty(shape, device="meta") for part in parts for k, shape in part.items()}


def whole_optimizer_state(group: dist.ProcessGroup, state: Mapping[str, Any]) -> dict[str, Any] | None:
    """On pp rank 0 (``None`` on the others, as :func:`whole_model_state`), a torch optimizer
    state dict over the whole model from every stage's: group ``g`` holds
    every stage's group ``g`` in stage order (hyper-parameters: stage 0's), numbered as torch
    numbers an unpipelined optimizer's parameters (in order, across the groups).

    Raises:
        ValueError: stages whose optimizers have different numbers of parameter groups.
    """
    parts = _every_stage(group, state, dst=0)
    if parts is None:
        return None
    groups = [dict(g, params=[]) for g in parts[0]["param_groups"]]
    merged: dict[int, Any] = {}
    for g, whole in enumerate(groups):
        for part in parts:
            if len(part["param_groups"]) != len(groups):
                raise ValueError(f"pipeline stages' dense optimizers have {len(groups)} and {len(part['param_groups'])} "
                                 f"parameter groups: build every stage's optimizer with the same groups")
            for old in part["param_groups"][g]["params"]:
                new = sum(len(x["params"]) for x in groups)
                whole["params"].append(new)
                if old in part["state"]:
                    merged[new] = part["state"][old]
    return {"state": merged, "param_groups": groups}


def stage_optimizer_state(group: dist.ProcessGroup, whole: Mapping[str, Any], mine: Mapping[str, Any]) -> dict[str, Any]:
    """This stage's part of a whole model's optimizer state dict ``whole`` (from
    :func:`whole_optimizer_state` or an unpipelined run), numbered as its own state dict ``mine``;
    a collective (the stages' parameter counts).

    Raises:
        ValueError: ``whole`` has other parameter groups or counts than the stages together.
    """
    counts = _every_stage(group, [len(g["params"]) for g in mine["param_groups"]])
    me = dist.get_rank(group)
    wanted = [sum(c[g] for c in counts) for g in range(len(counts[me]))]
    if [len(g["params"]) for g in whole["param_groups"]] != wanted:
        raise ValueError(f"the checkpoint's dense optimizer has parameter groups of "
                         f"{[len(g['params']) for g in whole['param_groups']]} parameters; the pipeline's stages "
                         f"together have {wanted}")
    groups, state = [], {}
    for g, (wg, pg) in enumerate(zip(whole["param_groups"], mine["param_groups"])):
        start = sum(c[g] for c in counts[:me])  # the stages before hold the group's first parameters
        ids = wg["params"][start:start + counts[me][g]]
        groups.append(dict(wg, params=list(pg["params"])))
        state.update({new: whole["state"][old] for old, new in zip(ids, pg["params"]) if old in whole["state"]})
    return {"state": state, "param_groups": groups}
