"""An exception the trainer did not foresee, as one line: its traceback to a file, the last
completed step saved when it can be, and a process that ends (train.py leaves via os._exit)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.errors import UserError
from trainer.launch import launch_rank

if TYPE_CHECKING:  # torch-free at import: trainer/cli.py (every script's ending) imports this module
    from trainer.checkpoint.manager import CheckpointManager
    from trainer.train_state import LoopProgress

# A save after an unexpected failure that takes longer than this is given up: the process must end.
SAVE_AFTER_FAILURE_LIMIT_S = 600.0


class UnexpectedError(UserError):
    """An exception the trainer did not foresee (a bug, a full disk, a lost device), as one line; exit 1."""

    exit_code = 1


def crash_log(dump_folder: str | None, rank: int, error: BaseException) -> str:
    """Write the traceback of `error` to the dump folder (or, when that fails or there is none, a file
    of this process in the temp folder); its path."""
    name = "crash.log" if rank == 0 else f"crash-rank{rank}.log"
    text = (f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} rank {rank}: {' '.join(sys.argv)}\n"
            + "".join(traceback.format_exception(error)))
    places = [Path(tempfile.gettempdir()) / f"f8trainer-{os.getpid()}-{name}"]
    if dump_folder is not None:
        places.insert(0, Path(dump_folder) / name)
    for path in places:
        try:
            path.write_text(text)
            return str(path)
        except OSError:
            # A full disk leaves an empty file behind: it would hide where the real log went.
            with contextlib.suppress(OSError):
                path.unlink()
            continue
    return "nowhere: no folder was writable"


def _leave_if_stuck(limit_s: float) -> threading.Timer:
    """A timer that ends the process if the save after a failure hangs (a stuck disk)."""

    def leave() -> None:
        print(f"error: the save after the failure took over {limit_s:.0f} s; exiting without it",
              file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(limit_s, leave)
    timer.daemon = True
    timer.start()
    return timer


def unexpected(
    error: BaseException, dump_folder: str | None, progress: LoopProgress | None = None,
    checkpointer: CheckpointManager | None = None,
) -> UnexpectedError:
    """The one line for an unexpected exception: what failed, what was saved, where the traceback is.

    With the loop's `progress` and the run's `checkpointer` (a Trainer was built), the last completed
    step is saved first when it can be. The traceback goes to a file, not the console: there it would bury the line.
    """
    saved = ""
    if progress is not None and checkpointer is not None:
        timer = _leave_if_stuck(SAVE_AFTER_FAILURE_LIMIT_S)
        outcome = checkpointer.save_after_failure(progress.data_state)
        timer.cancel()
        step = progress.counters.step
        when = f"after step {step}" if step else "before any step completed"
        saved = f"{when}: {outcome}; "
    lines = str(error).strip().splitlines()
    what = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    log = crash_log(dump_folder, launch_rank(), error)
    return UnexpectedError(f"unexpected {what} ({saved}traceback in {log})")
