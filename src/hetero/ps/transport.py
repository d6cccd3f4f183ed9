"""Messages between workers and servers, over torch.distributed point-to-point on a gloo group.

No protocol of our own below that: gloo carries the bytes (TCP, ordered per pair of ranks and
tag), torchrun's store did the rendezvous. A request is **one message** on tag
:data:`TAG_REQUEST`: a ``(8,)`` int64 header - ``[op, step, group, n, extra, f5, f6, separate]``
(zeros where an op needs no more) - followed by its tensors' bytes, each part padded to 8 bytes
(:func:`pack`). A server receives requests from any worker into a buffer of its current
capacity: gloo accepts a message shorter than the buffer it is received into, never a longer
one, so a worker sends a request larger than the capacity it knows the server has as the header
alone (``separate``: the payload's bytes) and then the payload on :data:`TAG_PAYLOAD`, and from
then on counts on that capacity (the server grows its buffer to it). A reply is one message on
its table group's tag (:func:`reply_tag`): a header ``[status, n, ...]`` and its tensors' bytes,
received into a buffer sized for the expected answer (at least :data:`MESSAGE_BYTES` of payload,
room for an error's text).

Why one message: a gloo message between two processes of one host costs about 0.2-0.25 ms
whatever its size up to hundreds of KB (``benchmarks/ps_transport.py`` on the 2-core VM: a round
trip of one 64-byte message each way 0.45 ms, two each way 0.93 ms, a plain loopback TCP socket
0.14 ms: gloo's event loop hands each message between threads), and a request used to be 2-3
messages and its reply 1-2.

Workers wait for replies with a deadline (``PSConfig.timeout_s``): a server that does not answer
raises :class:`ServerTimeoutError`, one whose process is gone :class:`ServerLostError`; both
name the server's rank. A server's error (say an out-of-range id) comes back as status and
message and is raised on the worker as the same exception type.
"""

from __future__ import annotations

import datetime
import enum
import math

import torch
import torch.distributed as dist
from torch import Tensor

HEADER = 8  # int64 fields
HEADER_BYTES = HEADER * 8
SEPARATE = HEADER - 1  # the request header's field: bytes of a payload sent in a message of its own (0: none)
MESSAGE_BYTES = 4096  # room for an error's text in every reply (longer texts are cut)
CAPACITY = 1 << 20  # request bytes a server receives in one message from the start
TAG_REQUEST, TAG_PAYLOAD, TAG_REPLY = 1, 2, 3


def reply_tag(group: int) -> int:
    """The tag of a server's replies about table group ``group``: a group's own, so that a worker
    may take a group's reply before an earlier-asked group's (``HostEmbeddingCollection.start``)."""
    return TAG_REPLY + group


class Op(enum.IntEnum):
    PULL = 1  # payload: ids (n,) int64; reply: rows (n, D)
    # payload: ids (n,) int64, gradient rows (n, D) fp32; extra: the worker's unique ids of the group; reply: header
    PUSH = 2
    SAVE = 3  # payload: checkpoint path, utf-8 (n,) uint8; then every rank joins the DCP save
    LOAD = 4  # as SAVE, for the DCP load
    STOP = 5  # this worker is done
    # payload: (L, 2) int64 lookup entries (group table index, key count), then the keys (n,) int64;
    # extra: 1 for a training lookup; fields 5, 6: L and the lookup's number in the step;
    # reply: table rows (n,) int64, then each entry's table counts here (L, 4) int64 (hetero.ps.keys)
    TRANSLATE = 6
    # a PUSH (step, n, extra as there) and then the step after's PULL of f5 ids: payload push ids (n,) int64,
    # gradient rows (n, D) fp32, pull ids (f5,) int64; reply: the rows (f5, D) once the push is applied
    PUSH_PULL = 7


class Status(enum.IntEnum):
    OK = 0
    INDEX_ERROR = 1  # then a message of n bytes
    VALUE_ERROR = 2


class ServerTimeoutError(TimeoutError):
    """A parameter server did not answer within ``PSConfig.timeout_s``."""


class ServerLostError(ConnectionError):
    """The connection to a parameter server broke (its process exited or was killed)."""


def header(*fields: int) -> Tensor:
    h = torch.zeros(HEADER, dtype=torch.int64)
    h[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return h


def _padded(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def payload_bytes(parts: list[Tensor]) -> int:
    return sum(_padded(t.numel() * t.element_size()) for t in parts)


def spec_bytes(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """:func:`payload_bytes` of parts of the given ``(shape, dtype)`` s (what :func:`unpack` reads)."""
    return sum(_padded(math.prod(shape) * dtype.itemsize) for shape, dtype in specs)


def pack(head: Tensor, parts: list[Tensor]) -> Tensor:
    """One uint8 message: header ``head`` ((8,) int64) then each of ``parts``' bytes (row-major),
    each padded to 8 bytes with zeros so that :func:`unpack` views every part in place. One copy
    of the parts."""
    buf = torch.empty(HEADER_BYTES + payload_bytes(parts), dtype=torch.uint8)
    buf[:HEADER_BYTES].view(torch.int64).copy_(head)
    at = HEADER_BYTES
    for t in parts:
        nbytes = t.numel() * t.element_size()
        if nbytes:
            buf[at : at + nbytes].view(t.dtype).copy_(t.reshape(-1))
        buf[at + nbytes : at + _padded(nbytes)] = 0  # (no stale heap bytes on the wire)
        at += _padded(nbytes)
    return buf


def unpack(payload: Tensor, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[Tensor]:
    """Views of the parts of ``payload`` (a message's uint8 bytes after its header) of the given
    ``(shape, dtype)`` s, in order (no copy: they share the message's memory).

    Raises:
        ValueError: the parts need more bytes than ``payload`` has (sender and receiver disagree).
    """
    out, at = [], 0
    for shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        if at + nbytes > payload.numel():
            raise ValueError(f"a parameter-server message of {payload.numel()} payload bytes is too short for its "
                             f"parts {specs}: workers and servers run different hetero versions?")
        out.append(payload[at : at + nbytes].view(dtype).view(shape))
        at += _padded(nbytes)
    return out


def header_of(message: Tensor) -> Tensor:
    """The (8,) int64 header of a message (a view)."""
    return message[:HEADER_BYTES].view(torch.int64)


def encode(text: str) -> Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def decode(t: Tensor) -> str:
    return bytes(t.numpy().tobytes()).decode()


class Channel:
    """A worker's side: send requests to servers and wait for their replies with a deadline."""

    def __init__(self, group, timeout_s: float, shard_of: dict[int, int]) -> None:  # noqa: ANN001 - ProcessGroup
        self.group, self.timeout = group, datetime.timedelta(seconds=timeout_s)
        self.timeout_s, self.shard_of = timeout_s, shard_of  # server rank -> shard index (for messages)
        # request bytes each server is known to receive in one message: it grows its buffer to the
        # largest payload sent apart (other workers' requests may have grown it further)
        self.capacity = {server: CAPACITY for server in shard_of}

    def request(self, server: int, op: Op, payload: list[Tensor], step: int = 0, group: int = 0, n: int = 0,
                extra: int = 0, fields: tuple[int, ...] = ()) -> list:
        """Start sending one request (``fields``: the header's after ``extra``, at most two); returns
        the works :meth:`wait` must complete (they hold the message's memory until then)."""
        nbytes = payload_bytes(payload)
        if HEADER_BYTES + nbytes <= self.capacity[server]:
            message = pack(header(op, step, group, n, extra, *fields), payload)
            return [dist.isend(message, server, group=self.group, tag=TAG_REQUEST)]
        # larger than the server's buffer: the header alone, then the payload (the server grows its buffer)
        self.capacity[server] = HEADER_BYTES + nbytes
        head = header(op, step, group, n, extra, *fields, *[0] * (2 - len(fields)), nbytes)
        works = [dist.isend(head, server, group=self.group, tag=TAG_REQUEST)]
        body = pack(head, payload)[HEADER_BYTES:]
        return works + [dist.isend(body, server, group=self.group, tag=TAG_PAYLOAD)]

    def reply(self, server: int, group: int, nbytes: int, what: str, n: int,
              pin: bool = False) -> tuple[Tensor, Tensor]:
        """Wait for ``server``'s reply about table group ``group`` of ``nbytes`` payload bytes (its
        :func:`payload_bytes`) answering ``n`` items (ids or keys: the header's count);
        ``(header, payload)``, the payload a uint8 view (pinned memory with ``pin``) for :func:`unpack`.

        Raises:
            IndexError / ValueError: the server's error (its message names the table), or a reply
                for another number of items than asked (never read as rows).
            ServerTimeoutError / ServerLostError: see :meth:`wait`.
        """
        message = torch.empty(HEADER_BYTES + max(nbytes, MESSAGE_BYTES), dtype=torch.uint8, pin_memory=pin)
        self.wait(dist.irecv(message, server, group=self.group, tag=reply_tag(group)), server, what)
        h = header_of(message)
        if int(h[0]) != Status.OK:
            kind = IndexError if int(h[0]) == Status.INDEX_ERROR else ValueError
            raise kind(decode(message[HEADER_BYTES : HEADER_BYTES + int(h[1])]))
        if int(h[1]) != n:
            raise ValueError(f"parameter server rank {server} answered {what} for {int(h[1])} items, not the {n} "
                             f"asked: workers and servers run different hetero versions?")
        return h, message[HEADER_BYTES : HEADER_BYTES + nbytes]

    def wait(self, work, server: int, what: str) -> None:  # noqa: ANN001 - a Work
        """Complete ``work`` (a send to or receive from ``server``) within the deadline."""
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            where = f"parameter server rank {server} (shard {self.shard_of[server]} of {len(self.shard_of)})"
            if "Timed out" in str(e) or "timed out" in str(e):
                raise ServerTimeoutError(
                    f"{where} did not answer {what} within {self.timeout_s:g} s (PSConfig.timeout_s); is its process "
                    f"running and reachable from this worker? The job restarts from its last checkpoint under "
                    f"torchrun --max-restarts") from e
            raise ServerLostError(f"{where}: connection lost during {what} ({e}); its process exited or was killed. "
                                  f"The job restarts from its last checkpoint under torchrun --max-restarts") from e
