"""Host time of the float8 casts' calls, timed by scripts/bench_float8_casts.py: what a step that
launches hundreds of them pays on its CPU, through the op inside torch.compile and straight outside.

On a small tensor (512 x 512 bf16) the GPU keeps up, so the wall time of many back-to-back calls
is the host's: dispatch, allocations and Triton's launches.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

SHAPE = (512, 512)
CALLS = 2000


def calls(device: torch.device) -> list[tuple[str, Callable[[], list[torch.Tensor]]]]:
    """(name, one call returning its outputs) for each timed call."""
    from float8.kernels import blocks, cast

    x = torch.randn(*SHAPE, device=device, dtype=torch.bfloat16)
    e4m3 = torch.float8_e4m3fn
    return [
        ("rowwise both layouts, op (compiled steps)", lambda: torch.ops.float8_training.cast_rows.default(x, e4m3, True, True, True, False, None)),
        ("rowwise both layouts, straight (eager)", lambda: cast._cast_rows(x, e4m3, True, True, True, False, None)),
        ("1x128 tiles both layouts, op (compiled steps)",
         lambda: torch.ops.float8_training.cast_blocks.default(x, None, [1, 128], e4m3, True, True, True)),
        ("1x128 tiles both layouts, straight (eager)", lambda: blocks._cast_blocks(x, None, [1, 128], e4m3, True, True, True)),
        ("tensorwise both layouts (eager)", lambda: list(cast.cast_tensorwise_layouts(x, e4m3, transposed=True)[:2])),
    ]


def host_us(fn: Callable[[], object], calls: int = CALLS, warmup: int = 50) -> float:
    """Microseconds of host time a call, over `calls` back-to-back calls after `warmup` warm-up calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return us
