"""The checkpoint folder on disk: which checkpoints it holds, rotation, leftovers and space.

Only rank 0 changes the folder. A checkpoint is published by a rename and removed by a rename
before the delete, so a process killed at any point never leaves a half-written or
half-deleted ``step-N``: at worst a ``step-N.partial`` or ``step-N.deleting``, removed later.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from trainer.log import warn
from trainer.records import set_aside

_STEP_DIR = re.compile(r"^step-(\d+)$")


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


def step_of(path: Path) -> int:
    """The step a published checkpoint folder ``step-N`` holds."""
    return int(_STEP_DIR.match(path.name).group(1))


def remove(path: Path) -> None:
    """Rename, then delete: a kill mid-delete leaves no half-deleted ``step-N``."""
    trash = path.with_name(path.name + ".deleting")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def set_aside_newer(folder: Path, newer: list[int], load_step: int) -> None:
    """A rollback (checkpoint.load_step) keeps the replaced run's newer checkpoints: before anything is
    written they move to previous-N/, where neither a resume nor the rotation finds them."""
    if newer:
        kept = set_aside(folder, [folder / f"step-{s}" for s in newer], copy=False)
        warn(f"checkpoint.load_step = {load_step}: the newer checkpoints ({', '.join(map(str, newer))}) "
             f"of the run being replaced were moved to {kept}")


def leftovers(folder: Path) -> list[Path]:
    """What a process killed while saving (``.partial``) or rotating (``.deleting``) left behind."""
    return sorted([*folder.glob("step-*.partial"), *folder.glob("step-*.deleting")])


def rotate(folder: Path, keep_latest_k: int, newest: Path) -> None:
    """Remove the oldest checkpoints until `keep_latest_k` remain, never `newest` (0 keeps all).

    `newest` may not be the latest step: after a load_step resume, newer checkpoints of the
    abandoned run may exist, and those are the ones to go first after the older ones.
    """
    if keep_latest_k <= 0:
        return
    others = [p for p in step_folders(folder).values() if p != newest]
    for old in others[: max(len(others) - keep_latest_k + 1, 0)]:
        remove(old)


def older_hint(folder: Path, path: Path) -> str:
    """What to do about the damaged checkpoint `path`: the older ones to resume from, if any."""
    older = [s for s in step_folders(folder) if s < step_of(path)]
    if older:
        return (f"resume from an older checkpoint with checkpoint.load_step = {older[-1]} "
                f"(older steps: {', '.join(map(str, older))})")
    return "no older checkpoint exists: restore this one from a copy, or move it away to start over"


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


def warn_if_short_of_space(
    folder: Path, checkpoint_size: int, step: int, steps: int, interval: int, keep_latest_k: int
) -> None:
    """Warn when the disk cannot hold the checkpoints a run from `step` to `steps` keeps at once."""
    # At every multiple of the interval, and at the last step.
    saves = steps // interval - step // interval + int(steps > step and steps % interval != 0)
    count = checkpoints_to_hold(saves, keep_latest_k, len(step_folders(folder)))
    free = free_bytes(folder)
    if count and free < count * checkpoint_size:
        held = (f"keep_latest_k = {keep_latest_k} holds {keep_latest_k + 1} while saving" if keep_latest_k > 0
                else "keep_latest_k = 0 keeps all")
        warn(f"checkpoint folder {folder} has {format_bytes(free)} free, but this run's checkpoints need "
             f"about {format_bytes(count * checkpoint_size)} ({count} x {format_bytes(checkpoint_size)}; {held}); "
             "a save that does not fit stops the run, so free space, use another checkpoint.folder or lower "
             "checkpoint.keep_latest_k")
