"""Messages between workers and servers, over torch.distributed point-to-point on a gloo group.

No protocol of our own below that: gloo carries the bytes (TCP, ordered per pair of ranks and
tag), torchrun's store did the rendezvous. A request is a fixed ``(8,)`` int64 header on tag
:data:`TAG_REQUEST` - ``[op, step, group, n, extra, ...]`` (zeros where an op needs no more) - followed by its tensors on
:data:`TAG_PAYLOAD`; a server receives headers from any worker and then the payload from that
worker. A reply is a header ``[status, n, ...]`` and its tensors on :data:`TAG_REPLY`.

Workers wait for replies with a deadline (``PSConfig.timeout_s``): a server that does not answer
raises :class:`ServerTimeoutError`, one whose process is gone :class:`ServerLostError`; both
name the server's rank. A server's error (say an out-of-range id) comes back as status and
message and is raised on the worker as the same exception type.
"""

from __future__ import annotations

import datetime
import enum

import torch
import torch.distributed as dist
from torch import Tensor

HEADER = 8
TAG_REQUEST, TAG_PAYLOAD, TAG_REPLY = 1, 2, 3


class Op(enum.IntEnum):
    PULL = 1  # payload: ids (n,) int64; reply: rows (n, D)
    PUSH = 2  # payload: ids (n,) int64, gradient rows (n, D) fp32; extra: the worker's unique ids of the group; reply: header
    SAVE = 3  # payload: checkpoint path, utf-8 (n,) uint8; then every rank joins the DCP save
    LOAD = 4  # as SAVE, for the DCP load
    STOP = 5  # this worker is done
    # payload: (L, 2) int64 lookup entries (group table index, key count), then the keys (n,) int64;
    # extra: 1 for a training lookup; fields 5, 6: L and the lookup's number in the step;
    # reply: table rows (n,) int64, then each entry's table counts here (L, 4) int64 (hetero.ps.keys)
    TRANSLATE = 6


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


def encode(text: str) -> Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def decode(t: Tensor) -> str:
    return bytes(t.numpy().tobytes()).decode()


class Channel:
    """A worker's side: send requests to servers and wait for their replies with a deadline."""

    def __init__(self, group, timeout_s: float, shard_of: dict[int, int]) -> None:  # noqa: ANN001 - ProcessGroup
        self.group, self.timeout = group, datetime.timedelta(seconds=timeout_s)
        self.timeout_s, self.shard_of = timeout_s, shard_of  # server rank -> shard index (for messages)

    def request(self, server: int, op: Op, payload: list[Tensor], step: int = 0, group: int = 0, n: int = 0,
                extra: int = 0, fields: tuple[int, ...] = ()) -> list:
        """Start sending one request (``fields``: the header's after ``extra``); returns the works
        :meth:`wait` must complete."""
        works = [dist.isend(header(op, step, group, n, extra, *fields), server, group=self.group, tag=TAG_REQUEST)]
        works += [dist.isend(t, server, group=self.group, tag=TAG_PAYLOAD) for t in payload]
        return works

    def receive(self, server: int, out: Tensor):  # noqa: ANN201 - a Work
        return dist.irecv(out, server, group=self.group, tag=TAG_REPLY)

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

    def reply_header(self, server: int, what: str) -> Tensor:
        h = torch.empty(HEADER, dtype=torch.int64)
        self.wait(self.receive(server, h), server, what)
        return h

    def raise_error(self, server: int, h: Tensor, what: str) -> None:
        """Raise the server's error of reply header ``h`` (its message follows the header)."""
        msg = torch.empty(int(h[1]), dtype=torch.uint8)
        self.wait(self.receive(server, msg), server, what)
        kind = IndexError if int(h[0]) == Status.INDEX_ERROR else ValueError
        raise kind(decode(msg))
