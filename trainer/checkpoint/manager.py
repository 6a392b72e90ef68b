"""Distributed checkpoints (DCP): save atomically, resume exactly.

Layout under ``checkpoint.folder``::

    step-N/            a complete checkpoint: DCP shards + .metadata, extra.json, rng/, checksums.json
    step-N.partial/    being written; never loaded, removed at startup and by the next save
    final/             model-only export (model.safetensors + params.json, trainer/checkpoint/export.py)

A checkpoint becomes visible only by the rename of ``step-N.partial`` to ``step-N``,
done by rank 0 after every rank finished writing, so a process killed mid-save
leaves the previous checkpoint as the latest complete one (trainer/checkpoint/folder.py).
A ``step-N`` folder that is not loadable is therefore damage, and is reported instead of
skipped (trainer/checkpoint/load.py).

DCP holds only tensors (trainer/checkpoint/state.py); everything else is JSON in
``extra.json`` (trainer/checkpoint/schema.py) and RNG states are safetensors
(trainer/checkpoint/rng.py), so loading never unpickles anything.

``checksums.json`` (see ``trainer/checkpoint/checksums.py``) lists every file's CRC-32, computed once
every rank finished writing and before the rename, and checked before a resume loads any
tensor. A save that fails (a full disk, any I/O error) removes its partial folder and
stops the run with one line; the earlier checkpoints stay as they were.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LRScheduler

from trainer.checkpoint import checksums
from trainer.checkpoint.context import CheckpointContext, TrainProgress, first_problem
from trainer.checkpoint.dcp_reader import describe_error
from trainer.checkpoint.export import export_final
from trainer.checkpoint.folder import (
    checkpoint_bytes,
    format_bytes,
    free_bytes,
    leftovers,
    remove,
    rotate,
    set_aside_newer,
    step_folders,
    warn_if_short_of_space,
)
from trainer.checkpoint.identity import check_owner
from trainer.checkpoint.initial_weights import load_initial_weights
from trainer.checkpoint.load import load_checkpoint
from trainer.checkpoint.rng import save_rng
from trainer.checkpoint.schema import EXTRA_FILE
from trainer.checkpoint.state import ModelAndOptimizer, nonfinite_weights
from trainer.errors import UserError
from trainer.log import info


class CheckpointManager:
    """Saves the run's objects at the configured steps and restores them, or the initial weights, at startup.

    The objects are restored in place. The dataloader's state to save is passed to each save:
    the loop reads the next step's batches before the current step is saved.
    """

    def __init__(
        self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: LRScheduler,
        dataloader: Stateful, train_state: TrainProgress, context: CheckpointContext,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dataloader = dataloader
        self.train_state = train_state
        self.context = context
        self.cfg = context.config
        self.folder = context.folder
        self.last_loaded: Path | None = None
        # After a rollback (checkpoint.load_step): the newer steps of the run it replaces.
        self.rolled_back_from: list[int] = []
        # After a resume: the checkpoint's optimizer settings, in force whatever the config says.
        self.optimizer_in_force: dict[str, Any] = {}
        self._pending: tuple[Any, Path, Path, float, int] | None = None
        self._last_saved_step = -1
        # Async saves run their collectives on a gloo group of their own, in a background
        # thread: they must not interleave with the training collectives of the main thread.
        self._pg = dist.new_group(backend="gloo") if self.cfg.enable and self.cfg.async_mode == "async" else None

    # -- save ----------------------------------------------------------------

    def maybe_save(self, dataloader_state: dict[str, Any], force: bool = False) -> None:
        """Called after every step: publish a finished async save, save at the interval or when forced."""
        if not self.cfg.enable:
            return
        self._poll_pending()
        step = self.train_state.step
        if step == self._last_saved_step:
            return
        if force or step % self.cfg.interval == 0:
            self.save(step, dataloader_state)

    def save(self, step: int, dataloader_state: dict[str, Any]) -> None:
        """Write ``step-N`` (in the background with async_mode = "async"); a collective of every rank."""
        self._finish_pending()
        ctx = self.context
        # The loop never applies a non-finite step; this is the last line of defence, before
        # anything is written or rotated away, so every published checkpoint is loadable and healthy.
        bad = nonfinite_weights(self.model)
        dist.all_reduce(bad)
        if bad.item():
            raise UserError(
                f"step {step}: the model holds non-finite weights, so no checkpoint of it is saved; "
                "lower optimizer.lr or raise lr_scheduler.warmup_steps"
            )
        start = time.perf_counter()
        final = self.folder / f"step-{step}"
        partial = self.folder / f"step-{step}.partial"
        if ctx.is_main:
            self.folder.mkdir(parents=True, exist_ok=True)
            for stale in leftovers(self.folder):
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()
        app = ModelAndOptimizer(self.model, self.optimizer)
        state = {"app": app.state_dict()}
        try:
            save_rng(partial, ctx.rank)
            if ctx.is_main:
                self._write_extra(partial, app.saved_param_groups, dataloader_state)
            problem = ""
        except (OSError, RuntimeError) as e:  # safetensors reports write errors as RuntimeError
            problem = describe_error(e)
        # A rank-local failure must stop every rank before the collective write.
        problem = first_problem(problem, ctx.world_size)
        if problem:
            self._fail_save(step, partial, problem)
        try:
            if self.cfg.async_mode == "async":
                # async_save copies the tensors to host memory before it returns; training goes on
                # while a background thread writes them.
                future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self._pg)
                self._pending = (future, partial, final, start, step)
            else:
                dcp.save(state, checkpoint_id=str(partial))
        except (OSError, RuntimeError, CheckpointException) as e:
            # DCP gathers every rank's write result, so all ranks get here together. A full
            # disk shows as whatever write failed first (e.g. torch's "unexpected pos").
            self._fail_save(step, partial, describe_error(e))
        if self._pending is not None:
            if ctx.is_main:
                info(f"checkpoint step-{step}: staged in {time.perf_counter() - start:.1f}s, "
                     "writing in the background")
        else:
            self._publish(partial, final, start, step)
        self._last_saved_step = step

    def _write_extra(self, partial: Path, param_groups: list[dict[str, Any]], dataloader_state: dict[str, Any]) -> None:
        ctx = self.context
        extra = {
            "train_state": self.train_state.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "optimizer_param_groups": param_groups,
            "dataloader": dataloader_state,
            "global_batch": ctx.global_batch,
            "world_size": ctx.world_size,
            "dp": ctx.dp,
            "tp": ctx.tp,
            "schedule": ctx.schedule,
        }
        if ctx.run is not None:
            extra["run"] = ctx.run.record()
        if ctx.tokenizer is not None:
            extra["tokenizer"] = ctx.tokenizer
        if ctx.data is not None:
            extra["data"] = ctx.data
        (partial / EXTRA_FILE).write_text(json.dumps(extra))

    def _poll_pending(self) -> None:
        """Publish an async save as soon as every rank finished writing it."""
        if self._pending is None:
            return
        done = torch.tensor(int(self._pending[0].done()), device=self.context.device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            self._finish_pending()

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        future, partial, final, start, step = self._pending
        self._pending = None
        try:
            future.result()
        except (OSError, RuntimeError, CheckpointException) as e:
            self._fail_save(step, partial, describe_error(e))
        self._publish(partial, final, start, step)

    def _fail_save(self, step: int, partial: Path, cause: str) -> NoReturn:
        """Remove the partial folder of a save that failed on any rank, and stop with one line."""
        free = free_bytes(self.folder)  # before the removal: what the write ran into
        dist.barrier()
        if self.context.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier()
        raise UserError(
            f"checkpoint step-{step} could not be written to {partial} ({cause}); the disk had "
            f"{format_bytes(free)} free, a checkpoint needs about {format_bytes(checkpoint_bytes(self.model))}; "
            f"the incomplete checkpoint was removed and {self._latest_complete()}"
        )

    def _latest_complete(self) -> str:
        done = step_folders(self.folder)
        return f"step-{max(done)} is the latest complete one" if done else "no complete checkpoint exists yet"

    def save_after_failure(self, data_state: dict[str, Any] | None) -> str:
        """After an unexpected failure: save the last completed step if the objects hold exactly it; says
        what was done (a clause of the error line), never raises.

        They do from the loop's counting of a step until the next starts: the LR schedule has taken the
        counted steps, and the loader has read the next batches past `data_state` (unless it was the last
        step). A single process only: a save is a collective, and a failed run's other ranks are elsewhere.
        """
        if not self.cfg.enable:
            return "no checkpoint (checkpointing disabled)"
        step = self.train_state.step
        try:
            if step == self._last_saved_step:
                return f"step-{step} was saved before the failure"
            if self.context.world_size > 1:
                return f"no checkpoint saved (a save needs every rank); {self._latest_complete()}"
            completed = data_state is not None and self.lr_scheduler.last_epoch == step and (
                self.dataloader.state_dict() != data_state or step == self.context.training_steps)
            if not completed or step == 0:
                return f"no checkpoint saved (it failed in the middle of a step); {self._latest_complete()}"
            self.save(step, data_state)
            self.close()
        except Exception as e:
            return f"no checkpoint saved ({describe_error(e)})"
        return f"checkpoint of step {step} saved"

    def _write_checksums(self, step: int, partial: Path) -> None:
        """checksums.json of every file in `partial`, the files hashed in shares by all ranks."""
        ctx = self.context
        names: list[Any] = [checksums.list_files(partial) if ctx.is_main else None]
        dist.broadcast_object_list(names, src=0)
        mine: dict[str, Any] = {}
        problem = ""
        try:
            mine = checksums.describe(partial, names[0][ctx.rank :: ctx.world_size])
        except OSError as e:
            problem = describe_error(e)
        shares: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(shares, (mine, problem))
        problem = next((p for _, p in shares if p), "")
        if not problem and ctx.is_main:
            try:
                checksums.write(partial, dict(sorted((k, v) for share, _ in shares for k, v in share.items())))
            except OSError as e:
                problem = describe_error(e)
        problem = first_problem(problem, ctx.world_size)
        if problem:
            self._fail_save(step, partial, problem)

    def _publish(self, partial: Path, final: Path, start: float, step: int) -> None:
        dist.barrier()  # every rank finished writing its files
        hashed = ""
        if self.cfg.verify_checksums:
            hash_start = time.perf_counter()
            self._write_checksums(step, partial)
            hashed = f", checksums {time.perf_counter() - hash_start:.1f}s"
        if self.context.is_main:
            if final.exists():
                remove(final)
            os.replace(partial, final)
            rotate(self.folder, self.cfg.keep_latest_k, final)
            info(f"checkpoint saved: {final} ({time.perf_counter() - start:.1f}s{hashed})")
        dist.barrier()

    def close(self) -> None:
        """Wait for an async save still being written, and publish it."""
        self._finish_pending()

    # -- load ----------------------------------------------------------------

    def load_latest(self) -> bool:
        """Resume from the chosen checkpoint if one exists, else load the initial weights if configured.

        Returns whether a checkpoint was resumed.
        """
        ctx = self.context
        path = self._checkpoint_to_resume()
        if path is not None and ctx.run is not None:
            # Before anything in the folder is touched: it may be another run's.
            check_owner(path, self.folder, ctx.run, self.cfg.resume_from_other_run)
        if self.context.is_main:
            set_aside_newer(self.folder, self.rolled_back_from, self.cfg.load_step)
        if self.cfg.enable and ctx.is_main:
            for stale in leftovers(self.folder):
                shutil.rmtree(stale, ignore_errors=True)
                if stale.suffix == ".partial":
                    info(f"removed the unfinished checkpoint {stale} (left by a run stopped while saving it)")
        if path is not None:
            self.optimizer_in_force = load_checkpoint(
                path, model=self.model, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                dataloader=self.dataloader, train_state=self.train_state, context=ctx,
            )
            self.last_loaded = path
        elif self.cfg.initial_load_path:
            load_initial_weights(self.model, ctx.model_args, self.cfg.initial_load_path, self.cfg.initial_load_format,
                                 ctx.rank, ctx.world_size, ctx.tokenizer)
        if self.cfg.enable and ctx.is_main:
            warn_if_short_of_space(self.folder, checkpoint_bytes(self.model), self.train_state.step,
                                   ctx.training_steps, self.cfg.interval, self.cfg.keep_latest_k)
            if ctx.run is not None:
                ctx.run.keep()
        return path is not None

    def _checkpoint_to_resume(self) -> Path | None:
        """checkpoint.load_step's checkpoint, else the latest one; None when checkpointing is off or none exists."""
        if not self.cfg.enable:
            return None
        found = step_folders(self.folder)
        load_step = self.cfg.load_step
        if load_step < 0:
            return found[max(found)] if found else None
        if load_step not in found:
            have = ", ".join(str(s) for s in found) or "none"
            raise UserError(f"checkpoint.load_step = {load_step}: no such checkpoint in {self.folder} (found: {have})")
        self.rolled_back_from = [s for s in found if s > load_step]
        return found[load_step]

    # -- export --------------------------------------------------------------

    def maybe_export_final(self) -> None:
        """Model-only export in checkpoint.export_dtype, once the run reached training.steps.

        A run stopped early has no final model.
        """
        if self.cfg.export_final and self.train_state.step >= self.context.training_steps:
            export_final(self.model, self.context.model_args, self.folder / "final", self.cfg.export_dtype,
                         self.context.rank, self.context.tokenizer)
