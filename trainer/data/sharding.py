"""Pretraining rows tokenized once across the run: each rank its share, in worker processes.

Row ``i`` of an epoch is parsed and tokenized by participant ``i % size`` of the exchange
(``trainer.data.exchange``); every other participant only counts it. ``ShareReader``
produces a participant's share in blocks of ``BLOCK_ROWS`` rows, in ``num_workers``
worker processes ahead of use (or inline with 0). ``merged_rows`` then puts the stream
back together in rounds: each participant sends the entries of its rows in the round,
all receive all, and every participant walks the same global stream. Nothing in the
round structure depends on which rank runs it, so all participants agree on each round
without further messages, and a bad row or a read error reaches all of them in the same
round.
"""

import atexit
import ctypes
import functools
import math
import os
import signal
import sys
import weakref
from array import array
from collections.abc import Iterator
from typing import Any, NamedTuple

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainer.data.exchange import Exchange
from trainer.data.source import BadRow, DataSource, Location, Row
from trainer.data.tokenizer import Tokenizer
from trainer.errors import UserError

# Rows of one participant per worker item: large enough that passing items between
# processes (a fraction of a millisecond each) stays small next to tokenizing them, small
# enough that a resume re-reads little.
BLOCK_ROWS = 16
# Items each worker keeps ready: with typical documents several steps' worth of rows.
PREFETCH_BLOCKS = 8
# A round covers about one micro-batch group of tokens; this bounds its rows per participant
# (and the memory a round holds) when documents are tiny.
MAX_ROUND_ROWS = 4096
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class BadDoc(NamedTuple):
    """A row that could not be used, as the line naming it (``file:line: problem``)."""

    line: str


# A row's outcome: its document's tokens (BOS ... EOS), a bad row, or None for a row without text.
Entry = array | BadDoc | None


class Block(NamedTuple):
    """Consecutive rows of one participant's share; the last block of an epoch carries its row count."""

    epoch: int
    first: int
    entries: list[Entry]
    end: int | None


class Failure(NamedTuple):
    """A read that failed in a worker, as the one line to stop the run with."""

    message: str


class EpochEnd(NamedTuple):
    """Follows the last row of an epoch: the epoch's row count."""

    rows: int


def text_problem(row: Row, field: str) -> str | None:
    """What makes ``row`` unusable as a pretraining document, or None."""
    if isinstance(row, BadRow):
        return row.problem
    if row.get(field) is None:
        return f"missing field '{field}' (fields: {', '.join(map(str, row)) or 'none'})"
    if not isinstance(row[field], str):
        return f"field '{field}' must be a string, got {type(row[field]).__name__}"
    return None


class ShareReader(IterableDataset):
    """Participant ``rank``'s rows (``i % size == rank``) from row ``start`` of ``epoch`` on, forever.

    Its items are ``Block``s: block k of an epoch holds the participant's rows
    ``k*BLOCK_ROWS ...`` of that epoch; every epoch ends with a block (possibly empty)
    that carries the epoch's row count. With W worker processes, worker w makes items
    w, w+W, ... of that sequence and only parses their rows; torch's DataLoader takes
    items from its workers in turn, so they arrive in order.
    """

    def __init__(self, source: DataSource, tokenizer: Tokenizer, text_field: str, rank: int, size: int,
                 epoch: int, start: int) -> None:
        super().__init__()
        self.source = source
        self.tokenizer = tokenizer
        self.text_field = text_field
        self.rank = rank
        self.size = size
        self.epoch = epoch
        self.start = start

    def entry(self, loc: Location, row: Row) -> Entry:
        problem = text_problem(row, self.text_field)
        if problem is not None:
            return BadDoc(f"{self.source.locate(loc)}: {problem}")
        text = row[self.text_field]
        return array("i", self.tokenizer.encode(text, bos=True, eos=True)) if text.strip() else None

    def __iter__(self) -> Iterator[Block | Failure]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        try:
            yield from self._blocks(worker, workers)
        except UserError as e:
            yield Failure(str(e))

    def _blocks(self, worker: int, workers: int) -> Iterator[Block]:
        epoch, start, item = self.epoch, self.start, 0  # item: index of the epoch's first block
        size = self.size
        while True:
            first = start + (self.rank - start) % size

            def wanted(i: int, first: int = first, item: int = item) -> bool:
                j, other = divmod(i - first, size)
                return i >= first and other == 0 and (item + j // BLOCK_ROWS) % workers == worker

            entries: list[Entry] = []
            rows = start
            for rows, (loc, row) in enumerate(self.source.rows(start, wanted), start + 1):
                if row is None:
                    continue
                entries.append(self.entry(loc, row))
                if len(entries) == BLOCK_ROWS:
                    block = (rows - 1 - first) // size // BLOCK_ROWS
                    yield Block(epoch, first + size * BLOCK_ROWS * block, entries, None)
                    entries = []
            last = len(range(first, rows, size)) // BLOCK_ROWS
            if (item + last) % workers == worker:
                yield Block(epoch, first + size * BLOCK_ROWS * last, entries, rows)
            item += last + 1
            epoch, start = epoch + 1, 0


def _as_is(item: Any) -> Any:
    return item


def _init_worker(trainer_pid: int, worker_id: int) -> None:
    # A worker is a fork of the trainer. A launcher that signals the whole process group must
    # not stop it (or run the trainer's handlers in it): the trainer finishes its step, reads
    # on and shuts its workers down. And it must not outlive the trainer, which leaves with
    # os._exit (train.py): an orphaned worker with a batch in its pipe waits forever, keeping
    # the launcher's stdout open.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != trainer_pid:  # gone before prctl took effect
        os._exit(0)


# The worker pools of this process's share readers, for _kill_workers_at_exit.
_POOLS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _kill_workers_at_exit() -> None:
    # Registered after multiprocessing's own exit handler, so it runs first: that one stops
    # daemonic children with SIGTERM, which the workers ignore, and then joins them forever.
    for pool in list(_POOLS):
        for worker in getattr(pool, "_workers", ()):
            if worker.is_alive():
                worker.kill()


def read_share(reader: ShareReader, num_workers: int) -> Iterator[Block | Failure]:
    """The reader's blocks in order, made by ``num_workers`` worker processes (0: here, when needed)."""
    loader = DataLoader(
        reader, batch_size=None, num_workers=num_workers, collate_fn=_as_is,
        prefetch_factor=PREFETCH_BLOCKS if num_workers else None,
        worker_init_fn=functools.partial(_init_worker, os.getpid()) if num_workers else None,
    )
    blocks = iter(loader)
    if num_workers:
        _POOLS.add(blocks)
    return blocks


def _events(blocks: Iterator[Block | Failure], size: int) -> Iterator[Any]:
    """(epoch, row, entry or EpochEnd) of one participant's share, or a Failure."""
    for block in blocks:
        if isinstance(block, Failure):
            yield block
            return
        for t, entry in enumerate(block.entries):
            yield block.epoch, block.first + size * t, entry
        if block.end is not None:
            yield block.epoch, block.end, EpochEnd(block.end)


def merged_rows(
    blocks: Iterator[Block | Failure], exchange: Exchange, epoch: int, start: int, round_tokens: int
) -> Iterator[tuple[int, int, Entry | EpochEnd]]:
    """(epoch, row, entry) of every row in stream order from row ``start`` of ``epoch``, forever.

    ``blocks`` is this participant's share from that point; an ``EpochEnd`` follows each
    epoch's last row. A round takes rows ``[start, start + n * size)`` with n sized from
    the rows and tokens seen so far (the same on every participant) to cover about
    ``round_tokens``. A failure on any participant is raised on all of them.
    """
    size = exchange.size
    events = _events(blocks, size)
    pending: Any = None
    rows = tokens = 0
    while True:
        per_rank = 1 if tokens == 0 else min(MAX_ROUND_ROWS, math.ceil(round_tokens * rows / (tokens * size)))
        hi = start + per_rank * size
        entries: list[Entry] = []
        end = failure = None
        while True:
            if pending is None:
                pending = next(events)
            if isinstance(pending, Failure):
                failure = pending.message
                break
            _, row, entry = pending
            if isinstance(entry, EpochEnd):
                if row <= hi:
                    end, pending = row, None
                break
            if row >= hi:
                break
            entries.append(entry)
            pending = None
        messages = exchange.all_gather((entries, end, failure))
        for _, _, problem in messages:
            if problem is not None:
                raise UserError(problem)
        stop = hi if end is None else end
        shares = [iter(m[0]) for m in messages]
        for row in range(start, stop):
            entry = next(shares[row % size])
            rows += 1
            tokens += len(entry) if isinstance(entry, array) else 0
            yield epoch, row, entry
        if end is None:
            start = hi
        else:
            yield epoch, end, EpochEnd(end)
            epoch, start = epoch + 1, 0
