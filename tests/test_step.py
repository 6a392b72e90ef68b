"""trainer/step.py: a non-finite step leaves weights, optimizer state and the LR schedule untouched;
a finite one is clipped as clip_grad_norm_ clips. Fused AdamW (guard on the device) and foreach
(guard on the host), on the CPU and, where there is one, on CUDA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainer.metrics.logger import StepTimer
from trainer.step import StepParts, finish_step, train_step

pytestmark = pytest.mark.version_specific

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def set_requires_gradient_sync(self, requires: bool) -> None:  # FSDP's, called by train_step
        pass


def _parts(device: str, impl: str, max_norm: float) -> StepParts:
    torch.manual_seed(0)
    model = Tiny().to(device)
    kwargs = {"fused": True} if impl == "fused" else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **kwargs)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / 10)
    return StepParts(model, optimizer, schedule, lambda m: None, torch.device(device), None, 1, False, max_norm)


def _batch(poison: bool) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(16, 8, generator=g) * 50, "labels": torch.ones(16, dtype=torch.long),
             "poison": torch.tensor(math.nan if poison else 1.0)}]


def _step(parts: StepParts, poison: bool) -> tuple[float, float, bool]:
    def loss_sum(mb):
        return (parts.model(mb["x"]) ** 2).sum() * mb["poison"]

    launched = train_step(loss_sum, _batch(poison), parts, StepTimer(parts.device))
    return finish_step(launched, parts)


def _state(parts: StepParts) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in parts.model.parameters()]
    for s in parts.optimizer.state.values():
        tensors += [v.detach().clone() for v in s.values()]
    return tensors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_a_nonfinite_step_changes_nothing(device, impl):
    parts = _parts(device, impl, max_norm=1.0)
    assert _step(parts, poison=False)[2]
    before, lr = _state(parts), parts.optimizer.param_groups[0]["lr"]
    loss, _, applied = _step(parts, poison=True)
    assert not applied and math.isnan(loss)
    after = _state(parts)
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # weights, moments, step count
    assert parts.optimizer.param_groups[0]["lr"] == lr == pytest.approx(1e-2 * lr_multiplier_of(1))
    assert not hasattr(parts.optimizer, "found_inf") and not hasattr(parts.optimizer, "grad_scale")
    assert _step(parts, poison=False)[2]
    assert parts.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * lr_multiplier_of(2))


def lr_multiplier_of(applied_steps: int) -> float:
    return (applied_steps + 1) / 10


@pytest.mark.parametrize("device", DEVICES)
def test_fused_clip_matches_clip_grad_norm(device):
    # The batch's grad norm is far above max_norm: the update is clipped either way.
    fused, foreach = _parts(device, "fused", 0.5), _parts(device, "foreach", 0.5)
    for _ in range(3):
        loss_f, norm_f, _ = _step(fused, poison=False)
        loss_r, norm_r, _ = _step(foreach, poison=False)
        assert norm_f > 10 * 0.5
        assert loss_f == pytest.approx(loss_r, rel=1e-5) and norm_f == pytest.approx(norm_r, rel=1e-5)
    for a, b in zip(fused.model.parameters(), foreach.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Without clipping the update differs: the test sees the clip.
    unclipped = _parts(device, "fused", 0.0)
    for _ in range(3):
        _step(unclipped, poison=False)
    assert not torch.allclose(unclipped.model.linear.weight, fused.model.linear.weight, rtol=1e-3)

