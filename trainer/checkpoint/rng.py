"""Random generator states in a checkpoint: ``rng/rank-R.safetensors``, one file per rank.

Safetensors, not a pickle, so loading runs no code from the file. A rank that did not
exist when the checkpoint was written (a larger world on resume) keeps its seeded state.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainer.checkpoint.context import first_problem
from trainer.checkpoint.dcp_reader import describe_error
from trainer.errors import UserError

RNG_FOLDER = "rng"


def _rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / RNG_FOLDER / f"rank-{rank}.safetensors"


def save_rng(checkpoint: Path, rank: int) -> None:
    """This rank's CPU (and CUDA, once initialised) generator states into `checkpoint`."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    (checkpoint / RNG_FOLDER).mkdir(parents=True, exist_ok=True)
    save_file(state, str(_rng_file(checkpoint, rank)))


def read_rng(
    checkpoint: Path, rank: int, world_size: int, saved_world_size: int, device: torch.device
) -> dict[str, torch.Tensor] | None:
    """This rank's saved states, checked on every rank before anything loads (None: a rank the run lacked)."""
    rng_file = _rng_file(checkpoint, rank)
    rng = None
    problem = ""
    if not (checkpoint / RNG_FOLDER).is_dir():
        problem = f"checkpoint {checkpoint} is incomplete: {RNG_FOLDER}/ is missing"
    elif rank < saved_world_size:
        try:
            rng = load_file(str(rng_file))
        except FileNotFoundError:
            problem = f"checkpoint {checkpoint} is incomplete: {RNG_FOLDER}/{rng_file.name} is missing"
        except UserError:  # Interrupted (a SIGTERM during start-up): not an unreadable file
            raise
        except Exception as e:
            problem = f"checkpoint {rng_file} is unreadable: {describe_error(e)}"
        else:
            cpu = rng.get("cpu")
            live = torch.get_rng_state()
            cuda = rng.get("cuda") if device.type == "cuda" else None
            if cpu is None or cpu.dtype != live.dtype or cpu.shape != live.shape:
                problem = f"checkpoint {rng_file} holds no CPU generator state"
            elif cuda is not None and (cuda.dtype != torch.uint8 or cuda.dim() != 1):
                problem = f"checkpoint {rng_file} holds a damaged CUDA generator state"
    problem = first_problem(problem, world_size)
    if problem:
        raise UserError(problem)
    return rng


def restore_rng(rng: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    """Put the states read by :func:`read_rng` in force."""
    if rng is None:
        return
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)
