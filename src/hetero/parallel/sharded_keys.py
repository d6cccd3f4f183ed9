"""Row-sharded dynamic tables on torch.distributed: each key is translated, admitted, counted and
evicted by the rank that owns it (:mod:`hetero.dynamic.sharding`'s rule), whose rows and
optimizer state it gets; checkpoints hold one table's key map whole, which any world size loads.

A lookup (:func:`route_keys`) sends each key to its owner (all-to-all of counts, then keys, in
rank order; one exchange for all the dynamic tables of a table group's lookup), the owner
translates them with its :class:`~hetero.dynamic.KeyMap` in the order received - rank 0's keys,
then rank 1's: what one process given the ranks' batches one after the other would see - and the
rows go back (all-to-all). The row-sharded lookup then reads them as
any other rows (:mod:`hetero.parallel.row_sharded`): a key's row lies in its owner's block.

Checkpoints (:func:`full_keymap_state`, :func:`local_keymap_state`): the ranks' spans of a table's
row keys, use counts and last steps are concatenated into the table's (what one process would
hold), the admission sketches summed (a count-min sketch is linear: the sum is the sketch of all
the keys; after a resume each rank's estimates count every rank's sightings, which only
over-estimates) and the counts summed. A load gives each key its row at the present world size
(:func:`~hetero.dynamic.sharding.rehome`): none moves at the world size the checkpoint was saved
at, so that resume is exact.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from hetero.dynamic import DynamicStats, KeyMap, Keys
from hetero.dynamic.sharding import KeyShard, KeySpans, merged_counts, rehome
from hetero.embedding import HostEmbedding, host_tables
from hetero.embedding.dynamic_rows import KeyedTable
from hetero.embedding.group import TableGroup
from hetero.parallel.env import host_group, rank, world_size

KEYMAP_ROWS = ("row_key", "row_count", "row_last")  # the key map's per-row arrays (KeyMap.STATE)


def shard_keys(group: TableGroup, blocks: list[tuple[int, int]]) -> None:
    """Give each dynamic table of ``group``, being row-sharded into ``blocks`` (each rank's group rows
    ``[lo, hi)``), a key map of this rank's span of its rows, and route its lookups to the owners.
    ``keep_floor`` is shared out over the spans in proportion; ``evict_chunk`` is capped at a span."""
    r = rank()
    lo, hi = blocks[r]
    for t in group.tables:
        if t.keymap is None:
            continue
        capacity, config = t.config.num_embeddings, t.config.dynamic
        spans = KeySpans.of_blocks(capacity, t.group_row, blocks)
        mine = int(spans.counts[r])
        t.keymap = KeyMap(t.config.name, mine, config.share(mine, capacity), t.init_seed)
        t.key_first, t.key_shard = int(spans.starts[r]), KeyShard(spans)
    frozen = group.dynamic.frozen  # (the default rows: group rows -> this rank's storage rows)
    group.dynamic.frozen = frozen[(frozen >= lo) & (frozen < hi)] - lo
    group.dynamic.route = functools.partial(route_keys, host_group())


def route_keys(pg: dist.ProcessGroup | None, lookups: list[tuple[KeyedTable, Tensor]], training: bool) -> list[Tensor]:
    """The rows of row-sharded dynamic tables' keys (``lookups``: ``(table, (N,) int64 keys)`` pairs,
    host; a table may come twice): each key translated by its owner (``table.own_rows``), three
    all-to-alls for all the tables - counts, keys, rows. A collective of ``pg``: every rank calls it
    for the same lookups, with its own keys (any number, none included).

    Each message to a rank holds the tables' keys it owns, table after table, each in lookup order;
    an owner translates a table's keys in one call, rank 0's first: the order one process given the
    ranks' batches one after the other would see."""
    n, T = world_size(), len(lookups)
    owners = [t.key_shard.spans.owner(k.numpy()) for t, k in lookups]
    orders = [np.argsort(o, kind="stable") for o in owners]  # by owner, each rank's keys in lookup order
    counts = np.stack([np.bincount(o, minlength=n) for o in owners], axis=1)  # (n, T): keys of table j for rank d
    recv_counts = torch.empty(n * T, dtype=torch.int64)
    dist.all_to_all_single(recv_counts, torch.from_numpy(counts.reshape(-1).copy()), group=pg)
    got_counts = recv_counts.numpy().reshape(n, T)  # keys of table j from rank s
    send = _by_rank([k.numpy()[o] for (_, k), o in zip(lookups, orders)], counts)
    asked = torch.empty(int(got_counts.sum()), dtype=torch.int64)
    dist.all_to_all_single(asked, torch.from_numpy(send), got_counts.sum(1).tolist(), counts.sum(1).tolist(), group=pg)
    # each table's keys from every rank, rank 0's first: translated at once, then back in the received layout
    segments = _segments(got_counts)
    rows = np.empty(asked.shape[0], np.int64)
    for j, (table, _) in enumerate(lookups):
        at = np.concatenate([np.arange(a, b) for a, b in segments[:, j]])
        rows[at] = table.own_rows(asked[torch.from_numpy(at)], training).numpy()
    got = torch.empty(int(counts.sum()), dtype=torch.int64)
    dist.all_to_all_single(got, torch.from_numpy(rows), counts.sum(1).tolist(), got_counts.sum(1).tolist(), group=pg)
    out, back = [], _segments(counts)
    for j, ((_, k), o) in enumerate(zip(lookups, orders)):
        mine = torch.empty(k.numel(), dtype=torch.int64)
        mine[torch.from_numpy(o)] = torch.cat([got[a:b] for a, b in back[:, j]])
        out.append(mine)
    return out


def _segments(counts: np.ndarray) -> np.ndarray:
    """``(n, T, 2)``: where table ``j``'s part for (or from) rank ``d`` lies in a message laid out
    rank by rank, table by table (``counts``: ``(n, T)``)."""
    ends = np.cumsum(counts.reshape(-1)).reshape(counts.shape)
    return np.stack([ends - counts, ends], axis=2)


def _by_rank(parts: list[np.ndarray], counts: np.ndarray) -> np.ndarray:
    """One message, rank by rank, table by table, of ``parts`` (table ``j``'s values sorted by rank,
    ``counts[d, j]`` of them for rank ``d``)."""
    starts = [np.concatenate([[0], np.cumsum(counts[:, j])]) for j in range(counts.shape[1])]
    pieces = [parts[j][starts[j][d] : starts[j][d + 1]] for d in range(counts.shape[0]) for j in range(counts.shape[1])]
    return np.concatenate(pieces) if pieces else np.empty(0, np.int64)


def sharded_keymaps(model: nn.Module) -> dict[str, HostEmbedding]:
    """The row-sharded dynamic tables of ``model``, by qualified name."""
    return {k: t for k, t in host_tables(model).items() if t.keymap is not None and t.key_shard is not None}


def _gather_spans(table: HostEmbedding, local: np.ndarray) -> np.ndarray:
    """The table's ``(capacity, ...)`` array from each rank's span (``local``: ``(counts[r], ...)``)."""
    counts = table.key_shard.spans.counts
    longest = int(counts.max())
    padded = torch.zeros((longest, *local.shape[1:]), dtype=torch.int64)
    padded[: local.shape[0]] = torch.from_numpy(local.astype(np.int64))
    parts = [torch.empty_like(padded) for _ in range(world_size())]
    dist.all_gather(parts, padded, group=host_group())
    return torch.cat([p[: int(c)] for p, c in zip(parts, counts)]).numpy()


SKETCH_BYTES = 2 << 20  # bytes of sketch counters summed at once, to bound a checkpoint's peak
INT32_TOP = 2**31 - 1


def _summed_sketch(table: HostEmbedding) -> Tensor:
    """Every rank's admission sketch summed (what each counted since the load's ``sketch_base``, plus
    the base), saturated at int32's top. Collective.

    Most counters of a sketch are untouched between two checkpoints, so each rank sends only the
    counters it changed (position and delta, all-gathered) when all ranks' changes together take
    fewer bytes than the sketch; otherwise the whole sketch is all-reduced chunk by chunk, as int32
    where no sum can leave int32's range, else as int64. (A checkpoint of 26 row-sharded dynamic
    tables of 4M-counter sketches at 2 ranks spent 1.7 s of its 4.8 s all-reducing them as int64.)"""
    mine = table.keymap.sketch.reshape(-1)
    base = table.key_shard.sketch_base
    flat_base = None if base is None else base.reshape(-1)
    chunk = SKETCH_BYTES // 4

    def changes(lo: int) -> np.ndarray:  # (chunks: no sketch-sized temporaries)
        m = mine[lo : lo + chunk]
        return m if flat_base is None else m != flat_base[lo : lo + chunk]

    # first how many counters each rank changed (and its largest counter), then the changes
    # themselves, only where they are few: a dense sketch never makes 16 bytes of them a counter
    here = sum(int(np.count_nonzero(changes(lo))) for lo in range(0, mine.shape[0], chunk))
    sizes = torch.tensor([here, max(int(mine.max(initial=0)), 0 if flat_base is None else
                                    int(flat_base.max(initial=0)))], dtype=torch.int64)
    every = [torch.empty_like(sizes) for _ in range(world_size())]
    dist.all_gather(every, sizes, group=host_group())
    changed = sum(int(x[0]) for x in every)
    out = np.zeros(mine.shape, mine.dtype) if flat_base is None else flat_base.copy()  # (zeros: pages mapped lazily)
    if changed * 16 < mine.nbytes:
        pairs = torch.zeros((2, max(int(x[0]) for x in every)), dtype=torch.int64)
        at = 0
        for lo in range(0, mine.shape[0], chunk):
            nz = np.flatnonzero(changes(lo))
            d = mine[lo + nz].astype(np.int64)
            if flat_base is not None:
                d -= flat_base[lo + nz]
            pairs[0, at : at + nz.shape[0]] = torch.from_numpy(nz + lo)
            pairs[1, at : at + nz.shape[0]] = torch.from_numpy(d)
            at += nz.shape[0]
        parts = [torch.empty_like(pairs) for _ in range(world_size())]
        dist.all_gather(parts, pairs, group=host_group())
        where = np.concatenate([p[0, : int(x[0])].numpy() for p, x in zip(parts, every)])
        delta = np.concatenate([p[1, : int(x[0])].numpy() for p, x in zip(parts, every)])
        cells, inverse = np.unique(where, return_inverse=True)
        total = out[cells].astype(np.int64)
        np.add.at(total, inverse, delta)  # (exact in int64; saturated once, after every rank's delta)
        out[cells] = np.minimum(total, INT32_TOP)
        return torch.from_numpy(out).view(table.keymap.sketch.shape)
    # dense: each delta is within [-bound, bound] and the base added back at most bound more
    wide = 2 * sum(int(x[1]) for x in every) > INT32_TOP  # (every rank decides alike)
    dtype = torch.int64 if wide else torch.int32
    span = SKETCH_BYTES // dtype.itemsize
    result = torch.from_numpy(out)
    for lo in range(0, mine.shape[0], span):
        part = torch.from_numpy(mine[lo : lo + span]).to(dtype, copy=True)  # (the reduction writes into it)
        if flat_base is not None:
            part -= torch.from_numpy(flat_base[lo : lo + span]).to(dtype)
        dist.all_reduce(part, group=host_group())
        if flat_base is not None:
            part += torch.from_numpy(flat_base[lo : lo + span]).to(dtype)
        result[lo : lo + part.shape[0]] = part.clamp_(max=INT32_TOP)
    return result.view(table.keymap.sketch.shape)


def full_keymap_state(name: str, table: HostEmbedding) -> dict[str, Tensor]:
    """The state dict entries (``<name>.keymap.*``) of a row-sharded dynamic table's key map, whole:
    what one process holding every key would save. Collective."""
    m = table.keymap
    rows = _gather_spans(table, np.stack([m.row_key, m.stat[:, 0], m.stat[:, 1]], axis=1))
    counts = torch.tensor(dataclasses.astuple(m.stats), dtype=torch.int64)
    dist.all_reduce(counts, group=host_group())
    scan = torch.tensor([m.next_scan])
    dist.all_reduce(scan, op=dist.ReduceOp.MAX, group=host_group())
    dtypes = {"row_key": np.int64, "row_count": np.int32, "row_last": np.int32}  # (KeyMap.state_dict's)
    state = {k: torch.from_numpy(rows[:, i].astype(dtypes[k])) for i, k in enumerate(KEYMAP_ROWS)}
    state.update(sketch=_summed_sketch(table), next_scan=scan[0], stats=counts)
    out = {f"{name}.keymap.{k}": v for k, v in state.items()}
    out[f"{name}.keymap.step"] = torch.tensor(table.group.dynamic.steps_taken)
    return out


def local_keymap_state(name: str, table: HostEmbedding, state: dict[str, Tensor]) -> None:
    """Turn a whole table's entries of a model state (``<name>.weight``, ``<name>.keymap.*``; saved
    at any world size, or by one process) into this rank's, in place: every key is given its row
    here (:func:`~hetero.dynamic.sharding.rehome`), its value with it; the weight stays whole (the
    caller cuts its rows). The moves are kept on the table (``key_shard.rehomed``) for the optimizer's state
    (:func:`rehome_state`). The counts go to rank 0; the keys that found no row count as evicted."""
    if f"{name}.keymap.row_key" not in state:
        return
    arrays = {k: state[f"{name}.keymap.{k}"].numpy() for k in KEYMAP_ROWS}
    shard = table.key_shard
    moved = rehome(shard.spans, arrays["row_key"], arrays["row_count"], arrays["row_last"])
    shard.rehomed = None if moved.identity else moved.source
    shard.sketch_base = state[f"{name}.keymap.sketch"].numpy().copy()  # (int32, as the sketch)
    lo, hi = table.key_first, table.key_first + table.keymap.capacity
    for k, x in arrays.items():
        whole = np.full_like(x, -1 if k == "row_last" else 0)
        held = moved.source >= 0
        whole[held] = x[moved.source[held]]
        state[f"{name}.keymap.{k}"] = torch.from_numpy(whole[lo:hi].copy())
    if shard.rehomed is not None and f"{name}.weight" in state:
        state[f"{name}.weight"] = rehome_state(table, state[f"{name}.weight"], 0.0)
    stats = DynamicStats(*state[f"{name}.keymap.stats"].tolist())
    stats.evicted += moved.dropped
    mine = dataclasses.astuple(stats) if rank() == 0 else (0, 0, 0, 0)
    state[f"{name}.keymap.stats"] = torch.tensor(mine, dtype=torch.int64)


def rehome_state(table: HostEmbedding, whole: Tensor, initial: float) -> Tensor:
    """A whole table's per-row tensor (``(num_embeddings + 1, ...)``: its weight or an optimizer
    state) with each row where :func:`local_keymap_state` put its key; free rows ``initial``, the
    default row unchanged. Unchanged when no key moved."""
    if table.key_shard is None or table.key_shard.rehomed is None:
        return whole
    source = torch.from_numpy(table.key_shard.rehomed)
    out = torch.full_like(whole, initial)
    held = source >= 0
    out[: source.shape[0]][held] = whole[source[held]]
    out[source.shape[0] :] = whole[source.shape[0] :]
    return out


def dynamic_stats(model: nn.Module) -> dict[str, DynamicStats]:
    """Each dynamic table's counts by qualified name; a row-sharded table's summed over the ranks
    (a collective when ``model`` has one: every rank calls it); on parameter servers, as the
    servers last reported them to this worker."""
    tables = {k: t for k, t in host_tables(model).items() if t.config.keys is Keys.DYNAMIC}
    out = {k: dataclasses.replace(t.keymap.stats) if t.keymap is not None else
           dataclasses.replace(t.group.dynamic.remote_stats.get(t.name, DynamicStats())) for k, t in tables.items()}
    sharded = [k for k, t in tables.items() if t.key_shard is not None]
    if sharded:
        summed = torch.tensor([dataclasses.astuple(out[k]) for k in sharded], dtype=torch.int64)
        dist.all_reduce(summed, group=host_group())
        for k, row in zip(sharded, summed.tolist()):
            out[k] = DynamicStats(*row)
    return out


# --------------------------------------------------------------------------- sharded (DCP) checkpoints
# Each rank writes its own part of a row-sharded dynamic table's map (``keys.<table>.rank<r>``): a
# resume at the same world size gives every rank back its own map, exactly; another world size
# would move keys between ranks with their rows, which needs the whole table: merge the
# checkpoint into the integrated format (whole_keymap_of_ranks) and resume from that.


def rank_keymap_state(table: HostEmbedding) -> dict[str, Tensor]:
    """This rank's part of a row-sharded dynamic table's key map (copies): its span's rows' keys,
    use counts and last steps, its own admission sketch and the loaded sketch it counts on
    (``sketch_base``, zeros and ``has_base`` 0 when none), its counts, next age scan, and the
    table's clock (``step``)."""
    state = {k: torch.from_numpy(v) for k, v in table.keymap.state_dict().items()}
    base = table.key_shard.sketch_base
    state["sketch_base"] = torch.from_numpy(base.copy() if base is not None else np.zeros_like(table.keymap.sketch))
    state["has_base"] = torch.tensor(int(base is not None))
    state["step"] = torch.tensor(table.group.dynamic.steps_taken)
    return state


def load_rank_keymap(table: HostEmbedding, state: Mapping[str, Tensor]) -> None:
    """Restore :func:`rank_keymap_state` (saved by this rank at this world size)."""
    table.keymap.load_state_dict({k: state[k].numpy() for k in KeyMap.STATE})
    shard = table.key_shard
    shard.sketch_base = state["sketch_base"].numpy().copy() if int(state["has_base"]) else None
    shard.rehomed = None
    table.group.dynamic.steps_taken = int(state["step"])


def whole_keymap_of_ranks(name: str, parts: list[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """The ``<name>.keymap.*`` entries of a row-sharded dynamic table's whole map from every rank's
    :func:`rank_keymap_state` (in rank order): what :func:`full_keymap_state` gathers when it
    saves - the spans' rows in order, the sketches summed over their common base, the counts
    summed, the latest next age scan."""
    state = {k: torch.cat([p[k] for p in parts]) for k in KEYMAP_ROWS}
    base = parts[0]["sketch_base"].numpy() if int(parts[0]["has_base"]) else None  # (every rank loaded the same)
    counts = merged_counts([{k: p[k].numpy() for k in ("sketch", "stats", "next_scan")} for p in parts], base)
    state.update({k: torch.from_numpy(v) for k, v in counts.items()}, step=parts[0]["step"])
    return {f"{name}.keymap.{k}": v for k, v in state.items()}
