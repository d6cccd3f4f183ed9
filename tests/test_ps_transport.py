"""The parameter-server wire format (hetero.ps.transport): one message a request and one a reply,
a request larger than the server's buffer sent as header and payload apart; and what a worker does
with them (routing, lookups started ahead, bounded mode's row cache)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import spawn
from test_ps import _join, _port, _start

from hetero import ps
from hetero._numba import load
from hetero.embedding import HostEmbedding, HostEmbeddingCollection, TableConfig
from hetero.optim import LazyAdam
from hetero.parallel import env
from hetero.ps import server as ps_server
from hetero.ps import transport
from hetero.ps.transport import HEADER_BYTES, header, header_of, pack, payload_bytes, unpack


def test_a_message_is_the_header_then_each_part_padded_to_8_bytes(monkeypatch):
    ids = torch.tensor([5, -1, 7], dtype=torch.int64)
    rows = torch.arange(6, dtype=torch.float32).reshape(3, 2)[:, :1]  # (not contiguous)
    half = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    empty = torch.empty  # the message's memory dirty, as a reused heap block can be
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(0xAB))
    message = pack(header(2, 9, 1, 3), [ids, rows, half])
    monkeypatch.undo()
    # the same bytes written by plain Python
    expected = struct.pack("<8q", 2, 9, 1, 3, 0, 0, 0, 0) + struct.pack("<3q", 5, -1, 7)
    expected += struct.pack("<3f", 0.0, 2.0, 4.0) + b"\0" * 4
    expected += b"".join(struct.pack("<f", v)[2:] for v in (1.5, -2.0, 3.25)) + b"\0" * 2
    assert bytes(message.numpy()) == expected
    assert payload_bytes([ids, rows, half]) == len(expected) - HEADER_BYTES
    assert header_of(message).tolist() == [2, 9, 1, 3, 0, 0, 0, 0]
    got = unpack(message[HEADER_BYTES:], [((3,), torch.int64), ((3, 1), torch.float32), ((3,), torch.bfloat16)])
    for g, want in zip(got, (ids, rows, half)):
        assert g.dtype == want.dtype and torch.equal(g, want)
    with pytest.raises(ValueError, match="too short for its parts"):
        unpack(message[HEADER_BYTES:], [((4,), torch.int64), ((3, 2), torch.float32)])


STEPS = [list(range(40)), [3], list(range(0, 40, 3)), [1, 2], list(range(39, -1, -1))]


def _steps(table, opt, step):
    """The worker's steps (the same in one process): outputs of lookups of ``STEPS``' ids."""
    out = []
    for ids in STEPS:
        rows = table(torch.tensor(ids))
        out.append(rows.detach().clone().tolist())
        (rows * torch.arange(1.0, len(ids) + 1).unsqueeze(1)).sum().backward()
        step()
    out.append(table(torch.arange(40)).detach().tolist())
    return out


def _small_buffer_job(rank, world, port, out):
    # a server that receives 256 bytes in one message: requests of more go as header and payload
    # apart, and the server's buffer grows to them
    transport.CAPACITY = ps_server.CAPACITY = 256
    job, table, opt = _start(rank, world, port, ps.PSConfig(num_servers=1))
    if job.role is ps.Role.WORKER:
        sparse = ps.PSSparse(opt)
        got = _steps(table, opt, sparse.step)
        Path(out, "worker.json").write_text(json.dumps({"out": got, "capacity": job.channel.capacity[1]}))
    else:
        requests = {op.name: n for op, n in job.server.requests.items()}
        Path(out, "server.json").write_text(json.dumps({"capacity": job.server.capacity, "requests": requests}))
    job.shutdown()
    env.shutdown()


def test_requests_larger_than_the_servers_buffer_train_as_one_process(tmp_path, cpu_ranks):
    spawn(_small_buffer_job, args=(2, _port(), str(tmp_path)), nprocs=2)
    worker = json.loads((tmp_path / "worker.json").read_text())
    torch.manual_seed(0)
    table = HostEmbedding(TableConfig("items", 40, 4))
    opt = LazyAdam([table])
    ref = _steps(table, opt, opt.step)
    for step, (a, b) in enumerate(zip(worker["out"], ref)):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6,
                                   msg=lambda m: f"step {step}: {m}")
    # the largest request: the last step's push of 40 ids and their gradient rows (8 + 16 bytes each)
    # and the final lookup's pull of 40 ids (8 bytes each), one message, and its header
    largest = HEADER_BYTES + 40 * (8 + 4 * 4) + 40 * 8
    assert worker["capacity"] == largest
    server = json.loads((tmp_path / "server.json").read_text())
    assert server["capacity"] == largest
    # one message a step: each step's push went with the next lookup's pull; the first lookup
    # pulled alone; none was left to send alone at the stop
    assert server["requests"] == {"PULL": 1, "PUSH_PULL": len(STEPS), "STOP": 1}


# ------------------------------------------------------------------ lookups started ahead
def _collections():
    """Two collections, three table groups (two widths in the first): the second collection's
    replies come on their groups' tags while the first's are still asked for."""
    torch.manual_seed(0)
    return torch.nn.ModuleDict({
        "a": HostEmbeddingCollection([TableConfig("u", 30, 4), TableConfig("v", 20, 8)]),
        "b": HostEmbeddingCollection([TableConfig("w", 25, 4)]),
    })


def _features(step, shift=0):
    g = torch.Generator().manual_seed(100 + step)
    return {"u": torch.randint(0, 30, (12,), generator=g), "v": torch.randint(0, 20, (9,), generator=g),
            "w": (torch.randint(0, 25, (10,), generator=g) + shift) % 25}


def _started_steps(model, step_fn):
    """Steps whose lookups start ahead in four ways; every output, and the tables after."""
    out = []
    for step in range(8):
        f = _features(step)
        kind = step % 4
        if kind in (0, 1, 3):
            model["b"].start(f)  # (one process: nothing to start)
        if kind == 2:
            model["a"].start(f)
        ya = model["a"](f)
        # kind 1: b is asked for other ids than it started (its started reply read and dropped)
        yb = model["b"](_features(step, shift=1) if kind == 1 else f)
        if kind == 3:
            model["b"].start(_features(step + 100))  # started, never looked up (dropped by the next lookup)
        ys = [*ya.values(), *yb.values()]
        out.append([y.detach().clone().tolist() for y in ys])
        sum((y * (i + 1)).sum() for i, y in enumerate(ys)).backward()
        step_fn()
    with torch.no_grad():
        f = {"u": torch.arange(30), "v": torch.arange(20), "w": torch.arange(25)}
        out.append([y.tolist() for c in ("a", "b") for y in model[c](f).values()])
    return out


def _started_job(rank, world, port, out):
    _join(rank, world, port)
    job = ps.PSJob.init(ps.PSConfig(num_servers=2))
    model = _collections()
    job.shard_tables(model)
    opt = LazyAdam([m for m in model.modules() if isinstance(m, HostEmbedding)])
    job.start(model, {"all": opt})
    if job.role is ps.Role.WORKER:
        got = _started_steps(model, ps.PSSparse(opt).step)
        dropped = [model[c].mismatched_plans for c in ("a", "b")]
        Path(out, "worker.json").write_text(json.dumps({"out": got, "mismatched": dropped}))
    job.shutdown()
    env.shutdown()


def test_lookups_started_ahead_train_as_one_process(tmp_path, cpu_ranks):
    spawn(_started_job, args=(3, _port(), str(tmp_path)), nprocs=3)
    worker = json.loads((tmp_path / "worker.json").read_text())
    model = _collections()
    opt = LazyAdam([m for m in model.modules() if isinstance(m, HostEmbedding)])
    ref = _started_steps(model, opt.step)
    for step, (a, b) in enumerate(zip(worker["out"], ref)):
        for x, y in zip(a, b):
            torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=0, atol=1e-6,
                                       msg=lambda m: f"step {step}: {m}")
    # started lookups of other ids were dropped, twice each way (kinds 1 and 3, two rounds)
    assert worker["mismatched"] == [0, 4]


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_a_workers_ids_are_routed_to_their_owners_in_order(n):
    ids = torch.tensor([0, 7, 3, 12, 5, 5, 9, 1, 40, 2, 11], dtype=torch.int64)
    order, starts = load("hetero.ps._kernels").route(ids.numpy(), n)
    got = [order[starts[s] : starts[s + 1]].tolist() for s in range(n)]
    assert got == [[i for i, x in enumerate(ids.tolist()) if x % n == s] for s in range(n)]
    assert load("hetero.ps._kernels").route(ids[:0].numpy(), n)[1].tolist() == [0] * (n + 1)


def test_row_cache_drops_entries_older_than_the_bound():
    cache = ps.RowCache(staleness=1)
    ids = torch.tensor([2, 5, 9])
    hit, _ = cache.lookup(ids, step=0)
    assert not hit.any()
    cache.insert(ids, torch.arange(6.0).reshape(3, 2), step=0)
    hit, rows = cache.lookup(torch.tensor([1, 5, 9]), step=1)  # age 1: still valid
    assert hit.tolist() == [False, True, True] and rows.tolist() == [[2.0, 3.0], [4.0, 5.0]]
    hit, rows = cache.lookup(torch.tensor([5]), step=2)  # age 2 > 1: gone
    assert not hit.any() and cache.ids.numel() == 0 and cache.max_age == 1
