"""One optimizer step with the non-finite guard, and what the loop keeps of each step.

A step's loss is a mean over every target token of the global batch, so the same step gives
the same gradient whatever the DP degree or accumulation split; the step is applied only
when its loss and grad norm are finite, decided on global values so every rank agrees.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.errors import UserError
from trainer.log import warn
from trainer.loss import IGNORE_INDEX, loss_context
from trainer.metrics.logger import StepTimer


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What a training step works with: the model and its optimizer, and the layout facts it needs."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    # Called after each applied optimizer step (the float8 seam's post-step hook).
    after_optimizer_step: Callable[[nn.Module], None]
    device: torch.device
    dp_group: Any
    dp: int
    vocab_sharded_logits: bool
    max_norm: float


def train_step(
    loss_sum: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    micro_batches: list[dict[str, torch.Tensor]],
    parts: StepParts,
    timer: StepTimer,
) -> tuple[float, float, bool, Any]:
    """One optimizer step over the micro-batches, applied only when its loss and grad norm are finite.

    Returns the mean loss, the grad norm, whether the step was applied and the timer
    mark where backward ended. Reading the loss and grad norm waits for backward (one
    sync per step): the decision must precede the optimizer step, and a non-finite
    gradient applied once would leave non-finite weights behind.
    """
    model, device = parts.model, parts.device
    # Counted on the host copies: no device sync.
    n_local = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
    micro_batches = [{k: v.to(device, non_blocking=True) for k, v in mb.items()} for mb in micro_batches]
    n_tokens = torch.tensor(n_local, device=device, dtype=torch.float64)
    dist.all_reduce(n_tokens, group=parts.dp_group)
    n_tokens = n_tokens.clamp(min=1.0)
    # FSDP averages gradients over dp ranks; this makes the result a global token mean.
    loss_scale = parts.dp / n_tokens
    loss_total = torch.zeros((), device=device, dtype=torch.float64)
    last = len(micro_batches) - 1
    for i, mb in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == last)
        with loss_context(parts.vocab_sharded_logits):
            summed = loss_sum(mb)
            (summed * loss_scale).backward()
        loss_total += summed.detach().double()
    dist.all_reduce(loss_total, group=parts.dp_group)
    t_backward = timer.mark()
    max_norm = parts.max_norm if parts.max_norm > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    loss, norm = torch.stack([loss_total / n_tokens, grad_norm.double()]).tolist()
    applied = math.isfinite(loss) and math.isfinite(norm)
    if applied:
        parts.optimizer.step()
        parts.lr_scheduler.step()
    parts.optimizer.zero_grad(set_to_none=True)
    if applied:
        parts.after_optimizer_step(model)
    return loss, norm, applied, t_backward


@dataclasses.dataclass
class LoopProgress:
    """Counters of this run of the loop (not checkpointed: a resumed run counts afresh)."""

    first_step: int
    start_time: float
    skipped_total: int = 0
    skipped_in_a_row: int = 0


@dataclasses.dataclass
class StepOutcome:
    """What one step produced: its loss and norm, whether it was applied, its times and the next batches."""

    step: int
    loss: float = math.nan
    grad_norm: float = math.nan
    applied: bool = False
    t_start: float = 0.0
    t_end: float = 0.0
    data_time: float = 0.0
    marks: tuple[Any, Any, Any] = (None, None, None)
    next_batches: list[dict[str, torch.Tensor]] | None = None
    next_state: dict[str, Any] | None = None
    data_error: UserError | None = None
    # metrics.float8_stats_freq's float8/ metrics, on the steps that read them.
    float8_health: dict[str, Any] = dataclasses.field(default_factory=dict)


def skip_or_stop(outcome: StepOutcome, in_a_row: int, limit: int, is_main: bool) -> None:
    """A step left unapplied for a non-finite loss or grad norm: warn, or stop past `limit` of them in a row
    (training.skip_nonfinite_steps)."""
    step, loss, grad_norm = outcome.step, outcome.loss, outcome.grad_norm
    which, value = ("loss", loss) if not math.isfinite(loss) else ("grad_norm", grad_norm)
    if in_a_row > limit:
        allowed = f" ({in_a_row} in a row, training.skip_nonfinite_steps = {limit})" if limit else ""
        # Before any update the learning rate cannot be the cause (non-finite initial weights
        # are refused at load): the data or the model's numerics are.
        fix = ("at step 1 no update has happened yet, so check the data and the model's precision "
               "(training.mixed_precision_param, float8)" if step == 1 else
               "lower optimizer.lr or raise lr_scheduler.warmup_steps")
        raise UserError(
            f"step {step}: {which} is {value}, the step was not applied{allowed}; {fix} "
            "(or allow skipped steps with training.skip_nonfinite_steps)"
        )
    if is_main:
        warn(f"step {step}: {which} is {value}, step skipped and retried on the next batch "
             f"({in_a_row} of at most {limit} in a row)")
