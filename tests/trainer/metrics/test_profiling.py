"""trainer/metrics/profiling.py: traces only the chosen steps, as Chrome-trace JSON, from a real run too."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import run_train
from trainer.config import ProfilingConfig
from trainer.metrics.profiling import StepProfiler


def _trace(path) -> dict:
    data = json.loads(path.read_text())
    assert isinstance(data["traceEvents"], list) and data["traceEvents"]
    return data


def test_only_configured_steps_are_traced(tmp_path):
    profiler = StepProfiler(ProfilingConfig(enable=True, steps=[2, 4]), tmp_path, rank=1,
                            device=torch.device("cpu"))
    x = torch.randn(32, 32)
    for step in range(1, 5):
        with profiler.step(step):
            (x @ x).sum()
    traces = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json"))
    assert traces == ["profiles/step-2/rank-1.json", "profiles/step-4/rank-1.json"]
    names = {e.get("name") for e in _trace(tmp_path / "profiles/step-2/rank-1.json")["traceEvents"]}
    assert "aten::mm" in names


def test_disabled_profiler_writes_nothing(tmp_path):
    # memory_snapshot is CUDA-only: on CPU it must be a no-op, not an error.
    profiler = StepProfiler(ProfilingConfig(enable=False, steps=[1], memory_snapshot=True), tmp_path, rank=0,
                            device=torch.device("cpu"))
    with profiler.step(1):
        torch.ones(3).sum()
    assert not (tmp_path / "profiles").exists()


@pytest.mark.slow
def test_train_writes_trace(tmp_path):
    result = run_train([
        "--profiling.enable", "true", "--profiling.steps", "2", "--training.steps", "3",
        "--training.batch_size", "2", "--training.seq_len", "64", "--job.dump_folder", str(tmp_path),
    ])
    assert result.returncode == 0, result.stderr
    profiles = tmp_path / "profiles"
    assert [p.name for p in profiles.iterdir()] == ["step-2"]
    events = _trace(profiles / "step-2" / "rank-0.json")["traceEvents"]
    # The traced step is a whole training step: forward, backward and the optimizer.
    names = " ".join(str(e.get("name", "")) for e in events)
    assert "aten::mm" in names and "Optimizer.step" in names
