"""The SSD tier's part of a training checkpoint: the rows of every table group on the tier, as
snapshots of its stores (:mod:`hetero.storage.snapshot`) beside the checkpoint file, never read
into memory.

Layout: ``RUN_DIR/tier/<checkpoint>-step<N>.<k>/rank<r>/<group>/`` - a replicated group is
snapshotted by rank 0 (every replica is the same), a row-sharded group by every rank (its
shard). The checkpoint file (``checkpoint.pt``) names its directory and, per group, how many
ranks' snapshots hold it; the groups' rows and optimizer state are left out of the file
(``TableGroup.rows_in_state_dict``). Order of a save, which makes it atomic and ``kill -9``
safe: every rank snapshots into a new directory (a name no earlier save used); the checkpoint file
is written atomically (:func:`hetero.checkpoint.save_checkpoint`); only then are the directories
of that checkpoint's earlier saves deleted. A crash leaves the last checkpoint file and the
directory it names intact; an unfinished directory is deleted by the next save.

A resume verifies every snapshot it needs (sizes and CRC-32s) before anything changes, then links
(or, at another world size, reads) them into the run's stores. Tables that fit in memory could be
checkpointed inside the file as well; tables on the tier are always checkpointed here, so that
what is written does not depend on a table's size.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torch import nn

from hetero.checkpoint import CheckpointError
from hetero.embedding import RowPlacement
from hetero.embedding.group import TableGroup
from hetero.embedding.table import table_groups
from hetero.storage import snapshot

TIER_DIR = "tier"


class TierCheckpoint:
    """The snapshots of ``model``'s table groups on the SSD tier for checkpoints in ``run_dir``
    (see the module docstring); ``rank`` of ``world`` ranks. Building it takes the groups' rows
    out of the state dicts. ``bool(self)``: whether the model has such groups."""

    def __init__(self, model: nn.Module, run_dir: Path, rank: int = 0, world: int = 1) -> None:
        tiered = {k: g for k, g in table_groups(model).items() if g.ssd_config is not None}
        for g in tiered.values():
            g.checkpoint_rows_apart()
        # (groups on parameter servers: each server's checkpoint holds its shard, hetero.ps.server)
        self.groups = {k: g for k, g in tiered.items() if g.exchange.placement is not RowPlacement.PARAMETER_SERVER}
        self.run_dir, self.rank, self.world = Path(run_dir), rank, world

    def __bool__(self) -> bool:
        return bool(self.groups)

    def _sharded(self, g: TableGroup) -> bool:
        return g.exchange.placement is RowPlacement.ROW_SHARDED

    def new_directory(self, checkpoint: Path, step: int) -> str:
        """The directory (relative to the run's) of a new save of ``checkpoint`` at ``step``: one
        no earlier save used. Every rank must get the same: call it before any rank writes (the
        caller then waits for all, :meth:`save`)."""
        k = 0
        while (self.run_dir / TIER_DIR / f"{checkpoint.stem}-step{step}.{k}").exists():
            k += 1
        return f"{TIER_DIR}/{checkpoint.stem}-step{step}.{k}"

    def save(self, directory: str) -> dict[str, Any]:
        """Snapshot this rank's part of every group into ``directory``; returns the checkpoint
        file's entry: the directory and, per group, its snapshots' name, number of parts (ranks)
        and tables (qualified name, rows; the group's rows in this order).

        Raises:
            OSError: a failed write, naming the file (the last checkpoint is intact).
        """
        groups = {}
        for key, g in self.groups.items():
            groups[key] = {"name": g.ssd_name, "parts": self.world if self._sharded(g) else 1,
                           "tables": [[q, t.config.num_rows] for q, t in zip(key.split(","), g.tables)]}
            if self._sharded(g) or self.rank == 0:
                g.ssd_checkpoint(self.run_dir / directory / f"rank{self.rank}" / g.ssd_name)
        return {"directory": directory, "groups": groups}

    def clean(self, checkpoint: Path, entry: dict[str, Any]) -> None:
        """Delete the directories of ``checkpoint``'s earlier (or unfinished) saves, after its new
        file (naming ``entry``) is in place; rank 0 alone."""
        keep = Path(entry["directory"]).name
        for d in (self.run_dir / TIER_DIR).glob(f"{checkpoint.stem}-step*"):
            if d.name != keep:
                shutil.rmtree(d, ignore_errors=True)

    def check(self, entry: dict[str, Any] | None, path: Path) -> dict[str, list[tuple[Path, dict]]]:
        """The snapshots (directory, verified manifest) of every group that this rank needs to
        restore from the checkpoint ``path`` whose entry is ``entry``; reads every file of them
        and changes nothing.

        Raises:
            CheckpointError: no entry for the model's groups on the tier, a group the checkpoint
                lacks, or a missing or damaged file (naming it).
        """
        if entry is not None and not self.groups:
            raise CheckpointError(f"checkpoint {path} holds tables on the SSD tier ({sorted(entry['groups'])}) and this "
                                  f"run has them in memory: resume with --table-storage ssd")
        if entry is None and not self.groups:
            return {}
        if entry is None:
            raise CheckpointError(f"checkpoint {path} holds no SSD tier snapshots, and this model has tables on the "
                                  f"tier ({sorted(self.groups)}): resume with the tables as they were saved")
        out = {}
        for key, g in self.groups.items():
            if key not in entry["groups"]:
                raise CheckpointError(f"checkpoint {path} has no SSD tier snapshot of tables {key}")
            saved = entry["groups"][key]
            if g.dynamic.tables and self._sharded(g) and saved["parts"] != self.world:
                # (a load at another world size moves keys to other rows, rehome_state: the tier's rows stay)
                raise CheckpointError(f"checkpoint {path} holds row-sharded dynamic tables {g.dynamic.tables} on the SSD "
                                      f"tier from {saved['parts']} ranks: resume them row-sharded at {saved['parts']} ranks, "
                                      f"or replicated (at another world size a key moves to another rank's rows, which "
                                      f"the tier's snapshots do not follow yet)")
            parts = [path.parent / entry["directory"] / f"rank{r}" / saved["name"] for r in range(saved["parts"])]
            out[key] = [(p, snapshot.verify(p)) for p in parts]
        return out

    def restore(self, parts: dict[str, list[tuple[Path, dict]]]) -> None:
        """Replace every group's rows and state by its snapshots (:meth:`check`'s)."""
        for key, g in self.groups.items():
            g.ssd_restore(parts[key])
