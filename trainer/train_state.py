"""The loop's state besides model and optimizer: its counters, its seeding, and stop requests.

`TrainState` is what a checkpoint records of the loop (extra.json). `StopRequest` turns
SIGTERM/SIGINT into a flag that every rank agrees on at the end of a step, so all ranks
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
    """SIGTERM/SIGINT ask the run to stop after the current step; `agreed()` is a collective."""

    def __init__(self, device: torch.device, saving: bool) -> None:
        self.device = device
        self.saving = saving
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._request)
        signal.signal(signal.SIGINT, self._request)

    def _request(self, signum: int, frame: Any) -> None:
        self.requested = True
        # torchrun stopping this rank because a peer already printed its error is no request.
        if not reported_in_this_launch():
            then = "saving a checkpoint" if self.saving else "not saving (checkpointing disabled)"
            info(f"received signal {signum}: finishing this step, {then}, then exiting")

    def agreed(self) -> bool:
        """Whether any rank was asked to stop: every rank calls this at the same point of a step."""
        flag = torch.tensor(int(self.requested), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
