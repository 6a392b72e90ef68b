"""AdamW and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import importlib.util
import math
import os

import torch
from torch import nn

from trainer.config import LRSchedulerConfig, OptimizerConfig
from trainer.errors import UserError


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay on matrices only (norm weights are not decayed)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # Fused (CUDA and CPU kernels) and triton also take the clip and the non-finite guard (trainer/step.py).
    params = decay + no_decay
    device = params[0].device.type if params else "cpu"
    has_triton = importlib.util.find_spec("triton") is not None
    impl = _auto(device, has_triton) if cfg.implementation == "auto" else cfg.implementation
    if impl == "triton":
        return _triton_adamw(groups, device, has_triton, cfg)
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs)


def _auto(device: str, has_triton: bool) -> str:
    """triton on CUDA where Triton imports (its AdamW moves the same bytes faster than torch's fused one and
    computes the float8 weights' amaxes in the same pass: docs/benchmarks.md), fused elsewhere."""
    return "triton" if device == "cuda" and has_triton else "fused"


def _triton_adamw(groups: list[dict], device: str, has_triton: bool, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    if not has_triton or (device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        raise UserError(f"optimizer.implementation = 'triton' needs Triton (torch's CUDA builds) and a CUDA device, got {device}"
                        + ("" if has_triton else " and no Triton"))
    from trainer.adamw_triton import TritonAdamW

    return TritonAdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def lr_multiplier(step: int, total_steps: int, cfg: LRSchedulerConfig) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based, before the step runs)."""
    warmup = cfg.warmup_steps
    if warmup and step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.decay == "none":
        return 1.0
    span = max(total_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    if cfg.decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, total_steps, cfg))
