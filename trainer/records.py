"""Earlier results are kept, never overwritten: what a new run or script would replace moves (or is
copied) into the next free ``previous-N/`` beside it first."""

from __future__ import annotations

import shutil
from pathlib import Path


def set_aside(folder: Path, paths: list[Path], copy: bool) -> Path | None:
    """Move (or copy) those of `paths` that exist into the next free ``<folder>/previous-N/``.

    Returns the folder they went to, or None when none existed.
    """
    present = [p for p in paths if p.exists()]
    if not present:
        return None
    taken = [int(p.name.split("-", 1)[1]) for p in folder.glob("previous-*") if p.name.split("-", 1)[1].isdigit()]
    target = folder / f"previous-{max(taken, default=0) + 1}"
    target.mkdir()
    for path in present:
        if not copy:
            shutil.move(str(path), str(target / path.name))
        elif path.is_dir():
            shutil.copytree(path, target / path.name, symlinks=True)
        else:
            shutil.copy2(path, target / path.name)
    return target
