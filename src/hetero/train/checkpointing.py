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
  state, and a blob with the step counts; such a checkpoint resumes with the same number of
  servers (any number of workers);
* ``extra``: the rest as one ``torch.save`` blob (``io.BytesIO``): data position, RNG, loss
  history, dense optimizer state, sparse optimizer configs and step counts, and the layout of
  the groups (for :func:`to_integrated`).

:func:`to_integrated` turns a sharded checkpoint read whole into the integrated layout; the CLI's
``hetero checkpoint merge`` writes it, bit for bit what an integrated save at the same step holds.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from hetero.parallel import world_size
from hetero.parallel.checkpoint_state import model_state

if TYPE_CHECKING:
    from hetero.train.trainer import Trainer


def sharded_state(trainer: "Trainer", blob: bool = True) -> dict[str, Any]:
    """The state :func:`hetero.checkpoint.sharded.save_sharded` writes; with ``blob=False``, the
    template :func:`~hetero.checkpoint.sharded.load_sharded` fills (tensors are live: in place)."""
    tables, layout = model_state(trainer.model, trainer.sparse_optimizer_objects)
    state: dict[str, Any] = {**tables, "extra": io.BytesIO()}
    if blob:
        extra = {k: v for k, v in trainer.state_dict(tables=False).items()}
        extra["layout"] = layout
        extra["saved_world_size"] = world_size()
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


def to_integrated(full: Mapping[str, Any]) -> dict[str, Any]:
    """A sharded checkpoint read whole (:func:`~hetero.checkpoint.sharded.read_full`) in the
    integrated layout: per-table weights in ``model``, per-table state in each sparse optimizer."""
    extra = read_extra(full)
    layout = extra.pop("layout")
    extra.pop("saved_world_size", None)  # the trainer's; hetero.parallel.save_distributed_checkpoint has none
    model = dict(full["model"])
    tables = dict(full.get("tables", {}))
    steps = {}
    for key, servers in layout.get("ps", {}).items():
        tables[key] = _interleave(full["ps"][key], servers)
        steps = read_extra({"extra": full["ps_meta"]["shard0"]})["sparse_optimizers"]  # the servers count the steps
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
