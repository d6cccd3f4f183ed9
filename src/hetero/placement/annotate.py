"""Marking placement in and on a model: regions of ops, modules, and the rules a spec holds.

* ``with hetero.placement.on(Target.HOST): ...`` inside ``forward`` places the ops of the region
  (MindSpore's ``Primitive.set_device("CPU")`` for a block of code); :func:`host_ops` /
  :func:`device_ops` do the same for a whole function.
* :func:`place` marks a module (its ops and parameters); a module class may declare a default with
  a ``hetero_target`` class attribute (``HostEmbedding`` declares ``Target.HOST``).
* :class:`PlacementSpec` places from outside the model: modules and parameters by qualified name,
  ops by module and op type ("layer1's matmul and add on the host").

Precedence, highest first: a region in ``forward`` > an op rule of the spec (the rule with the
longest module name wins) > a module placement (the innermost placed module wins; the spec's
module entries over ``place()`` marks over class defaults) > the spec's default (``DEVICE``). A
parameter follows the first op that consumes it unless the spec pins it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator

from torch import nn

from hetero.placement.target import Target

_regions = threading.local()


def current_region() -> Target | None:
    stack = getattr(_regions, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def on(target: Target | str) -> Iterator[None]:
    """Place the ops run (or traced) inside the block on ``target``.

    Raises:
        ValueError: an unknown target (the message lists the valid ones).
    """
    t = Target.parse(target)
    stack = _regions.__dict__.setdefault("stack", [])
    stack.append(t)
    try:
        yield
    finally:
        stack.pop()


def _marker(target: Target) -> Callable:
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with on(target):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


host_ops = _marker(Target.HOST)
device_ops = _marker(Target.DEVICE)


def place(module: nn.Module, target: Target | str) -> nn.Module:
    """Place ``module`` (its ops and the parameters they consume) on ``target``; returns it."""
    module.hetero_target = Target.parse(target)
    return module


def module_target(module: nn.Module) -> Target | None:
    """The target ``place()`` or the module's class gave it, if any."""
    return getattr(module, "hetero_target", None)


@dataclasses.dataclass(frozen=True)
class OpRule:
    """Ops of type ``op`` inside module ``module`` ("" = the whole model) run on ``target``.

    ``op`` is a function or method name (``matmul``, ``add``, ``relu``, ``cat``) or, for a leaf
    module such as ``nn.Linear``, its class name in lower case (``linear``).
    """

    module: str
    op: str
    target: Target


class PlacementSpec:
    """Placement given from outside the model. Methods chain: ``spec.module(...).op(...)``.

    Raises:
        ValueError: an unknown target, or a second, different target for the same module or
            parameter (a conflicting pin). Names are checked against the model when it is
            partitioned.
    """

    def __init__(self, default: Target | str = Target.DEVICE) -> None:
        self.default = Target.parse(default)
        self.modules: dict[str, Target] = {}
        self.params: dict[str, Target] = {}
        self.ops: list[OpRule] = []

    def _set(self, kind: str, table: dict[str, Target], name: str, target: Target | str) -> "PlacementSpec":
        t = Target.parse(target)
        if name in table and table[name] is not t:
            raise ValueError(f"conflicting pins for {kind} {name!r}: {table[name].value} and {t.value}")
        table[name] = t
        return self

    def module(self, name: str, target: Target | str) -> "PlacementSpec":
        return self._set("module", self.modules, name, target)

    def param(self, name: str, target: Target | str) -> "PlacementSpec":
        return self._set("parameter", self.params, name, target)

    def op(self, module: str, op: str, target: Target | str) -> "PlacementSpec":
        t = Target.parse(target)
        for r in self.ops:
            if (r.module, r.op) == (module, op) and r.target is not t:
                raise ValueError(f"conflicting pins for op {op!r} of module {module!r}: {r.target.value} and {t.value}")
        self.ops.append(OpRule(module, op, t))
        return self
