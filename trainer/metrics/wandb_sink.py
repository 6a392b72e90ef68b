"""Weights & Biases as an optional metrics sink (metrics.enable_wandb, the `wandb` extra), rank 0 only.

It logs TensorBoard's keys and values at the same steps, with the run's config.toml as the W&B
run config. The W&B run id is kept in ``<dump_folder>/wandb_id``: a resumed run continues the
same W&B run, a fresh run in the folder moves the id aside with the other records
(``trainer.run_folder.RECORDS``) and starts a new one. W&B's own settings come from its
environment: ``WANDB_MODE=offline`` writes the run under ``<dump_folder>/wandb/`` without
network (``wandb sync`` uploads it later).
"""

from __future__ import annotations

import importlib.util
import secrets
import sys
from pathlib import Path
from typing import Any

from trainer.config import MetricsConfig
from trainer.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ID_FILE = "wandb_id"


def check_installed(metrics: MetricsConfig) -> None:
    """Refuse metrics.enable_wandb without the package, before any work."""
    if metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise UserError("metrics.enable_wandb = true needs the wandb package: pip install -e '.[wandb]' "
                        "(or set metrics.enable_wandb = false)")


class WandbSink:
    """One W&B run per dump folder, resumed with the folder's checkpoints."""

    def __init__(self, folder: Path, project: str, run_name: str, config_text: str, resumed: bool) -> None:
        import wandb

        id_file = folder / ID_FILE
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else secrets.token_hex(6)
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=project, id=run_id, resume="allow", name=run_name, dir=str(folder),
            config=tomllib.loads(config_text) if config_text else None,
            # the trainer's console stays its own: W&B neither captures it nor prints its run summary
            settings=wandb.Settings(console="off", quiet=True),
        )

    def log(self, values: dict[str, Any], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
