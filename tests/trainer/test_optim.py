"""Learning-rate schedule and optimizer parameter groups."""

import math
from itertools import pairwise

import pytest
import torch
from torch import nn

from trainer import optim
from trainer.config import LRSchedulerConfig, OptimizerConfig
from trainer.errors import UserError
from trainer.optim import build_lr_scheduler, build_optimizer, lr_multiplier


def _lrs(decay: str, steps: int = 10, warmup: int = 3, floor: float = 0.1) -> list[float]:
    model = nn.Linear(4, 4)
    opt = build_optimizer(model, OptimizerConfig(lr=1.0))
    sched = build_lr_scheduler(opt, LRSchedulerConfig(warmup_steps=warmup, decay=decay, min_lr_ratio=floor), steps)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("decay", ["linear", "cosine", "none"])
def test_warmup_rises_linearly_to_the_peak(decay):
    lrs = _lrs(decay)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_linear_and_cosine_decay_to_the_floor():
    linear, cosine = _lrs("linear"), _lrs("cosine")
    # 7 decay steps after 3 of warmup; the last step sits 6/7 of the way down.
    assert linear[3:] == pytest.approx([0.1 + 0.9 * (1 - k / 7) for k in range(7)])
    assert cosine[3:] == pytest.approx([0.1 + 0.45 * (1 + math.cos(math.pi * k / 7)) for k in range(7)])
    assert all(a > b for a, b in pairwise(cosine[3:]))
    assert lr_multiplier(10, 10, LRSchedulerConfig(warmup_steps=3, decay="cosine", min_lr_ratio=0.1)) == pytest.approx(0.1)
    assert lr_multiplier(50, 10, LRSchedulerConfig(warmup_steps=3, decay="linear", min_lr_ratio=0.1)) == pytest.approx(0.1)


def test_no_decay_stays_at_the_peak():
    assert _lrs("none")[3:] == pytest.approx([1.0] * 7)


def test_weight_decay_skips_vectors():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.1))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert {p.ndim for p in decayed["params"]} == {2}
    assert {p.ndim for p in plain["params"]} == {1}
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(
        p.numel() for p in model.parameters()
    )
    assert isinstance(opt, torch.optim.AdamW)


@pytest.mark.parametrize(("implementation", "fused", "foreach"),
                         [("auto", True, None), ("fused", True, None), ("foreach", None, True), ("for-loop", None, False)])
def test_auto_on_a_cpu_is_the_fused_adamw_that_takes_the_guard(implementation, fused, foreach):
    # trainer/step.py keeps the clip and non-finite guard on the device only with fused=True.
    opt = build_optimizer(nn.Linear(4, 4), OptimizerConfig(implementation=implementation))
    assert opt.defaults.get("fused") == fused and opt.defaults.get("foreach") == foreach
    assert type(opt) is torch.optim.AdamW  # the Triton AdamW (a subclass) only on CUDA


def test_auto_on_cuda_is_the_triton_adamw_where_triton_imports():
    assert optim._auto("cuda", has_triton=True) == "triton"
    assert optim._auto("cpu", has_triton=True) == "fused"
    assert optim._auto("cuda", has_triton=False) == "fused"


def test_triton_adamw_without_a_gpu_is_one_line(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match=r"^optimizer.implementation = 'triton' needs Triton \(torch's CUDA builds\) and a CUDA device, got cpu"):
        build_optimizer(nn.Linear(4, 4), OptimizerConfig(implementation="triton"))
