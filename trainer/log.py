"""The trainer's console: information on stdout, `warning: ...` on stderr, from rank 0 only by default.

Under torchrun every rank runs the same code, so an unguarded message comes out once per
rank. `info` and `warn` speak on rank 0 unless a call says `every_rank=True` (a message
about this rank alone, then prefixed with the rank). The rank is the process group's once
it exists, torchrun's RANK before that, so messages work from the first line of a launch.

Libraries keep their own mechanisms (`float8/` must not import the trainer; the data
workers are separate processes): `route_library_warnings` sends python warnings, warnings
logged to unconfigured loggers and those of the chatty libraries of ROUTED_LOGGERS through
`warn`, one line once each, so they add no raw lines beside an `error:` line; it keeps
torch's own log warnings to rank 0, where every rank would repeat them. The profiler's
progress lines (kineto's) are off unless KINETO_LOG_LEVEL is set.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

from trainer.launch import launch_rank, launch_world_size

_warned: set[str] = set()


def rank() -> int:
    """This process's rank: the process group's, or torchrun's RANK before the group exists (0 run directly)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return launch_rank()


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return launch_world_size()


def _text(message: str, every_rank: bool) -> str | None:
    """The line this rank prints, or None when it stays quiet."""
    if not every_rank:
        return message if rank() == 0 else None
    return f"rank {rank()}: {message}" if _world_size() > 1 else message


def info(message: str, *, every_rank: bool = False) -> None:
    """Print `message` on stdout (rank 0 only unless `every_rank`)."""
    line = _text(message, every_rank)
    if line is not None:
        print(line, flush=True)


def warn(message: str, *, every_rank: bool = False, once: bool = False) -> None:
    """Print `warning: <message>` on stderr (rank 0 only unless `every_rank`); `once`: not again in this process."""
    if once:
        if message in _warned:
            return
        _warned.add(message)
    line = _text(message, every_rank)
    if line is not None:
        print(f"warning: {line}", file=sys.stderr, flush=True)


def _one_line(record: logging.LogRecord) -> str:
    return " ".join(line.strip() for line in record.getMessage().strip().splitlines() if line.strip())


class _LibraryWarnings(logging.Handler):
    """Logged warnings of loggers with no handler of their own (python warnings included), via `warn`."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        warn(_one_line(record), once=True)


def _through_warn(record: logging.LogRecord) -> bool:
    """A filter for a library's logger and handlers: its warnings and errors go through `warn` instead."""
    if record.levelno < logging.WARNING:
        return True
    warn(_one_line(record), once=True, every_rank=record.levelno >= logging.ERROR)
    return False


def _below_error_on_rank_zero_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR or rank() == 0


# Libraries whose logged warnings come through `warn`: datasets (with a handler of its own) and
# torch's DTensor redistribution advice (through torch's handler, several lines' worth per call).
ROUTED_LOGGERS = ("datasets", "torch.distributed.tensor._redistribute")


def route_library_warnings() -> None:
    """Library warnings once, from rank 0: python warnings, other loggers' warnings, torch's log warnings.

    Call once the libraries are imported (torch and datasets install their log handlers on
    import; a library imported later needs another call); calling it again changes nothing.
    """
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # read when the profiler starts
    logging.captureWarnings(True)
    root = logging.getLogger()
    if not any(isinstance(h, _LibraryWarnings) for h in root.handlers):
        root.addHandler(_LibraryWarnings())
    for name in ROUTED_LOGGERS:
        logger = logging.getLogger(name)
        for filtered in (logger, *logger.handlers):
            if _through_warn not in filtered.filters:
                filtered.addFilter(_through_warn)
    # torch's loggers print through handlers of their own (set up on import), on every rank.
    for name, logger in logging.root.manager.loggerDict.items():
        if (name == "torch" or name.startswith("torch.")) and isinstance(logger, logging.Logger):
            for handler in logger.handlers:
                if _below_error_on_rank_zero_only not in handler.filters:
                    handler.addFilter(_below_error_on_rank_zero_only)
