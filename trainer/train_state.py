"""The loop's state besides model and optimizer: its counters, its seeding, and stop requests.

`TrainState` is what a checkpoint records of the loop (extra.json). `StopRequest` turns
SIGTERM/SIGINT/SIGHUP into a flag that every rank agrees on at the end of a step, so all ranks
finish the same step, save together and exit 0.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
from typing import Any

import torch
import torch.distributed as dist

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


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False


class StopRequest:
    """SIGTERM/SIGINT/SIGHUP (a closed terminal or SSH session) ask the run to stop after the current
    step; `agreed()` is a collective."""

    def __init__(self, device: torch.device, saving: bool) -> None:
        self.device = device
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
        flags = torch.tensor([int(self.requested), int(folder_gone)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, gone = flags.tolist()
        return bool(stop), bool(gone)


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
