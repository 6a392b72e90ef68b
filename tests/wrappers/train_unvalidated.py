"""train.py without the up-front data check, to exercise bad rows met mid-run.

Launched in place of train.py by ``run_train(..., script="tests/wrappers/train_unvalidated.py")``:
with ``trainer.data.loader.VALIDATE_MAX_BYTES = 0`` local data is treated as data over the limit,
so a bad row is found only when the stream reaches it.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import trainer.data.loader

ROOT = Path(__file__).resolve().parents[2]

trainer.data.loader.VALIDATE_MAX_BYTES = 0
sys.argv = [str(ROOT / "train.py"), *sys.argv[1:]]
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
