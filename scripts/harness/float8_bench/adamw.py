"""The AdamW update a float8 step ends with, timed by scripts/bench_float8_casts.py: torch's fused kernel
against the trainer's Triton kernel (trainer/adamw_triton.py, which also takes the weights' amaxes the
float8 weight casts after it need) at each program size and warp count.

The weights are a LLaMA-2-7B layer's largest shapes, 12 of (11008, 4096) and 12 of (4096, 4096)
(742 M fp32 parameters, about 12 GB with gradients and moments), with the trainer's guard tensors
(`grad_scale`, `found_inf`). Bandwidth counts 28 bytes a parameter: weight, gradient and both
moments read, weight and moments written.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

SHAPES = [(11008, 4096)] * 12 + [(4096, 4096)] * 12
BLOCKS = (1024, 2048, 4096, 8192)
WARPS = (4, 8, 16)
BYTES_PER_PARAM = 28
HYPER = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def kernels(device: torch.device) -> tuple[list[tuple[str, Callable[[], object]]], list[torch.Tensor]]:
    """(name, one update) per kernel, all over one set of weights, gradients and moments; and the weights."""
    import triton.language as tl

    from trainer.adamw_triton import adamw_kernel, block_tables, flat_programs

    params, grads = ([torch.randn(s, device=device) for s in SHAPES] for _ in range(2))
    exp_avg, exp_avg_sq = ([torch.zeros(s, device=device) for s in SHAPES] for _ in range(2))
    steps = [torch.ones((), device=device) for _ in SHAPES]
    grad_scale, found_inf = torch.tensor(2.0, device=device), torch.tensor(0.0, device=device)
    out = [("AdamW torch fused", lambda: torch._fused_adamw_(
        params, grads, exp_avg, exp_avg_sq, [], steps, amsgrad=False, maximize=False, grad_scale=grad_scale,
        found_inf=found_inf, **HYPER))]
    addresses = torch.tensor([t.data_ptr() for ts in (params, grads, exp_avg, exp_avg_sq, steps) for t in ts], device=device)
    amax = torch.zeros(len(SHAPES), dtype=torch.int32, device=device)
    h = HYPER
    for block in BLOCKS:
        block_param, first = block_tables(tuple(flat_programs(p.numel(), block) for p in params), device)
        numel = torch.tensor([p.numel() for p in params], device=device)
        for warps in WARPS:
            out.append((f"AdamW triton {block} x {warps} warps", lambda bp=block_param, f=first, n=numel, b=block, w=warps: adamw_kernel[(bp.numel(),)](
                addresses, bp, f, n, grad_scale, found_inf, amax, len(SHAPES), h["lr"], h["beta1"], h["beta2"],
                math.log2(h["beta1"]), math.log2(h["beta2"]), h["eps"], h["weight_decay"], P_DTYPE=tl.float32,
                G_DTYPE=tl.float32, S_DTYPE=tl.float32, HAS_SCALE=True, HAS_INF=True, BLOCK=b, num_warps=w)))
    return out, params
