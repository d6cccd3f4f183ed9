"""Where a table group's rows live, and the one interface through which lookups reach them.

Every :class:`~hetero.embedding.group.TableGroup` has an ``exchange``, a :class:`RowExchange`:

* :class:`LocalRows` (:attr:`RowPlacement.LOCAL`): every row is in this process's storage - the
  default, and what a replicated table under data parallel has;
* ``hetero.parallel.row_sharded.RowSharding`` (:attr:`RowPlacement.ROW_SHARDED`): each rank holds
  one block of rows; lookups and gradients travel by all-to-all;
* ``hetero.ps.client.PSClient`` (:attr:`RowPlacement.PARAMETER_SERVER`): a worker holds no rows;
  lookups pull from the servers, the optimizer step pushes;
* ``hetero.ps.server.ServerShard`` (:attr:`RowPlacement.SERVER_SHARD`): a server's storage is a
  hash shard of the rows; it looks nothing up, it applies pushed gradients.

Code that must treat these differently asks ``exchange.placement`` (an enum), never the type of
an attribute. Row indices carry their space (:class:`RowSpace`) in every
:class:`~hetero.embedding.grad.SparseGrad`.
"""

from __future__ import annotations

import abc
import enum
from typing import ClassVar, Protocol

from torch import Tensor

from hetero.embedding.plan import LookupPlan, Request


class LocalLookup(Protocol):
    """What an exchange reads of its table group (a :class:`~hetero.embedding.group.TableGroup`):
    the lookup of rows held in this process."""

    def lookup_local(self, requests: list[Request], plan: LookupPlan | None = None) -> list[Tensor]: ...


class RowPlacement(enum.Enum):
    """Where a table group's rows live (see the module docstring)."""

    LOCAL = "local"
    ROW_SHARDED = "row_sharded"
    PARAMETER_SERVER = "parameter_server"
    SERVER_SHARD = "server_shard"

    @property
    def rows_here(self) -> bool:
        """Whether this process's storage holds all of the group's rows."""
        return self is RowPlacement.LOCAL


class RowSpace(enum.Enum):
    """What the row indices of a sparse gradient count.

    ``GROUP``: rows of the group's whole row space, ``[0, sum of vocab sizes)`` (for a group of one
    table, the table's ids); ``LOCAL``: rows of this process's storage (a row-sharded block's
    ``g - lo``, a server's hash shard's ``g // servers``). They coincide for a local group.
    """

    GROUP = "group"
    LOCAL = "local"


class RowExchange(abc.ABC):
    """How lookups of one table group reach its rows (``TableGroup.exchange``).

    Thread contract: called from the training thread (lookups inside forward; any collective a
    lookup runs must be entered by every rank in the same order).
    """

    placement: ClassVar[RowPlacement]

    @property
    @abc.abstractmethod
    def global_rows(self) -> int:
        """Rows of the whole group, over every process that holds a part."""

    @abc.abstractmethod
    def lookup(self, group: LocalLookup, requests: list[Request], plan: LookupPlan | None) -> list[Tensor]:
        """The outputs of ``requests`` (autograd-aware); ``plan``: one a prefetcher built, if any."""

    def starts_lookups(self) -> bool:
        """Whether :meth:`start` sends anything: lookups whose rows come from another process
        (a parameter server's pull) can be started before the caller needs them."""
        return False

    def start(self, plan: LookupPlan) -> None:
        """Start the lookup of ``plan`` (its rows on their way while the caller goes on); the
        :meth:`lookup` given the same ``plan`` takes them. Only where :meth:`starts_lookups`.

        Raises:
            TypeError: this exchange starts nothing ahead (:meth:`starts_lookups` is False; its
                rows are read at the lookup) - a caller's error, never a partial lookup.
        """
        raise TypeError(f"{type(self).__name__} starts no lookups ahead (starts_lookups() is False): "
                        f"its rows are read at the lookup; call start only where starts_lookups()")

    def clear(self) -> None:  # noqa: B027 - most exchanges keep nothing between steps
        """Forget lookups still waiting for their gradient (``zero_grad``)."""


class LocalRows(RowExchange):
    """Every row of the group is in this process (the default exchange)."""

    placement = RowPlacement.LOCAL

    def __init__(self, rows: int) -> None:
        self._rows = rows

    @property
    def global_rows(self) -> int:
        return self._rows

    def lookup(self, group: LocalLookup, requests: list[Request], plan: LookupPlan | None) -> list[Tensor]:
        return group.lookup_local(requests, plan)
