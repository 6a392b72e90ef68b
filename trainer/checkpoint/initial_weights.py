"""Initial model weights for a fresh run (``checkpoint.initial_load_path``): dcp, hf, meta or torch files.

Only the model is loaded, never optimizer state, and only finite weights, trained with this run's
tokenizer where the weights record one. DCP folders are read sharded by every rank;
the other formats are read whole by rank 0 and broadcast, so rank 0 alone holds the full
state dict in host memory.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from models.llama import LlamaArgs
from models.llama.weight_conversion import WeightsError, expected_shapes
from models.llama.weight_files import check_weights_fit as weights_fit
from models.llama.weight_files import read_weights
from trainer.checkpoint.dcp_reader import (
    check_model_keys,
    dcp_model_prefix,
    dcp_model_shapes,
    load_dcp_model,
    read_dcp_metadata,
)
from trainer.checkpoint.folder import step_folders
from trainer.checkpoint.identity import check_tokenizer
from trainer.config import CheckpointConfig
from trainer.errors import UserError
from trainer.log import info


def check_weights_fit(path: str | Path, fmt: str, args: LlamaArgs, what: str) -> None:
    """Refuse weights that do not fit the model of `args` before any model is built: only their
    metadata is read (DCP's .metadata, a safetensors header, config.json / params.json)."""
    if fmt == "dcp":
        metadata = read_dcp_metadata(path, what)
        expected = expected_shapes(args)
        check_model_keys(expected, dcp_model_shapes(metadata, dcp_model_prefix(metadata, expected)), f"{what} {path}")
        return
    try:
        weights_fit(fmt, path, args)
    except WeightsError as e:
        raise UserError(f"{what}: {e}") from None


def check_initial_weights_fit(ckpt: CheckpointConfig, folder: Path, args: LlamaArgs) -> None:
    """The initial weights a fresh run will load (none when it resumes from `folder`) fit `args`."""
    path = Path(ckpt.initial_load_path) if ckpt.initial_load_path else None
    if path is not None and path.exists() and not (ckpt.enable and step_folders(folder)):
        check_weights_fit(path, ckpt.initial_load_format, args, "checkpoint.initial_load_path")


def load_full_state_dict(path: str, fmt: str, args: LlamaArgs) -> dict[str, torch.Tensor]:
    """A full (unsharded) state dict in our names from hf / meta / torch weights."""
    try:
        _, state_dict = read_weights(fmt, path, args)
    except WeightsError as e:
        raise UserError(f"checkpoint.initial_load_path: {e}") from None
    return state_dict


def _nonfinite_weights(model: nn.Module, world_size: int) -> tuple[int, str]:
    """How many weights of the (sharded) `model` are NaN or infinite, and the first parameter holding one; a collective."""
    count, first = 0, ""
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            bad = int((~torch.isfinite(local)).sum())
            count += bad
            first = first or (name if bad else "")
    found: list[Any] = [None] * world_size
    dist.all_gather_object(found, (count, first))
    # The wrappers (compile, activation checkpointing) add their names to the parameter's.
    first = next((f for _, f in found if f), "").replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
    return sum(c for c, _ in found), first


def load_initial_weights(
    model: nn.Module, args: LlamaArgs, path: str, fmt: str, rank: int, world_size: int,
    tokenizer: dict[str, Any] | None = None,
) -> None:
    """Load `path` (in format `fmt`) into the (sharded) `model`; a collective of every rank.

    Refused in one line: weights recorded as trained with another `tokenizer` (its identity), and
    weights that hold NaN or infinite values, which would stop the run at its first step.
    """
    if not Path(path).exists():
        raise UserError(f"checkpoint.initial_load_path not found: {path}")
    if tokenizer is not None:
        check_tokenizer(path, tokenizer)
    start = time.perf_counter()
    if fmt == "dcp":
        load_dcp_model(model, path)
    else:
        # A problem found by rank 0 must stop every rank, so it travels in place of the shapes.
        full_sd: dict[str, torch.Tensor] = {}
        box: list[Any] = [None]
        if rank == 0:
            try:
                full_sd = load_full_state_dict(path, fmt, args)
                box = [{k: v.shape for k, v in full_sd.items()}]
            except UserError as e:
                box = [str(e)]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise UserError(box[0])
        expected = {k: v.shape for k, v in get_model_state_dict(model).items()}
        check_model_keys(expected, box[0], f"checkpoint.initial_load_path {path}")
        set_model_state_dict(
            model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )
    bad, first = _nonfinite_weights(model, world_size)
    if bad:
        raise UserError(
            f"checkpoint.initial_load_path {path} holds {bad} NaN or infinite weights (the first in '{first}'): "
            "these weights are damaged or diverged and cannot be trained from; use healthy weights"
        )
    seconds = time.perf_counter() - start
    # ru_maxrss is KiB on Linux: the peak so far, which shows what rank 0's full copy cost.
    peaks: list[Any] = [None] * world_size
    dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2)
    info(f"loaded initial weights ({fmt}) from {path} in {seconds:.1f}s; "
         f"peak host memory per rank: {', '.join(f'{p:.1f}' for p in peaks)} GiB")
