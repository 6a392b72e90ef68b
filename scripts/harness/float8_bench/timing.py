"""Per-iteration wall time of a benchmark step, shared by bench_float8.py and bench_float8_casts.py."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class Timer:
    """Per-iteration wall time: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, step: Callable[[], None], before: Callable[[], None], warmup: int, iters: int) -> list[float]:
        for _ in range(warmup):
            before()
            step()
        self.sync()
        times = []
        for _ in range(iters):
            before()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                step()
                times.append((time.perf_counter() - t0) * 1e3)
        return times

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
