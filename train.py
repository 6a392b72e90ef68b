"""Entry point: `python train.py [--config configs/debug.toml] [--section.key value ...]`.

Launch on several GPUs with `torchrun --nproc_per_node=N train.py --config ...`.
"""

from __future__ import annotations

import os
import sys
import warnings

from trainer.errors import UserError, report, reported_in_this_launch

# Known-benign library warnings that would bury the trainer's own messages.
warnings.filterwarnings("ignore", message=".*set_vital.*")
warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")


def main(argv: list[str] | None = None) -> int:
    from trainer.config import build_config
    from trainer.log import route_library_warnings

    route_library_warnings()
    try:
        cfg = build_config(argv)
        if cfg.job.dry_run:
            from trainer.dry_run import print_plan

            print_plan(cfg)
            return 0
        from trainer import run_folder
        from trainer.distributed import process_group
        from trainer.trainer import Trainer
    except UserError as e:
        report(e)
        return e.exit_code
    clean = False
    try:
        with run_folder.claim(cfg.job.dump_folder):
            Trainer(cfg).train()
        clean = True
    except UserError as e:
        # Before the teardown: under torchrun, once any rank has exited, this one can be
        # stopped at any moment. report() prints the line once for all ranks of the launch.
        report(e)
        return e.exit_code
    except Exception:
        # A peer that stopped on a UserError leaves this rank failing in a collective
        # ("Connection closed by peer"): its line is out already, a traceback would bury it.
        if reported_in_this_launch():
            return UserError.exit_code
        raise
    finally:
        process_group.shutdown(clean)
    return 0


if __name__ == "__main__":
    code = main()
    # gloo's worker threads outlive destroy_process_group (torch 2.13) and can abort the
    # interpreter's teardown ("terminate called without an active exception", SIGABRT)
    # after a run that has finished and closed its files: leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
