"""The thread-local state a worker thread must take over from the thread it works for.

Grad mode, the current CUDA device and stream, and autocast are per thread in PyTorch: a host
subgraph run on the partitioner's worker, or a prefetch on the prefetcher's, would otherwise run
in fp32 outside the caller's ``torch.autocast``, on device 0 and on the default stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class ThreadContext:
    """A snapshot of the calling thread's grad mode, CUDA device and stream, and autocast."""

    grad: bool
    cuda_device: int | None  # None: CUDA not in use by the caller
    cuda_stream: Any  # torch.cuda.Stream or None
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) of each enabled autocast

    @staticmethod
    def capture() -> "ThreadContext":
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # never initialises CUDA itself
        autocast = tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d))
        return ThreadContext(torch.is_grad_enabled(), torch.cuda.current_device() if cuda else None,
                             torch.cuda.current_stream() if cuda else None, autocast)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Enter this state on the current (worker) thread."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad))
            if self.cuda_device is not None:
                stack.enter_context(torch.cuda.device(self.cuda_device))
                stack.enter_context(torch.cuda.stream(self.cuda_stream))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            yield
