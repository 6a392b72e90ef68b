"""train.py under test-only hooks that force the order in which torchrun's workers fail.

Launched in place of train.py by ``run_train(..., script="tests/wrappers/train_hooked.py")``; the
hooks come from the JSON in ``TRAIN_HOOKS`` and live only here, so train.py itself has
no such knob. ``TRAIN_HOOKS`` maps a rank (a string) to that rank's hooks:

- ``"start_after_exit_of": r`` — wait until rank ``r``'s process is gone before running
  train.py (torchrun normally stops this rank first, as it would a slow one).
- ``"start_after_printing_of": r`` — wait until rank ``r`` is writing its ``error:`` line.
- ``"hold_error_line_s": s`` — this rank's ``error:`` line, once it starts, waits ``s``
  seconds before it is written: a printer stalled at the worst moment (long enough for a
  rank that does not wait for it to exit and get it stopped by torchrun).
- ``"raise_at_first_batch": message`` — a UserError on this rank only, when the trainer
  asks for its first batches (the process group exists and the other ranks go on).

Each rank writes its pid to ``TRAIN_HOOKS_DIR/rank<r>.pid`` so the others can wait on it.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WAIT_LIMIT_S = 300


def _pid_file(rank: int) -> Path:
    return Path(os.environ["TRAIN_HOOKS_DIR"]) / f"rank{rank}.pid"


def _alive(rank: int) -> bool:
    """Rank `rank` has not started yet or still runs (a reaped process is gone)."""
    try:
        pid = int(_pid_file(rank).read_text())
    except (FileNotFoundError, ValueError):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone too: torchrun reaps its workers only when it next looks at them.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _wait(condition, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


class _HeldErrorLine:
    """sys.stderr whose `error:` line waits `hold_s` seconds, after flagging that it started."""

    def __init__(self, stream, rank: int, hold_s: float) -> None:
        self._stream, self._rank, self._hold_s = stream, rank, hold_s

    def write(self, text: str) -> int:
        if text.startswith("error:"):
            (Path(os.environ["TRAIN_HOOKS_DIR"]) / f"rank{self._rank}.printing").touch()
            time.sleep(self._hold_s)
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def main() -> None:
    rank = int(os.environ["RANK"])
    _pid_file(rank).write_text(str(os.getpid()))
    hooks = json.loads(os.environ.get("TRAIN_HOOKS", "{}")).get(str(rank), {})
    if "start_after_exit_of" in hooks:
        _wait(lambda: not _alive(hooks["start_after_exit_of"]), WAIT_LIMIT_S)
    if "start_after_printing_of" in hooks:
        flag = Path(os.environ["TRAIN_HOOKS_DIR"]) / f"rank{hooks['start_after_printing_of']}.printing"
        _wait(flag.exists, WAIT_LIMIT_S)
    if "hold_error_line_s" in hooks:
        sys.stderr = _HeldErrorLine(sys.stderr, rank, hooks["hold_error_line_s"])
    if "raise_at_first_batch" in hooks:
        from trainer.errors import UserError
        from trainer.step import BatchReader

        def fail(self):
            raise UserError(hooks["raise_at_first_batch"])

        BatchReader.micro_batches = fail
    sys.argv = [str(ROOT / "train.py"), *sys.argv[1:]]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
