"""Entry point: `python train.py [--config configs/debug.toml] [--section.key value ...]`.

Launch on several GPUs with `torchrun --nproc_per_node=N train.py --config ...`.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING

from trainer.errors import UserError, report, reported_in_this_launch

if TYPE_CHECKING:  # imported when needed: a config error is reported before torch loads
    from trainer.config import Config

# Known-benign library warnings that would bury the trainer's own messages.
warnings.filterwarnings("ignore", message=".*set_vital.*")
warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")

def run(cfg: Config) -> None:
    """Train inside the claim of the run's folders; an unexpected exception becomes an UnexpectedError,
    after saving the last completed step if it can (while the folders are still claimed)."""
    from trainer import run_folder
    from trainer.checkpoint.context import checkpoint_folder
    from trainer.crash import unexpected
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
            if trainer is None:
                raise unexpected(e, cfg.job.dump_folder) from None
            raise unexpected(e, cfg.job.dump_folder, trainer.progress, trainer.checkpointer) from None


def main(argv: list[str] | None = None) -> int:
    from trainer.cli import interruptible
    from trainer.log import route_library_warnings
    from trainer.threads import install_thread_excepthook

    install_thread_excepthook()
    route_library_warnings()
    # Until the loop installs its own handlers (finish the step, save): a SIGTERM or SIGHUP
    # unwinds the start-up, so the folders' locks are released.
    with interruptible():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    from trainer.cli import Interrupted
    from trainer.config import build_config
    from trainer.distributed import process_group

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
    except KeyboardInterrupt:
        report(Interrupted("interrupted (Ctrl-C) before the run started; nothing was saved"))
        return Interrupted.exit_code
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
        from trainer.crash import unexpected

        error = unexpected(e, cfg.job.dump_folder if cfg is not None else None)
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
