"""The loop's state besides model and optimizer: its counters, its progress, its seeding, and stop requests.

`TrainState` is what a checkpoint records of the loop (extra.json); `LoopProgress` is where the loop
stands, what the crash handler reads to save the last completed step. `StopRequest` turns
SIGTERM/SIGINT/SIGHUP into a flag that every rank agrees on at the end of a step, so all ranks
finish the same step, save together and exit 0.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
from collections.abc import Callable
from typing import Any

import torch

from trainer.errors import reported_in_this_launch
from trainer.log import info


@dataclasses.dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.tokens_seen = int(sd["tokens_seen"])


@dataclasses.dataclass
class LoopProgress:
    """Where the loop stands: the checkpointed counters, the loader state a save of the last counted step
    records, and this run's own counts (not checkpointed: a resumed run counts afresh)."""

    counters: TrainState
    # The loader state after the batches of the step being run (or last counted): what a checkpoint of
    # that step records, although the next step's batches are read meanwhile. None until the loop reads.
    data_state: dict[str, Any] | None = None
    first_step: int = 0
    start_time: float = 0.0
    skipped_total: int = 0
    skipped_in_a_row: int = 0

    def begin(self, now: float) -> None:
        """The loop starts (after any resume) at the step after the counters'."""
        self.first_step, self.start_time = self.counters.step + 1, now

    def count(self, step: int, applied: bool, tokens: int) -> None:
        """A step ran on `tokens` tokens: an applied one moves the step on, a skipped one is counted."""
        self.counters.tokens_seen += tokens
        if applied:
            self.counters.step = step
            self.skipped_in_a_row = 0
        else:
            self.skipped_total += 1
            self.skipped_in_a_row += 1


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False


class StopRequest:
    """SIGTERM/SIGINT/SIGHUP (a closed terminal or SSH session) ask the run to stop after the current
    step; `agreed()` is a collective: `all_gather` is the ranks' host exchange's (trainer/data/exchange.py)."""

    def __init__(self, all_gather: Callable[[Any], list[Any]], saving: bool) -> None:
        self.all_gather = all_gather
        self.saving = saving
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._request)
        signal.signal(signal.SIGINT, self._request)
        signal.signal(signal.SIGHUP, self._request)

    def _request(self, signum: int, frame: Any) -> None:
        self.requested = True
        if signum == signal.SIGHUP:
            _detach_from_closed_terminal()
        # torchrun stopping this rank because a peer already printed its error is no request.
        if not reported_in_this_launch():
            then = "saving a checkpoint" if self.saving else "not saving (checkpointing disabled)"
            info(f"received signal {signum}: finishing this step, {then}, then exiting")

    def agreed(self, folder_gone: bool = False) -> tuple[bool, bool]:
        """Whether any rank was asked to stop, and whether any rank found the dump folder gone
        (`folder_gone`, rank 0's finding): every rank calls this at the same point of a step."""
        # Host messages over gloo: reading them waits for the other ranks' hosts, never for this rank's
        # device, which is still running the step's update.
        flags = self.all_gather((self.requested, folder_gone))
        return any(stop for stop, _ in flags), any(gone for _, gone in flags)


def _detach_from_closed_terminal() -> None:
    """After SIGHUP, writes to the terminal that was closed fail (EIO) and would end the run before
    its save: stdout and stderr that are a terminal go to /dev/null instead (files and pipes stay)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            if os.isatty(fd):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)
