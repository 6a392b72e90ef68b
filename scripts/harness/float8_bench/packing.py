"""FSDP2's gradient packing before each reduce-scatter, timed by scripts/bench_float8_casts.py: FSDP2's
`torch._chunk_cat` against trainer/distributed/gradient_packing.py's foreach copies, one LLaMA-2-7B
block's bf16 gradients into the fp32 reduce-scatter buffer, at 1 and 8 ranks (the one-GPU run and each
GPU of an 8-GPU one). Bandwidth counts 6 bytes a parameter (a bf16 read, an fp32 write); host time is
the launching CPU's, over `HOST_CALLS` calls, few enough not to fill the GPU's queue.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SHAPES = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)] + [(4096,)] * 2
RANKS = (1, 8)
BYTES_PER_PARAM = 6
HOST_CALLS = 20


def kernels(device: torch.device) -> tuple[list[tuple[str, int, Callable[[], object], torch.Tensor]], int]:
    """(packing, ranks, one packing call, the buffer it writes) for each cell; and the gradients' parameter count."""
    from trainer.distributed.gradient_packing import chunk_numel, pack_gradients

    grads = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in SHAPES]
    cells = []
    for ranks in RANKS:
        numel = ranks * sum(chunk_numel(s, ranks) for s in SHAPES)
        chunk_cat, copies = torch.empty(numel, device=device), torch.empty(numel, device=device)
        cells.append(("chunk_cat", ranks, lambda b=chunk_cat, r=ranks: torch._chunk_cat(grads, 0, r, out=b.view(r, -1)), chunk_cat))
        cells.append(("copies", ranks, lambda b=copies, r=ranks: pack_gradients(grads, b, r), copies))
    return cells, sum(g.numel() for g in grads)

