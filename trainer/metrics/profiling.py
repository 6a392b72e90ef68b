"""torch.profiler traces for chosen steps and CUDA memory snapshots."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from trainer.config import ProfilingConfig


class StepProfiler:
    """Traces the configured steps to profiles/step-N/rank-R.json (Perfetto / TensorBoard)."""

    def __init__(self, cfg: ProfilingConfig, dump_folder: Path, rank: int, device: torch.device) -> None:
        self.cfg = cfg
        self.folder = dump_folder / "profiles"
        self.rank = rank
        self.device = device
        self._snapshot_on = False
        if cfg.memory_snapshot and device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            self._snapshot_on = True

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        traced = self.cfg.enable and step in self.cfg.steps
        if not traced:
            try:
                yield
            except torch.OutOfMemoryError:
                self.dump_memory_snapshot(f"oom-step-{step}")
                raise
            if self._snapshot_on and step in self.cfg.steps:
                self.dump_memory_snapshot(f"step-{step}")
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        out = self.folder / f"step-{step}"
        out.mkdir(parents=True, exist_ok=True)
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            yield
        prof.export_chrome_trace(str(out / f"rank-{self.rank}.json"))
        if self._snapshot_on:
            self.dump_memory_snapshot(f"step-{step}")

    def dump_memory_snapshot(self, name: str) -> None:
        if not self._snapshot_on:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.folder / f"memory-{name}-rank-{self.rank}.pickle"))
