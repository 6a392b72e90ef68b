"""Entry point: `python train.py [--config configs/debug.toml] [--section.key value ...]`.

Launch on several GPUs with `torchrun --nproc_per_node=N train.py --config ...`.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.errors import UserError, report, reported_in_this_launch

if TYPE_CHECKING:  # imported when needed: a config error is reported before torch loads
    from trainer.config import Config
    from trainer.trainer import Trainer

# Known-benign library warnings that would bury the trainer's own messages.
warnings.filterwarnings("ignore", message=".*set_vital.*")
warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")

# A save after an unexpected failure that takes longer than this is given up: the process must end.
SAVE_AFTER_FAILURE_LIMIT_S = 600.0


class UnexpectedError(UserError):
    """An exception the trainer did not foresee (a bug, a full disk, a lost device), as one line; exit 1."""

    exit_code = 1


def crash_log(dump_folder: str, rank: int, error: BaseException) -> str:
    """Write the traceback of `error` to the dump folder (or, when that fails, the temp folder); its path."""
    name = "crash.log" if rank == 0 else f"crash-rank{rank}.log"
    text = (f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} rank {rank}: {' '.join(sys.argv)}\n"
            + "".join(traceback.format_exception(error)))
    for path in (Path(dump_folder) / name, Path(tempfile.gettempdir()) / f"f8trainer-{os.getpid()}-{name}"):
        try:
            path.write_text(text)
            return str(path)
        except OSError:
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


def unexpected(error: BaseException, dump_folder: str, trainer: Trainer | None) -> UnexpectedError:
    """The one line for an unexpected exception: what failed, what was saved, where the traceback is.

    The traceback goes to a file, not the console: there it would bury the line.
    """
    from trainer.launch import launch_rank

    saved = ""
    if trainer is not None:
        timer = _leave_if_stuck(SAVE_AFTER_FAILURE_LIMIT_S)
        # data_state: the loader state of the last step the loop counted, set once the loop runs.
        outcome = trainer.checkpointer.save_after_failure(getattr(trainer, "data_state", None))
        timer.cancel()
        step = trainer.state.step
        when = f"after step {step}" if step else "before any step completed"
        saved = f"{when}: {outcome}; "
    lines = str(error).strip().splitlines()
    what = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    log = crash_log(dump_folder, launch_rank(), error)
    return UnexpectedError(f"unexpected {what} ({saved}traceback in {log})")


def run(cfg: Config) -> None:
    """Train inside the claim of the run's folders; an unexpected exception becomes an UnexpectedError,
    after saving the last completed step if it can (while the folders are still claimed)."""
    from trainer import run_folder
    from trainer.checkpoint.context import checkpoint_folder
    from trainer.trainer import Trainer

    uses_checkpoints = cfg.checkpoint.enable or cfg.checkpoint.export_final
    with run_folder.claim(cfg.job.dump_folder, checkpoint_folder(cfg) if uses_checkpoints else None):
        trainer = None
        try:
            trainer = Trainer(cfg)
            trainer.train()
        except UserError:
            raise
        except Exception as e:
            if reported_in_this_launch():
                raise
            raise unexpected(e, cfg.job.dump_folder, trainer) from None


def main(argv: list[str] | None = None) -> int:
    from trainer.config import build_config
    from trainer.distributed import process_group
    from trainer.log import route_library_warnings

    route_library_warnings()
    cfg = None
    clean = False
    try:
        cfg = build_config(argv)
        if cfg.job.dry_run:
            from trainer.dry_run import print_plan

            print_plan(cfg)
            return 0
        run(cfg)
        clean = True
    except UserError as e:
        # Before the teardown: under torchrun, once any rank has exited, this one can be
        # stopped at any moment. report() prints the line once for all ranks of the launch.
        report(e)
        return e.exit_code
    except Exception as e:
        # A peer that stopped on an error leaves this rank failing in a collective ("Connection
        # closed by peer"): its line is out already, another would bury it.
        if reported_in_this_launch():
            return UserError.exit_code
        error = unexpected(e, cfg.job.dump_folder if cfg is not None else tempfile.gettempdir(), None)
        report(error)
        return error.exit_code
    finally:
        process_group.shutdown(clean)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as e:  # --help
        code = e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:  # a second Ctrl-C, while the first one's step was still finishing
        code = 130
    # Always leave through os._exit, never the interpreter's teardown: that joins the data
    # worker processes (which ignore SIGTERM, trainer/data/sharding.py) and can wait forever, and
    # gloo's worker threads outlive destroy_process_group (torch 2.13) and can abort it ("terminate
    # called without an active exception", SIGABRT) after a run that has closed its files.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
