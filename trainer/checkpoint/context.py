"""What checkpointing needs to know about the run, besides the objects it saves and restores."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from models.llama import LlamaArgs
from trainer.checkpoint.identity import RunIdentity, new_run_id
from trainer.checkpoint.schema import schedule_values
from trainer.config import CheckpointConfig, Config, OptimizerConfig
from trainer.data.source import DataSource
from trainer.data.tokenizer import Tokenizer
from trainer.distributed.process_group import DistInfo


class TrainProgress(Protocol):
    """The loop's counters (trainer.train_state.TrainState): saved in extra.json, restored on resume."""

    step: int

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CheckpointContext:
    """The run's checkpoint settings, its ranks and layout, and the config that a resume reconciles.

    `optimizer` is the run's optimizer config: a resume compares the checkpoint's hyperparameters
    with it and says which are in force. `run` and `tokenizer` are what every checkpoint records
    of the run and of its tokenizer (trainer/checkpoint/identity.py); a resume checks them. `data` is
    what it records of the training data (trainer/data/source.py): a resume warns when it changed.
    """

    config: CheckpointConfig
    folder: Path
    rank: int
    world_size: int
    device: torch.device
    dp: int
    tp: int
    global_batch: int
    training_steps: int
    schedule: dict[str, Any]
    optimizer: OptimizerConfig
    model_args: LlamaArgs
    run: RunIdentity | None = None
    tokenizer: dict[str, Any] | None = None
    data: dict[str, Any] | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def for_run(
        cls, cfg: Config, model_args: LlamaArgs, ranks: DistInfo, dp: int, tp: int, global_batch: int,
        tokenizer: Tokenizer,
    ) -> CheckpointContext:
        # A collective: a fresh run's new id is rank 0's on every rank.
        new_id: list[Any] = [new_run_id()]
        dist.broadcast_object_list(new_id, src=0)
        return cls(
            config=cfg.checkpoint, folder=checkpoint_folder(cfg),
            rank=ranks.rank, world_size=ranks.world_size, device=ranks.device, dp=dp, tp=tp,
            global_batch=global_batch, training_steps=cfg.training.steps,
            schedule=schedule_values(cfg.lr_scheduler, cfg.training.steps), optimizer=cfg.optimizer, model_args=model_args,
            run=RunIdentity.of_dump_folder(Path(cfg.job.dump_folder), cfg.to_dict(), new_id[0]),
            tokenizer=tokenizer.identity(),
            data=DataSource(cfg.data.path, cfg.data.format).identity(),
        )


def checkpoint_folder(cfg: Config) -> Path:
    """checkpoint.folder as a path: relative to job.dump_folder unless absolute."""
    folder = Path(cfg.checkpoint.folder)
    return folder if folder.is_absolute() else Path(cfg.job.dump_folder) / folder


def first_problem(problem: str, world_size: int) -> str:
    """The first rank's non-empty `problem`, on every rank ('' when none has one).

    A collective: every rank calls it whatever happened, so a rank-local failure stops every
    rank together instead of leaving the others waiting in the next collective.
    """
    problems = [""] * world_size
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), "")
