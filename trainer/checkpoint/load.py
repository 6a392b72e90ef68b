"""Resume from one checkpoint: everything is checked before anything loads.

A refused checkpoint (damaged, hand-edited, another model, tokenizer or global batch) stops every rank
with one line and leaves no half-loaded state. Checksums are verified after the checks of
extra.json, which name a truncated or hand-edited field precisely, and before ``dcp.load``,
which would load damaged bytes without noticing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LRScheduler

from trainer.checkpoint import checksums
from trainer.checkpoint.context import CheckpointContext, TrainProgress
from trainer.checkpoint.dcp_reader import (
    SafeFileSystemReader,
    check_model_keys,
    dcp_model_shapes,
    describe_error,
    read_dcp_metadata,
)
from trainer.checkpoint.folder import older_hint, step_of
from trainer.checkpoint.identity import check_same_tokenizer
from trainer.checkpoint.rng import read_rng, restore_rng
from trainer.checkpoint.schema import check_extra, param_groups_from_json, read_extra
from trainer.checkpoint.state import MODEL_PREFIX, ModelAndOptimizer
from trainer.errors import UserError
from trainer.log import info, warn


def _describe_data(identity: dict[str, Any]) -> str:
    return f"{identity.get('path')}: {identity.get('files')} files, {identity.get('bytes')} bytes"


def load_checkpoint(
    path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: LRScheduler,
    dataloader: Stateful, train_state: TrainProgress, context: CheckpointContext,
) -> dict[str, Any]:
    """Restore every object from the checkpoint `path`, after checking all of it; a collective of every rank.

    Returns the optimizer settings in force from now on (the checkpoint's), by `[optimizer]` key.
    """
    start = time.perf_counter()
    extra = read_extra(path)
    if context.tokenizer is not None:
        check_same_tokenizer(extra.get("tokenizer"), context.tokenizer, f"checkpoint {path}")
    recorded_data = extra.get("data")
    if context.is_main and context.data is not None and isinstance(recorded_data, dict) and recorded_data != context.data:
        warn(f"the training data changed since checkpoint {path} was saved (then {_describe_data(recorded_data)}; "
             f"now {_describe_data(context.data)}): the loader resumes its position in the new data, so documents "
             "may be seen twice or skipped")
    metadata = read_dcp_metadata(path, "checkpoint")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    check_model_keys({k: v.shape for k, v in model_sd.items()}, dcp_model_shapes(metadata, MODEL_PREFIX),
                     f"checkpoint {path}")
    check_extra(
        path, step_of(path), extra, train_state=train_state.state_dict(), lr_scheduler=lr_scheduler.state_dict(),
        param_groups=optim_sd["param_groups"], dataloader=dataloader.state_dict(), schedule=context.schedule,
    )
    if extra["global_batch"] != context.global_batch:
        raise UserError(
            f"checkpoint {path} was written with a global batch of {extra['global_batch']} sequences, "
            f"this run uses {context.global_batch} (training.batch_size x dp x gradient_accumulation_steps); "
            "resuming would change the data order, so set them to give the same global batch"
        )
    rng = read_rng(path, context.rank, context.world_size, extra["world_size"], context.device)
    verified = _verify_checksums(path, context)
    app = ModelAndOptimizer(model, optimizer, param_groups_to_load=param_groups_from_json(extra["optimizer_param_groups"]))
    try:
        dcp.load({"app": app}, storage_reader=SafeFileSystemReader(str(path)))
        lr_scheduler.load_state_dict(extra["lr_scheduler"])
        dataloader.load_state_dict(extra["dataloader"])
    except UserError:
        raise
    except (Exception, CheckpointException) as e:
        raise UserError(f"checkpoint {path} cannot be loaded: {describe_error(e)}") from None
    train_state.load_state_dict(extra["train_state"])
    in_force = _reconcile_config(path, extra, context, train_state.step)
    restore_rng(rng, context.device)
    if context.is_main:
        info(f"checkpoint loaded: {path} ({time.perf_counter() - start:.1f}s, {verified})")
    return in_force


def _verify_checksums(path: Path, context: CheckpointContext) -> str:
    """Check every file against checksums.json, the files shared among the ranks; says what was done."""
    if not context.config.verify_checksums:
        return "checksums not verified"
    start = time.perf_counter()
    listed = None
    problem = ""
    try:
        listed = checksums.read(path)
        if listed is not None:
            if context.is_main:
                checksums.check_listing(listed, checksums.list_files(path))
            checksums.check_files(path, listed, sorted(listed)[context.rank :: context.world_size])
    except checksums.ChecksumError as e:
        problem = str(e)
    # One collective whatever happened, so no rank waits for another that stopped early.
    outcomes: list[Any] = [None] * context.world_size
    dist.all_gather_object(outcomes, (problem, listed is None))
    problem = next((p for p, _ in outcomes if p), "")
    if problem:
        raise UserError(f"checkpoint {path}: {problem}; {older_hint(context.folder, path)}")
    if outcomes[0][1]:
        if context.is_main:
            warn(f"checkpoint {path} has no {checksums.CHECKSUMS_FILE} (written before checksums existed or "
                 "with checkpoint.verify_checksums = false): its files are loaded unverified")
        return "no checksums to verify"
    return f"checksums {time.perf_counter() - start:.1f}s"


def _reconcile_config(path: Path, extra: dict[str, Any], context: CheckpointContext, step: int) -> dict[str, Any]:
    """Warn once for each optimizer or schedule key this run changes, saying which value is in force.

    The optimizer's hyperparameters and the peak lr are the checkpoint's (they live in its param
    groups and the scheduler's base_lrs): they are returned, by `[optimizer]` key, so config.toml
    records what the run uses. The schedule's shape is rebuilt from this run's config on every
    start, so the new warmup / decay / min_lr_ratio / steps apply from the next step on.
    """
    opt = context.optimizer
    group = extra["optimizer_param_groups"][0]  # the decayed matrices: weight_decay is the config's
    saved = {
        "optimizer.lr": extra["lr_scheduler"]["base_lrs"][0], "optimizer.weight_decay": group["weight_decay"],
        "optimizer.betas": list(group["betas"]), "optimizer.eps": group["eps"],
    }
    live = {"optimizer.lr": opt.lr, "optimizer.weight_decay": opt.weight_decay,
            "optimizer.betas": list(opt.betas), "optimizer.eps": opt.eps}
    for key, value in saved.items():
        if value != live[key] and context.is_main:
            warn(f"{key} = {live[key]} differs from {value} in checkpoint {path}: the checkpoint's "
                 f"{value} stays in force (its optimizer state is resumed), and config.toml records it")
    for key, value in extra.get("schedule", {}).items():
        new = context.schedule[key]
        if value != new and context.is_main:
            warn(f"{key} = {new} differs from {value} in checkpoint {path}: this run's {new} applies "
                 f"from step {step + 1} on (the lr schedule is rebuilt from the config)")
    return {key.split(".", 1)[1]: value for key, value in saved.items()}
