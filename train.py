"""Entry point: `python train.py [--config configs/debug.toml] [--section.key value ...]`.

Launch on several GPUs with `torchrun --nproc_per_node=N train.py --config ...`.
"""

from __future__ import annotations

import os
import sys
import warnings

from trainer.errors import UserError

# Known-benign library warnings that would bury the trainer's own messages.
warnings.filterwarnings("ignore", message=".*set_vital.*")
warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")


def main(argv: list[str] | None = None) -> int:
    from trainer.config import build_config

    try:
        cfg = build_config(argv)
        if cfg.job.dry_run:
            from trainer.plan import print_plan

            print_plan(cfg)
            return 0
        from trainer import distributed
        from trainer.trainer import Trainer

        clean = False
        try:
            Trainer(cfg).train()
            clean = True
        finally:
            distributed.shutdown(clean)
    except UserError as e:
        # Under torchrun every rank hits the same problem; one line is enough.
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    return 0


if __name__ == "__main__":
    code = main()
    # gloo's worker threads outlive destroy_process_group (torch 2.13) and can abort the
    # interpreter's teardown ("terminate called without an active exception", SIGABRT)
    # after a run that has finished and closed its files: leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
