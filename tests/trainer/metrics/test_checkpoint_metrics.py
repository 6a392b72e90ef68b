"""metrics.jsonl and TensorBoard across a resume (rows past the checkpoint dropped) and a fresh start."""

from __future__ import annotations

from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import read_metrics
from trainer.metrics.logger import MetricsLogger, StepTimer


def _log(logger: MetricsLogger, steps: range, loss: float) -> None:
    for step in steps:
        logger.log({"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tps": 1.0,
                    "memory/peak_active_gib": 0.0, "step_time_s": 0.1}, total_steps=10)


def _tb_losses(folder: Path) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("loss/loss")]


def _rows(folder: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(folder)]


def test_resume_drops_what_the_killed_run_logged_after_the_checkpoint(tmp_path):
    killed = MetricsLogger(str(tmp_path), "run", enable_tensorboard=True, is_main=True)
    _log(killed, range(1, 9), 1.0)
    killed.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 9, "lo')  # killed mid-write
    resumed = MetricsLogger(str(tmp_path), "run", enable_tensorboard=True, is_main=True, resume_step=5)
    _log(resumed, range(6, 9), 2.0)
    resumed.close()
    expected = [(s, 1.0) for s in range(1, 6)] + [(s, 2.0) for s in range(6, 9)]
    assert _rows(tmp_path) == expected
    assert _tb_losses(tmp_path / "tb" / "run") == expected
    assert not list(tmp_path.glob("*.tmp"))


def test_fresh_start_replaces_an_old_run_of_the_same_name_only(tmp_path):
    old = MetricsLogger(str(tmp_path), "run", enable_tensorboard=True, is_main=True)
    _log(old, range(1, 5), 1.0)
    old.close()
    other = MetricsLogger(str(tmp_path), "other", enable_tensorboard=True, is_main=True)
    _log(other, range(1, 2), 5.0)
    other.close()
    new = MetricsLogger(str(tmp_path), "run", enable_tensorboard=True, is_main=True)
    _log(new, range(1, 3), 3.0)
    new.close()
    assert _rows(tmp_path) == [(1, 3.0), (2, 3.0)]
    assert _tb_losses(tmp_path / "tb" / "run") == [(1, 3.0), (2, 3.0)]
    assert _tb_losses(tmp_path / "tb" / "other") == [(1, 5.0)]


class _CudaEvent:
    """Stands in for torch.cuda.Event: elapsed_time raises until the end event completed."""

    def __init__(self, ms: float) -> None:
        self.ms, self.done = ms, False

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: _CudaEvent) -> float:
        if not end.done:
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return end.ms - self.ms


def test_step_timer_waits_for_the_end_mark_on_cuda():
    # The optimizer step can still run when the loss is read (7B, 1 H200, batch 2: step 1 crashed).
    timer = StepTimer(torch.device("cuda"))
    assert timer.seconds(_CudaEvent(5.0), _CudaEvent(1505.0)) == 1.5
