"""Distributed checkpoints (DCP): save atomically, resume exactly, load initial weights.

Layout under ``checkpoint.folder``::

    step-N/            a complete checkpoint: DCP shards + .metadata, extra.json, rng/, checksums.json
    step-N.partial/    being written; never loaded, removed at startup and by the next save
    final/             model-only export (model.safetensors + params.json)

A checkpoint becomes visible only by the rename of ``step-N.partial`` to ``step-N``,
done by rank 0 after every rank finished writing, so a process killed mid-save
leaves the previous checkpoint as the latest complete one. Old checkpoints are
renamed away before they are deleted for the same reason. A ``step-N`` folder that
is not loadable is therefore damage, and is reported instead of skipped.

DCP holds only tensors (model, optimizer moments and steps). Everything else (step,
tokens seen, LR schedule, optimizer hyperparameters, dataloader position) is JSON in
``extra.json`` and RNG states are safetensors, so loading never unpickles anything:
DCP would otherwise pickle non-tensor entries and load them with
``torch.load(weights_only=False)``.

``checksums.json`` (see ``trainer/checksums.py``) lists every file's CRC-32, computed once
every rank finished writing and before the rename, and checked before a resume loads any
tensor. A save that fails (a full disk, any I/O error) removes its partial folder and
stops the run with one line; the earlier checkpoints stay as they were.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from trainer import checksums
from trainer.errors import UserError
from trainer.metrics import warn
from trainer.weights import (
    SafeFileSystemReader,
    check_model_keys,
    dcp_model_shapes,
    describe_error,
    read_dcp_metadata,
)

if TYPE_CHECKING:
    from trainer.config import Config
    from trainer.trainer import Trainer

_STEP_DIR = re.compile(r"^step-(\d+)$")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_MODEL_PREFIX = "app.model."
EXTRA_KEYS = (
    "train_state", "lr_scheduler", "optimizer_param_groups", "dataloader", "global_batch", "world_size", "dp", "tp",
)
# Optional in extra.json (older checkpoints lack them): the schedule the checkpoint was trained with.
SCHEDULE_KEYS = ("lr_scheduler.warmup_steps", "lr_scheduler.decay", "lr_scheduler.min_lr_ratio", "training.steps")
# AdamW fills in its other hyperparameters (foreach, fused, amsgrad, ...) when a group lacks them.
_GROUP_REQUIRED = ("params", "lr", "betas", "eps", "weight_decay")


class _ModelAndOptimizer(Stateful):
    """Sharded model + optimizer tensors in fully qualified names, independent of the layout.

    The optimizer's param_groups (hyperparameters and the current lr) are not tensors:
    ``state_dict`` leaves them in ``saved_param_groups`` for the caller to store as JSON,
    and ``load_state_dict`` takes them from ``param_groups_to_load``.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
        param_groups_to_load: list[dict[str, Any]] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.saved_param_groups: list[dict[str, Any]] = []
        self.param_groups_to_load = param_groups_to_load or []

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        self.saved_param_groups = optim_sd["param_groups"]
        return {"model": model_sd, "optimizer": {"state": optim_sd["state"]}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        optim_sd = {"state": sd["optimizer"]["state"], "param_groups": self.param_groups_to_load}
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=optim_sd)


def _param_groups_from_json(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # JSON turns tuples (AdamW's betas) into lists; give the optimizer back what it wrote.
    return [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in groups]


def step_folders(folder: Path) -> dict[int, Path]:
    """step -> path of each published checkpoint (``step-N``) in `folder`, oldest first."""
    if not folder.is_dir():
        return {}
    found = {}
    for p in folder.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def _remove(path: Path) -> None:
    """Rename, then delete: a kill mid-delete leaves no half-deleted ``step-N``."""
    trash = path.with_name(path.name + ".deleting")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_bytes(folder: Path) -> int:
    """Free space of the disk that holds `folder`, or would hold it once created."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """Estimated size of one checkpoint: the weights and AdamW's two moments, each of the weights' dtype.

    Parameters are DTensors under FSDP / TP, whose numel is the full (global) one.
    """
    return sum(3 * p.numel() * p.dtype.itemsize for p in model.parameters())


def checkpoints_to_hold(saves: int, keep_latest_k: int, existing: int) -> int:
    """How many more checkpoints the disk must hold at once for a run that writes `saves` of them.

    Old ones are rotated away only after a new one is published: with keep_latest_k = K the
    folder peaks at K + 1, of which the `existing` ones already take their space.
    """
    if keep_latest_k <= 0:
        return saves
    return min(saves, max(1, keep_latest_k + 1 - existing))


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def nonfinite_weights(model: torch.nn.Module) -> torch.Tensor:
    """How many of this rank's (local shards of) parameters are NaN or infinite, as a device tensor."""
    count = torch.zeros((), dtype=torch.int64, device=next(model.parameters()).device)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            count += (~torch.isfinite(local)).sum()
    return count


def read_extra(path: Path) -> dict[str, Any]:
    """extra.json of a checkpoint, checked; a one-line UserError when missing or damaged."""
    f = path / "extra.json"
    if not f.is_file():
        raise UserError(f"checkpoint {path} is incomplete: extra.json is missing (delete the folder to start from an older one)")
    try:
        extra = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"checkpoint {path}: extra.json is unreadable ({describe_error(e)})") from None
    missing = [k for k in EXTRA_KEYS if not isinstance(extra, dict) or k not in extra]
    if missing:
        raise UserError(f"checkpoint {path}: extra.json lacks '{missing[0]}'")
    return extra


def schedule_values(cfg: Config) -> dict[str, Any]:
    """The config's SCHEDULE_KEYS as ``{"section.key": value}``."""
    return {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in SCHEDULE_KEYS}


class _FieldError(Exception):
    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"field '{where}' {problem}")


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:60] + "..."


def _check_like(value: Any, template: Any, where: str) -> None:
    """`value`, read from JSON, has the structure and kinds of `template`, a live state_dict.

    Integers must be >= 0: every integer in these states is a count or a position.
    Strings must be equal: they name a data kind or a parameter.
    """
    if isinstance(template, dict):
        if not isinstance(value, dict):
            raise _FieldError(where, f"must be an object, got {_show(value)}")
        for key in template:
            if key not in value:
                raise _FieldError(where, f"lacks '{key}'")
        for key in value:
            if key not in template:
                raise _FieldError(f"{where}.{key}", "is unknown to this trainer")
        for key, sub in template.items():
            _check_like(value[key], sub, f"{where}.{key}")
    elif isinstance(template, (list, tuple)):
        if not isinstance(value, list) or len(value) != len(template):
            raise _FieldError(where, f"must be a list of {len(template)} entries, got {_show(value)}")
        for i, (v, sub) in enumerate(zip(value, template)):
            _check_like(v, sub, f"{where}[{i}]")
    elif template is None:
        if value is not None:
            raise _FieldError(where, f"must be null, got {_show(value)}")
    elif isinstance(template, bool):
        if not isinstance(value, bool):
            raise _FieldError(where, f"must be true or false, got {_show(value)}")
    elif isinstance(template, int):
        if type(value) is not int or value < 0:
            raise _FieldError(where, f"must be an integer >= 0, got {_show(value)}")
    elif isinstance(template, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _FieldError(where, f"must be a finite number, got {_show(value)}")
    elif value != template:
        raise _FieldError(where, f"must be {_show(template)}, got {_show(value)}")


def _check_param_groups(groups: Any, template: list[dict[str, Any]], where: str) -> None:
    """Saved optimizer param_groups against the live ones (from ``get_state_dict``)."""
    if not isinstance(groups, list) or len(groups) != len(template):
        raise _FieldError(where, f"must be a list of {len(template)} parameter groups, got {_show(groups)}")
    for i, (group, live) in enumerate(zip(groups, template)):
        here = f"{where}[{i}]"
        if not isinstance(group, dict):
            raise _FieldError(here, f"must be an object, got {_show(group)}")
        for key in _GROUP_REQUIRED:
            if key not in group:
                raise _FieldError(here, f"lacks '{key}'")
        for key, value in group.items():
            if key not in live:
                raise _FieldError(f"{here}.{key}", "is unknown to this optimizer")
            if live[key] is None or isinstance(live[key], bool):
                # Implementation flags (foreach, fused) may change between runs; AdamW takes either.
                if value is not None and not isinstance(value, bool):
                    raise _FieldError(f"{here}.{key}", f"must be true, false or null, got {_show(value)}")
            else:
                _check_like(value, live[key], f"{here}.{key}")


class CheckpointManager:
    """Saves and restores a Trainer's full state; loads initial weights for fresh runs."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        cfg = trainer.cfg.checkpoint
        self.cfg = cfg
        folder = Path(cfg.folder)
        self.folder = folder if folder.is_absolute() else Path(trainer.cfg.job.dump_folder) / folder
        self.last_loaded: Path | None = None
        self._pending: tuple[Any, Path, Path, float, int] | None = None
        self._last_saved_step = -1
        # Async saves run their collectives on a gloo group of their own, in a background
        # thread: they must not interleave with the training collectives of the main thread.
        self._pg = dist.new_group(backend="gloo") if cfg.enable and cfg.async_mode == "async" else None

    def _global_batch(self) -> int:
        t = self.trainer.cfg.training
        return t.batch_size * self.trainer.dp * t.gradient_accumulation_steps

    # -- save ----------------------------------------------------------------

    def maybe_save(self, force: bool = False) -> None:
        """Called after every step: publish a finished async save, save at the interval or when forced."""
        if not self.cfg.enable:
            return
        self._poll_pending()
        step = self.trainer.state.step
        if step == self._last_saved_step:
            return
        if force or step % self.cfg.interval == 0:
            self.save(step)

    def save(self, step: int) -> None:
        self._finish_pending()
        t = self.trainer
        # The loop never applies a non-finite step; this is the last line of defence, before
        # anything is written or rotated away, so every published checkpoint is loadable and healthy.
        bad = nonfinite_weights(t.model)
        dist.all_reduce(bad)
        if bad.item():
            raise UserError(
                f"step {step}: the model holds non-finite weights, so no checkpoint of it is saved; "
                "lower optimizer.lr or raise lr_scheduler.warmup_steps"
            )
        start = time.perf_counter()
        final = self.folder / f"step-{step}"
        partial = self.folder / f"step-{step}.partial"
        if t.is_main:
            self.folder.mkdir(parents=True, exist_ok=True)
            # Leftovers of a process killed while saving or deleting.
            for stale in [*self.folder.glob("step-*.partial"), *self.folder.glob("step-*.deleting")]:
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()
        app = _ModelAndOptimizer(t.model, t.optimizer)
        state = {"app": app.state_dict()}
        try:
            (partial / "rng").mkdir(parents=True, exist_ok=True)
            save_file(_rng_state(), str(partial / "rng" / f"rank-{t.dist.rank}.safetensors"))
            if t.is_main:
                self._write_extra(partial, app)
            problem = ""
        except (OSError, RuntimeError) as e:  # safetensors reports write errors as RuntimeError
            problem = describe_error(e)
        # A rank-local failure must stop every rank before the collective write.
        problem = self._first_problem(problem)
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
            if t.is_main:
                print(f"checkpoint step-{step}: staged in {time.perf_counter() - start:.1f}s, "
                      "writing in the background", flush=True)
        else:
            self._publish(partial, final, start, step)
        self._last_saved_step = step

    def _write_extra(self, partial: Path, app: _ModelAndOptimizer) -> None:
        t = self.trainer
        extra = {
            "train_state": t.state.state_dict(),
            "lr_scheduler": t.lr_scheduler.state_dict(),
            "optimizer_param_groups": app.saved_param_groups,
            "dataloader": t.data_state,
            "global_batch": self._global_batch(),
            "world_size": t.dist.world_size,
            "dp": t.dp,
            "tp": t.tp,
            "schedule": schedule_values(t.cfg),
        }
        (partial / "extra.json").write_text(json.dumps(extra))

    def _poll_pending(self) -> None:
        """Publish an async save as soon as every rank finished writing it."""
        if self._pending is None:
            return
        done = torch.tensor(int(self._pending[0].done()), device=self.trainer.device)
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

    def _first_problem(self, problem: str) -> str:
        """The first rank's non-empty `problem`, on every rank ('' when none has one)."""
        problems = [""] * self.trainer.dist.world_size
        dist.all_gather_object(problems, problem)
        return next((p for p in problems if p), "")

    def _fail_save(self, step: int, partial: Path, cause: str) -> NoReturn:
        """Remove the partial folder of a save that failed on any rank, and stop with one line."""
        t = self.trainer
        free = free_bytes(self.folder)  # before the removal: what the write ran into
        dist.barrier()
        if t.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier()
        done = step_folders(self.folder)
        latest = f"step-{max(done)} is the latest complete one" if done else "no complete checkpoint exists yet"
        raise UserError(
            f"checkpoint step-{step} could not be written to {partial} ({cause}); the disk had "
            f"{format_bytes(free)} free, a checkpoint needs about {format_bytes(checkpoint_bytes(t.model))}; "
            f"the incomplete checkpoint was removed and {latest}"
        )

    def _write_checksums(self, step: int, partial: Path) -> None:
        """checksums.json of every file in `partial`, the files hashed in shares by all ranks."""
        t = self.trainer
        names: list[Any] = [checksums.list_files(partial) if t.is_main else None]
        dist.broadcast_object_list(names, src=0)
        mine: dict[str, Any] = {}
        problem = ""
        try:
            mine = checksums.describe(partial, names[0][t.dist.rank :: t.dist.world_size])
        except OSError as e:
            problem = describe_error(e)
        shares: list[Any] = [None] * t.dist.world_size
        dist.all_gather_object(shares, (mine, problem))
        problem = next((p for _, p in shares if p), "")
        if not problem and t.is_main:
            try:
                checksums.write(partial, dict(sorted((k, v) for share, _ in shares for k, v in share.items())))
            except OSError as e:
                problem = describe_error(e)
        problem = self._first_problem(problem)
        if problem:
            self._fail_save(step, partial, problem)

    def _publish(self, partial: Path, final: Path, start: float, step: int) -> None:
        dist.barrier()  # every rank finished writing its files
        hashed = ""
        if self.cfg.verify_checksums:
            hash_start = time.perf_counter()
            self._write_checksums(step, partial)
            hashed = f", checksums {time.perf_counter() - hash_start:.1f}s"
        if self.trainer.is_main:
            if final.exists():
                _remove(final)
            os.replace(partial, final)
            if self.cfg.keep_latest_k > 0:
                # Oldest first, never the one just written (after a load_step resume, newer
                # checkpoints of the abandoned run may exist).
                others = [p for p in step_folders(self.folder).values() if p != final]
                for old in others[: max(len(others) - self.cfg.keep_latest_k + 1, 0)]:
                    _remove(old)
            print(f"checkpoint saved: {final} ({time.perf_counter() - start:.1f}s{hashed})", flush=True)
        dist.barrier()

    def close(self) -> None:
        self._finish_pending()

    # -- load ----------------------------------------------------------------

    def load_latest(self) -> bool:
        """Resume from the chosen checkpoint if one exists; else load initial weights if configured."""
        found = step_folders(self.folder) if self.cfg.enable else {}
        if self.cfg.enable and self.cfg.load_step >= 0:
            if self.cfg.load_step not in found:
                have = ", ".join(str(s) for s in found) or "none"
                raise UserError(
                    f"checkpoint.load_step = {self.cfg.load_step}: no such checkpoint in {self.folder} "
                    f"(found: {have})"
                )
            path = found[self.cfg.load_step]
            newer = [s for s in found if s > self.cfg.load_step]
            if newer and self.trainer.is_main:
                warn(
                    f"checkpoint.load_step = {self.cfg.load_step}: newer checkpoints ({', '.join(map(str, newer))}) "
                    f"in {self.folder} belong to the run being replaced; a restart without load_step would "
                    "resume from them, so delete them once this run has saved"
                )
        elif found:
            path = found[max(found)]
        else:
            path = None
        if self.cfg.enable:
            self._remove_unfinished()
        if path is not None:
            self._load(path)
            self.last_loaded = path
        elif self.cfg.initial_load_path:
            self.load_initial_weights()
        if self.cfg.enable:
            self._check_disk_space()
        return path is not None

    def _remove_unfinished(self) -> None:
        """Remove the leftovers of a run stopped while saving or rotating: they only fill the disk."""
        if not self.trainer.is_main:
            return
        for stale in sorted([*self.folder.glob("step-*.partial"), *self.folder.glob("step-*.deleting")]):
            shutil.rmtree(stale, ignore_errors=True)
            if stale.suffix == ".partial":
                print(f"removed the unfinished checkpoint {stale} (left by a run stopped while saving it)",
                      flush=True)

    def _check_disk_space(self) -> None:
        """Warn at startup when the disk cannot hold the checkpoints this run keeps at once."""
        t = self.trainer
        if not t.is_main:
            return
        steps, interval, step, keep = t.cfg.training.steps, self.cfg.interval, t.state.step, self.cfg.keep_latest_k
        # At every multiple of the interval, and at the last step.
        saves = steps // interval - step // interval + int(steps > step and steps % interval != 0)
        count = checkpoints_to_hold(saves, keep, len(step_folders(self.folder)))
        size = checkpoint_bytes(t.model)
        free = free_bytes(self.folder)
        if count and free < count * size:
            held = f"keep_latest_k = {keep} holds {keep + 1} while saving" if keep > 0 else "keep_latest_k = 0 keeps all"
            warn(f"checkpoint folder {self.folder} has {format_bytes(free)} free, but this run's checkpoints need "
                 f"about {format_bytes(count * size)} ({count} x {format_bytes(size)}; {held}); a save that does "
                 "not fit stops the run, so free space, use another checkpoint.folder or lower checkpoint.keep_latest_k")

    def _check_extra(self, path: Path, extra: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
        """Every field of extra.json has the shape this run's objects load, checked before loading anything."""
        t = self.trainer
        step = int(_STEP_DIR.match(path.name).group(1))
        try:
            for key in ("global_batch", "world_size", "dp", "tp"):
                if type(extra[key]) is not int or extra[key] < 1:
                    raise _FieldError(key, f"must be an integer >= 1, got {_show(extra[key])}")
            _check_like(extra["train_state"], t.state.state_dict(), "train_state")
            _check_like(extra["lr_scheduler"], t.lr_scheduler.state_dict(), "lr_scheduler")
            _check_param_groups(extra["optimizer_param_groups"], param_groups, "optimizer_param_groups")
            dataset_state = extra["dataloader"].get("dataset_state") if isinstance(extra["dataloader"], dict) else None
            if isinstance(dataset_state, dict):
                # Checkpoints from before bad-row counting (data.bad_rows) saw none.
                dataset_state.setdefault("bad_rows", 0)
            _check_like(extra["dataloader"], t.dataloader.state_dict(), "dataloader")
            if "schedule" in extra:
                live = schedule_values(t.cfg)
                if not isinstance(extra["schedule"], dict) or set(extra["schedule"]) != set(live):
                    raise _FieldError("schedule", f"must hold exactly {', '.join(live)}")
                for key, value in extra["schedule"].items():
                    if type(value) is not type(live[key]):
                        raise _FieldError(f"schedule.{key}", f"must be of the kind of {_show(live[key])}, got {_show(value)}")
            # A checkpoint folder names the step it holds; another step means files were mixed up.
            for key, value in (("train_state.step", extra["train_state"]["step"]),
                               ("lr_scheduler.last_epoch", extra["lr_scheduler"]["last_epoch"])):
                if value != step:
                    raise _FieldError(key, f"is {value}, but the folder holds step {step}")
        except _FieldError as e:
            raise UserError(f"checkpoint {path}: extra.json {e}") from None

    def _read_rng(self, path: Path, saved_world_size: int) -> dict[str, torch.Tensor] | None:
        """This rank's RNG states, checked on every rank before anything loads (None: a rank the run lacked).

        A rank that did not exist when the checkpoint was written (larger world) keeps its seed.
        """
        t = self.trainer
        rank = t.dist.rank
        rng_file = path / "rng" / f"rank-{rank}.safetensors"
        rng = None
        problem = ""
        if not (path / "rng").is_dir():
            problem = f"checkpoint {path} is incomplete: rng/ is missing"
        elif rank < saved_world_size:
            try:
                rng = load_file(str(rng_file))
            except FileNotFoundError:
                problem = f"checkpoint {path} is incomplete: rng/{rng_file.name} is missing"
            except Exception as e:
                problem = f"checkpoint {rng_file} is unreadable: {describe_error(e)}"
            else:
                cpu = rng.get("cpu")
                live = torch.get_rng_state()
                cuda = rng.get("cuda") if t.device.type == "cuda" else None
                if cpu is None or cpu.dtype != live.dtype or cpu.shape != live.shape:
                    problem = f"checkpoint {rng_file} holds no CPU generator state"
                elif cuda is not None and (cuda.dtype != torch.uint8 or cuda.dim() != 1):
                    problem = f"checkpoint {rng_file} holds a damaged CUDA generator state"
        # Every rank must stop together, or the others would wait in the load's collectives.
        problems = [""] * t.dist.world_size
        dist.all_gather_object(problems, problem)
        first = next((p for p in problems if p), "")
        if first:
            raise UserError(first)
        return rng

    def _verify_checksums(self, path: Path) -> str:
        """Check every file against checksums.json, the files shared among the ranks; says what was done."""
        if not self.cfg.verify_checksums:
            return "checksums not verified"
        t = self.trainer
        start = time.perf_counter()
        listed = None
        problem = ""
        try:
            listed = checksums.read(path)
            if listed is not None:
                if t.is_main:
                    checksums.check_listing(listed, checksums.list_files(path))
                checksums.check_files(path, listed, sorted(listed)[t.dist.rank :: t.dist.world_size])
        except checksums.ChecksumError as e:
            problem = str(e)
        # One collective whatever happened, so no rank waits for another that stopped early.
        outcomes: list[Any] = [None] * t.dist.world_size
        dist.all_gather_object(outcomes, (problem, listed is None))
        problem = next((p for p, _ in outcomes if p), "")
        if problem:
            raise UserError(f"checkpoint {path}: {problem}; {self._older_hint(path)}")
        if outcomes[0][1]:
            if t.is_main:
                warn(f"checkpoint {path} has no {checksums.CHECKSUMS_FILE} (written before checksums existed or "
                     "with checkpoint.verify_checksums = false): its files are loaded unverified")
            return "no checksums to verify"
        return f"checksums {time.perf_counter() - start:.1f}s"

    def _older_hint(self, path: Path) -> str:
        step = int(_STEP_DIR.match(path.name).group(1))
        older = [s for s in step_folders(self.folder) if s < step]
        if older:
            return (f"resume from an older checkpoint with checkpoint.load_step = {older[-1]} "
                    f"(older steps: {', '.join(map(str, older))})")
        return "no older checkpoint exists: restore this one from a copy, or move it away to start over"

    def _load(self, path: Path) -> None:
        t = self.trainer
        start = time.perf_counter()
        # Everything is checked before anything loads, so a refused checkpoint leaves no half-loaded state.
        extra = read_extra(path)
        metadata = read_dcp_metadata(path, "checkpoint")
        model_sd, optim_sd = get_state_dict(t.model, t.optimizer)
        expected = {k: v.shape for k, v in model_sd.items()}
        check_model_keys(expected, dcp_model_shapes(metadata, _MODEL_PREFIX), f"checkpoint {path}")
        self._check_extra(path, extra, optim_sd["param_groups"])
        if extra["global_batch"] != self._global_batch():
            raise UserError(
                f"checkpoint {path} was written with a global batch of {extra['global_batch']} sequences, "
                f"this run uses {self._global_batch()} (training.batch_size x dp x gradient_accumulation_steps); "
                "resuming would change the data order, so set them to give the same global batch"
            )
        rng = self._read_rng(path, extra["world_size"])
        # After the checks above, which name a truncated or hand-edited field precisely; before
        # dcp.load, which would load damaged bytes without noticing.
        verified = self._verify_checksums(path)
        groups = _param_groups_from_json(extra["optimizer_param_groups"])
        app = _ModelAndOptimizer(t.model, t.optimizer, param_groups_to_load=groups)
        try:
            dcp.load({"app": app}, storage_reader=SafeFileSystemReader(str(path)))
            t.lr_scheduler.load_state_dict(extra["lr_scheduler"])
            t.dataloader.load_state_dict(extra["dataloader"])
        except UserError:
            raise
        except (Exception, CheckpointException) as e:
            raise UserError(f"checkpoint {path} cannot be loaded: {describe_error(e)}") from None
        t.state.load_state_dict(extra["train_state"])
        self._reconcile_config(path, extra)
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and t.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], t.device)
        if t.is_main:
            print(f"checkpoint loaded: {path} ({time.perf_counter() - start:.1f}s, {verified})", flush=True)

    def _reconcile_config(self, path: Path, extra: dict[str, Any]) -> None:
        """Warn once for each optimizer or schedule key this run changes, saying which value is in force.

        The optimizer's hyperparameters and the peak lr are the checkpoint's (they live in its param
        groups and the scheduler's base_lrs): the config takes them, so config.toml records what the
        run uses. The schedule's shape is rebuilt from this run's config on every start, so the new
        warmup / decay / min_lr_ratio / steps apply from the next step on.
        """
        t = self.trainer
        opt = t.cfg.optimizer
        group = extra["optimizer_param_groups"][0]  # the decayed matrices: weight_decay is the config's
        saved = {
            "optimizer.lr": extra["lr_scheduler"]["base_lrs"][0], "optimizer.weight_decay": group["weight_decay"],
            "optimizer.betas": list(group["betas"]), "optimizer.eps": group["eps"],
        }
        live = {"optimizer.lr": opt.lr, "optimizer.weight_decay": opt.weight_decay,
                "optimizer.betas": list(opt.betas), "optimizer.eps": opt.eps}
        for key, value in saved.items():
            if value != live[key] and t.is_main:
                warn(f"{key} = {live[key]} differs from {value} in checkpoint {path}: the checkpoint's "
                     f"{value} stays in force (its optimizer state is resumed), and config.toml records it")
        opt.lr, opt.weight_decay, opt.betas, opt.eps = (
            saved["optimizer.lr"], saved["optimizer.weight_decay"], saved["optimizer.betas"], saved["optimizer.eps"])
        for key, value in extra.get("schedule", {}).items():
            new = schedule_values(t.cfg)[key]
            if value != new and t.is_main:
                warn(f"{key} = {new} differs from {value} in checkpoint {path}: this run's {new} applies "
                     f"from step {t.state.step + 1} on (the lr schedule is rebuilt from the config)")

    def load_initial_weights(self) -> None:
        """Model weights only (no optimizer state) from dcp / hf / meta / torch files."""
        import resource

        from trainer.weights import load_dcp_model, load_full_state_dict

        t = self.trainer
        fmt, path = self.cfg.initial_load_format, self.cfg.initial_load_path
        if not Path(path).exists():
            raise UserError(f"checkpoint.initial_load_path not found: {path}")
        start = time.perf_counter()
        if fmt == "dcp":
            load_dcp_model(t.model, path)
        else:
            # Rank 0 reads the full weights and broadcasts them; a problem found there must
            # stop every rank, so it travels with the shapes.
            full_sd: dict[str, torch.Tensor] = {}
            box: list[Any] = [None]
            if t.is_main:
                try:
                    full_sd = load_full_state_dict(path, fmt, t.model_args)
                    box = [{k: v.shape for k, v in full_sd.items()}]
                except UserError as e:
                    box = [str(e)]
            dist.broadcast_object_list(box, src=0)
            if isinstance(box[0], str):
                raise UserError(box[0])
            expected = {k: v.shape for k, v in get_model_state_dict(t.model).items()}
            check_model_keys(expected, box[0], f"checkpoint.initial_load_path {path}")
            set_model_state_dict(
                t.model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            )
        seconds = time.perf_counter() - start
        # Each rank's peak host RSS so far (ru_maxrss is KiB on Linux): rank 0 holds the full
        # state dict when loading hf / meta / torch files.
        peaks: list[Any] = [None] * t.dist.world_size
        dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2)
        if t.is_main:
            print(f"loaded initial weights ({fmt}) from {path} in {seconds:.1f}s; "
                  f"peak host memory per rank: {', '.join(f'{p:.1f}' for p in peaks)} GiB", flush=True)

    # -- export --------------------------------------------------------------

    def maybe_export_final(self) -> None:
        """Model-only safetensors export in checkpoint.export_dtype, for inference and SFT.

        Only a run that reached training.steps exports; a run stopped early has no final model.
        """
        t = self.trainer
        if not self.cfg.export_final or t.state.step < t.cfg.training.steps:
            return
        sd = get_model_state_dict(t.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if t.is_main:
            from trainer.weights import export_model

            out = self.folder / "final"
            export_model(sd, t.model_args, out, _DTYPES[self.cfg.export_dtype])
            print(f"exported model weights: {out / 'model.safetensors'}", flush=True)
        dist.barrier()
