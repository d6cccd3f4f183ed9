"""Collectives over nested values holding tensors: the structure pickled, the tensors as bytes.

torch's ``*_object`` collectives pickle their whole argument. A tensor pickles with its whole
*storage*, not its view: the 52 tables of a ``TableCollection`` are views of one flat storage, so
pickling each wrote the whole storage again (52 x 464 MB on a Criteo job, which the kernel killed).
These helpers send only the structure by pickle (dicts, lists, tuples, numbers, strings, each
tensor replaced by its shape and dtype: a few kB) and every tensor's own bytes by tensor
collectives, in buckets of at most :data:`BUCKET_BYTES`. Memory: the sender's bucket and the
receivers' tensors, never a storage more than once.

Tensors are returned on the host (CPU), contiguous, each with a storage of its own (torch.save
refuses views of one storage as several dtypes), with their dtypes and shapes. Over an NCCL
group the buckets travel on this rank's current CUDA device (one host<->device copy each way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 << 20  # one message's bytes at most: bounds the sender's extra copy


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a tensor stood in a pickled structure."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:  # noqa: ANN401 - any nested value
    """``value`` with each tensor replaced by a :class:`_Slot` (the tensors appended, in order)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return type(value)((k, _strip(v, tensors)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_strip(v, tensors) for v in value)
    return value


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:  # noqa: ANN401 - any nested value
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, dict):
        return type(value)((k, _fill(v, tensors)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_fill(v, tensors) for v in value)
    return value


def _slots(value: Any) -> Iterator[_Slot]:  # noqa: ANN401 - any nested value
    if isinstance(value, _Slot):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _slots(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _slots(v)


def _nbytes(slot: _Slot) -> int:
    return torch.Size(slot.shape).numel() * torch.empty((), dtype=slot.dtype).element_size()


def _buckets(slots: list[_Slot]) -> list[list[_Slot]]:
    """The slots in order, cut into runs of at most :data:`BUCKET_BYTES` (a larger tensor alone)."""
    out: list[list[_Slot]] = []
    size = BUCKET_BYTES
    for s in slots:
        if size + _nbytes(s) > BUCKET_BYTES or not out:
            out.append([])
            size = 0
        out[-1].append(s)
        size += _nbytes(s)
    return out


def _wire_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a flat uint8 tensor (a view when contiguous; a copy otherwise)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _broadcast_tensors(slots: list[_Slot], mine: list[torch.Tensor] | None, src: int,
                       group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """The tensors of ``slots`` broadcast from global rank ``src`` (``mine``: its tensors there),
    returned on the host on every rank."""
    device = _wire_device(group)
    out: list[torch.Tensor] = [None] * len(slots)  # type: ignore[list-item]
    for bucket in _buckets(slots):
        offsets = [0]
        for s in bucket:  # each tensor at a 16-byte-aligned offset: viewable as any dtype
            offsets.append(offsets[-1] + -(-_nbytes(s) // 16) * 16)
        buf = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
        if mine is not None:  # one copy of the bucket's bytes (host -> device under NCCL)
            for s, at in zip(bucket, offsets):
                buf[at:at + _nbytes(s)].copy_(_as_bytes(mine[s.index]))
        dist.broadcast(buf, src=src, group=group)
        host = buf.cpu()  # device -> host under NCCL; the same tensor on the host
        for s, at in zip(bucket, offsets):
            # a copy of its own: torch.save refuses views of one storage as several dtypes
            out[s.index] = host[at:at + _nbytes(s)].view(s.dtype).reshape(s.shape).clone()
    return out


def gather_tree(value: Any, group: dist.ProcessGroup | None = None, dst: int | None = None) -> list[Any] | None:  # noqa: ANN401
    """Every rank's ``value`` (nested dicts / lists / tuples of tensors and picklable leaves), in
    group-rank order, on every rank of ``group`` - or with ``dst`` on group rank ``dst`` alone
    (``None`` elsewhere: the others never hold the whole); a collective. Tensors come back on the
    host."""
    me = dist.get_rank(group)
    if dst is not None:  # point to point: only dst receives
        if me != dst:
            send_tree(value, dst, group)
            return None
        return [value if r == me else recv_tree(r, group) for r in range(dist.get_world_size(group))]
    tensors: list[torch.Tensor] = []
    skeleton = _strip(value, tensors)
    skeletons: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(skeletons, skeleton, group=group)  # the structure only: no tensor is pickled
    out = []
    for r, sk in enumerate(skeletons):
        src = dist.get_global_rank(group, r) if group is not None else r
        got = _broadcast_tensors(list(_slots(sk)), tensors if r == me else None, src, group)
        out.append(_fill(sk, got))
    return out


def broadcast_tree(value: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:  # noqa: ANN401
    """Group rank ``src``'s ``value`` on every rank of ``group`` (``value`` is ignored elsewhere);
    a collective. Tensors come back on the host."""
    tensors: list[torch.Tensor] = []
    box = [_strip(value, tensors) if dist.get_rank(group) == src else None]
    dist.broadcast_object_list(box, group_src=src, group=group)  # the structure only
    source = dist.get_global_rank(group, src) if group is not None else src
    got = _broadcast_tensors(list(_slots(box[0])), tensors if dist.get_rank(group) == src else None, source, group)
    return _fill(box[0], got)


def send_tree(value: Any, dst: int, group: dist.ProcessGroup | None = None) -> None:  # noqa: ANN401
    """Send ``value`` to group rank ``dst`` (which calls :func:`recv_tree`): the structure
    pickled, each tensor's bytes sent as a tensor."""
    tensors: list[torch.Tensor] = []
    dist.send_object_list([_strip(value, tensors)], group=group, group_dst=dst)
    device = _wire_device(group)
    for t in tensors:  # host -> device under NCCL
        dist.send(_as_bytes(t).to(device), group=group, group_dst=dst)


def recv_tree(src: int, group: dist.ProcessGroup | None = None) -> Any:  # noqa: ANN401
    """What group rank ``src`` sent with :func:`send_tree`; tensors on the host."""
    box = [None]
    dist.recv_object_list(box, group=group, group_src=src)
    device = _wire_device(group)
    got = []
    for s in _slots(box[0]):
        buf = torch.empty(_nbytes(s), dtype=torch.uint8, device=device)
        dist.recv(buf, group=group, group_src=src)
        got.append(buf.cpu().view(s.dtype).reshape(s.shape))  # device -> host under NCCL
    return _fill(box[0], got)
