"""train.py with an unexpected failure forced inside the loop, to exercise the crash path.

Launched in place of train.py by ``run_train(..., script="tests/wrappers/train_crash.py")``; ``CRASH`` says
where and when, as ``<where>:<n>``:

- ``record:n`` — a RuntimeError while the loop records step n (the step has completed);
- ``forward:n`` — a RuntimeError in the n-th forward pass (in the middle of a step);
- ``delete_dump:n`` — the dump folder is deleted (``rm -rf``) once step n is recorded;
- ``disk_full:n`` — the n-th line of metrics.jsonl meets a full disk half-way (OSError ENOSPC
  after a part of the line was written, as a real full disk does).
"""

from __future__ import annotations

import errno
import os
import runpy
import shutil
import sys
import types
from pathlib import Path

from trainer.metrics import logger as metrics_logger
from trainer.step import StepRunner
from trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]

WHERE, _, N = os.environ["CRASH"].partition(":")
N = int(N)
_calls = 0


def _count() -> int:
    global _calls
    _calls += 1
    return _calls


def _failing_record(original):
    def record(self, result, logger):
        if result.step == N:
            raise RuntimeError(f"forced failure while recording step {N}")
        return original(self, result, logger)
    return record


def _deleting_record(original):
    def record(self, result, logger):
        original(self, result, logger)
        if result.step == N:
            shutil.rmtree(self.cfg.job.dump_folder)
    return record


def _failing_loss_sum(original):
    def loss_sum(self, batch):
        if _count() == N:
            raise RuntimeError(f"forced failure in forward pass {N}")
        return original(self, batch)
    return loss_sum


class _FullDiskOs(types.SimpleNamespace):
    """The os module as trainer/metrics/logger.py sees it, with a disk that fills up at the n-th line."""

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data):
        if fd in _metrics_fds and _count() == N:
            os.write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, data)


_metrics_fds: set[int] = set()


def _recording_fd(original):
    def init(self, path, fresh):
        original(self, path, fresh)
        _metrics_fds.add(self._fd)
    return init


if WHERE == "record":
    Trainer._record = _failing_record(Trainer._record)
elif WHERE == "delete_dump":
    Trainer._record = _deleting_record(Trainer._record)
elif WHERE == "forward":
    StepRunner.loss_sum = _failing_loss_sum(StepRunner.loss_sum)
elif WHERE == "disk_full":
    metrics_logger.os = _FullDiskOs()
    metrics_logger.JsonlAppender.__init__ = _recording_fd(metrics_logger.JsonlAppender.__init__)
else:
    raise SystemExit(f"unknown CRASH {os.environ['CRASH']!r}")
sys.argv = [str(ROOT / "train.py"), *sys.argv[1:]]
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
