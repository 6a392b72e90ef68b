"""How the processes of a run share what each of them read: one all-gather per round of rows.

Every rank reads and tokenizes a share of the rows (``trainer.data.sharding``) and sends
the result to all the others, so each rank ends up with the whole stream having done
1/world of the work. An ``Exchange`` is the group of participants doing that: the ranks
of a run over a gloo group (``world_exchange``), one process alone (``LocalExchange``),
or threads of one process standing in for ranks (``ThreadExchange``, for tests and
``scripts/bench_data.py``).
"""

import threading
from typing import Any, Protocol

import torch.distributed as dist


class Exchange(Protocol):
    """``size`` participants; each calls ``all_gather`` the same number of times, in step."""

    rank: int
    size: int

    def all_gather(self, message: Any) -> list[Any]:
        """Every participant's message, in rank order."""
        ...


class LocalExchange:
    """One participant: this process reads every row itself."""

    rank = 0
    size = 1

    def all_gather(self, message: Any) -> list[Any]:
        return [message]


class ProcessGroupExchange:
    """The ranks of a process group. Messages are pickled: they come from this run's own ranks."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_gather(self, message: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, message, group=self.group)
        return out


def world_exchange() -> Exchange:
    """All ranks of this run; call it on every rank at the same point (it creates a process group).

    The group is gloo whatever the training backend: messages are host memory, and the
    exchange must neither wait on the device nor interleave with the training's collectives.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return LocalExchange()
    return ProcessGroupExchange(dist.new_group(backend="gloo"))


class ThreadExchange:
    """``size`` participants that are threads of this process; ``member(r)`` is rank r's handle."""

    def __init__(self, size: int, timeout_s: float = 300.0) -> None:
        self.size = size
        self._slots: list[Any] = [None] * size
        # A participant that fails breaks the barrier for the others instead of hanging them.
        self._barrier = threading.Barrier(size, timeout=timeout_s)

    def member(self, rank: int) -> Exchange:
        return _ThreadMember(self, rank)

    def _all_gather(self, rank: int, message: Any) -> list[Any]:
        self._slots[rank] = message
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before all have read this round
        return out

    def abort(self) -> None:
        self._barrier.abort()


class _ThreadMember:
    def __init__(self, exchange: ThreadExchange, rank: int) -> None:
        self.exchange = exchange
        self.rank = rank
        self.size = exchange.size

    def all_gather(self, message: Any) -> list[Any]:
        return self.exchange._all_gather(self.rank, message)
