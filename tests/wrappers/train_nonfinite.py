"""train.py with a NaN loss forced on chosen forward passes, to exercise skipped steps.

Launched in place of train.py by ``run_train(..., script="tests/wrappers/train_nonfinite.py")``;
``NONFINITE_ATTEMPTS`` lists the 1-based forward passes (one per step without gradient
accumulation, counting retried steps) whose loss becomes NaN, and with it every gradient.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from trainer.step import StepRunner

ROOT = Path(__file__).resolve().parents[2]

POISONED = {int(n) for n in os.environ["NONFINITE_ATTEMPTS"].split(",")}
_original = StepRunner.loss_sum
_calls = 0


def _poisoned_loss_sum(self, batch):
    global _calls
    _calls += 1
    loss = _original(self, batch)
    return loss * float("nan") if _calls in POISONED else loss


StepRunner.loss_sum = _poisoned_loss_sum
sys.argv = [str(ROOT / "train.py"), *sys.argv[1:]]
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
