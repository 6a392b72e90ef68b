"""One training step: the optimizer step with the non-finite guard (`train_step`, `finish_step`), and
`StepRunner`, which runs it for the loop and returns a frozen `StepResult`.

A step's loss is a mean over every target token of the global batch, so the same step gives
the same gradient whatever the DP degree or accumulation split; the step is applied only
when its loss and grad norm are finite, decided on global values so every rank agrees.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from trainer.errors import UserError
from trainer.float8_seam.seam import Float8Seam
from trainer.host_copies import queued_to
from trainer.log import warn
from trainer.loss import IGNORE_INDEX, Loss
from trainer.metrics.logger import StepTimer, reset_peak_memory
from trainer.metrics.profiling import StepProfiler


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What a training step works with: the model and its optimizer, and the layout facts it needs."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    # Called after each optimizer step (the float8 seam's post-step hook), with the weights' amaxes
    # where the optimizer computed them (trainer/adamw_triton.py's `weight_amaxes`).
    after_optimizer_step: Callable[[nn.Module, Mapping[torch.Tensor, torch.Tensor] | None], None]
    device: torch.device
    dp_group: Any
    dp: int
    loss: Loss
    max_norm: float


@dataclasses.dataclass
class LaunchedStep:
    """A step whose update is queued: its loss and grad norm (2 float64s) are read by `finish_step`."""

    values: torch.Tensor
    t_backward: Any
    # Set when `values` is an in-flight copy to the host: the event that marks it complete.
    copied: Any = None


def train_step(
    loss_sum: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    micro_batches: list[dict[str, torch.Tensor]],
    parts: StepParts,
    timer: StepTimer,
) -> LaunchedStep:
    """One optimizer step over the micro-batches, applied only when its loss and grad norm are finite.

    With the fused AdamW the clip and the guard stay on the device: the clip divisor goes in
    as the kernel's `grad_scale` and non-finiteness as its `found_inf` (the kernel then leaves
    weights, moments and step count untouched), so nothing waits between backward and the
    update; `finish_step` reads the loss and grad norm once backward is done, while the
    update runs. Other optimizers cannot skip themselves: the loss and grad norm are read
    first, and a non-finite step is not run.
    """
    model, device = parts.model, parts.device
    # Counted on the host copies: no device sync.
    n_local = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
    micro_batches = [{k: queued_to(device, v) for k, v in mb.items()} for mb in micro_batches]
    n_tokens = _summed_over_dp(queued_to(device, torch.tensor(n_local, dtype=torch.float64)), parts).clamp(min=1.0)
    # FSDP averages gradients over dp ranks; this makes the result a global token mean.
    loss_scale = parts.dp / n_tokens
    loss_total = torch.zeros((), device=device, dtype=torch.float64)
    last = len(micro_batches) - 1
    for i, mb in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == last)
        with parts.loss.context():
            summed = loss_sum(mb)
            (summed * loss_scale).backward()
        loss_total += summed.detach().double()
    _summed_over_dp(loss_total, parts)
    t_backward = timer.mark()
    grad_norm = _global_grad_norm(model)
    values = torch.stack([loss_total / n_tokens, grad_norm.double()])
    if _skips_itself(parts.optimizer):
        # The copy is queued before the update, so `finish_step` waits for backward and the
        # norm only: the device runs the update while the host reads the next batches and
        # queues the next forward.
        launched = _copy_to_host(values, t_backward)
        _fused_guarded_step(parts.optimizer, values, grad_norm, parts.max_norm)
    else:
        launched = LaunchedStep(values.cpu(), t_backward)
        if _finite(launched.values):
            if parts.max_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(model.parameters(), parts.max_norm, grad_norm, foreach=True)
            parts.optimizer.step()
    parts.optimizer.zero_grad(set_to_none=True)
    # After a skipped step it recomputes what the unchanged weights already gave.
    weight_amaxes = getattr(parts.optimizer, "weight_amaxes", None)
    parts.after_optimizer_step(model, weight_amaxes() if weight_amaxes is not None else None)
    return launched


def _summed_over_dp(t: torch.Tensor, parts: StepParts) -> torch.Tensor:
    """`t` summed in place over the data-parallel ranks (at one, no collective to launch)."""
    if parts.dp > 1:
        dist.all_reduce(t, group=parts.dp_group)
    return t


def finish_step(launched: LaunchedStep, parts: StepParts) -> tuple[float, float, bool]:
    """The step's loss, grad norm and whether it was applied; advances the LR schedule if it was.

    Waits only for the step's own values, not for the update queued after them.
    """
    if launched.copied is not None:
        launched.copied.synchronize()
    applied = _finite(launched.values)
    if applied:
        parts.lr_scheduler.step()
    loss, norm = launched.values.tolist()
    return loss, norm, applied


def _global_grad_norm(model: nn.Module) -> torch.Tensor:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _skips_itself(optimizer: torch.optim.Optimizer) -> bool:
    """Torch's fused Adam(W) takes `grad_scale` and `found_inf` from the optimizer's attributes (and
    trainer/adamw_triton.py's, built as a fused one)."""
    return bool(optimizer.defaults.get("fused"))


def _fused_guarded_step(
    optimizer: torch.optim.Optimizer, values: torch.Tensor, grad_norm: torch.Tensor, max_norm: float
) -> None:
    found_inf = (~torch.isfinite(values).all()).float()
    # clip_grad_norm_ multiplies by min(max_norm / (norm + 1e-6), 1); the kernel divides by grad_scale.
    grad_scale = (grad_norm.float() + 1e-6).div(max_norm).clamp(min=1.0) if max_norm > 0 else None
    optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def _copy_to_host(values: torch.Tensor, t_backward: Any) -> LaunchedStep:
    if values.device.type != "cuda":
        return LaunchedStep(values.cpu(), t_backward)
    host = values.to("cpu", non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return LaunchedStep(host, t_backward, copied)


def _finite(values: torch.Tensor) -> bool:
    return bool(torch.isfinite(values).all())


@dataclasses.dataclass(frozen=True)
class Batches:
    """A step's micro-batches and the loader state after them (what a checkpoint of that step records),
    or the bad data row (a UserError) that stopped their reading."""

    micro_batches: list[dict[str, torch.Tensor]] | None = None
    data_state: dict[str, Any] | None = None
    error: UserError | None = None


class BatchReader:
    """Reads each step's micro-batches from the training loader; create it once the loader's state is restored."""

    def __init__(self, loader: StatefulDataLoader, accumulation: int, data_path: str) -> None:
        self.loader = loader
        self.accumulation = accumulation
        self.data_path = data_path
        self._batches = iter(loader)

    def micro_batches(self) -> list[dict[str, torch.Tensor]]:
        try:
            return [next(self._batches) for _ in range(self.accumulation)]
        except StopIteration:
            raise UserError(f"data.path '{self.data_path}' produced no batches") from None

    def read(self) -> Batches:
        try:
            return Batches(self.micro_batches(), self.loader.state_dict())
        except UserError as e:  # a bad data row: the step that read it still completes
            return Batches(error=e)


@dataclasses.dataclass(frozen=True)
class PhaseMarks:
    """Where a step's forward-backward began and ended (StepTimer marks). Both precede the loss on the
    device, so reading them once the loss is in hand waits for nothing."""

    timer: StepTimer
    launch: Any
    backward: Any

    def forward_backward_s(self) -> float:
        return self.timer.seconds(self.launch, self.backward)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one step produced: its loss and grad norm, whether it was applied, its times, and the
    batches of the step after it (None after an applied last step)."""

    step: int
    loss: float
    grad_norm: float
    applied: bool
    # Wall time from the previous step's loss to this one's (the first step: from its start): the
    # whole period of a step, its optimizer update and whatever the host did between steps included.
    seconds: float
    data_seconds: float
    phases: PhaseMarks
    upcoming: Batches | None
    # metrics.float8_stats_freq's float8/ metrics, on the steps that read them.
    float8_health: Mapping[str, Any]

    @property
    def data_error(self) -> UserError | None:
        return self.upcoming.error if self.upcoming is not None else None


class StepRunner:
    """Runs the loop's steps: each one's float8 health, profiling and timing around `train_step`, and
    the next step's batches, read while the device runs the update."""

    def __init__(self, parts: StepParts, reader: BatchReader, float8: Float8Seam, profiler: StepProfiler,
                 last_step: int, is_main: bool) -> None:
        self.parts = parts
        self.reader = reader
        self.float8 = float8
        self.profiler = profiler
        self.last_step = last_step
        self.is_main = is_main
        self.timer = StepTimer(parts.device)
        self.last_end: float | None = None

    def loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One micro-batch's summed loss; a method so that tests/wrappers/train_nonfinite.py and train_crash.py can poison it."""
        return self.parts.loss(self.parts.model, batch)[1]

    def run(self, step: int, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        """Step `step` on `micro_batches`, the step after it read meanwhile (or, after a skipped last step, its retry's)."""
        parts = self.parts
        reset_peak_memory(parts.device)
        with self.profiler.step(step):
            t_start = time.perf_counter()
            self.float8.arm_health(parts.model, step, parts.device)
            t_launch = self.timer.mark()
            launched = train_step(self.loss_sum, micro_batches, parts, self.timer)
            last = step == self.last_step
            t_data = time.perf_counter()
            upcoming = None if last else self.reader.read()  # read while the device runs the update
            data_seconds = time.perf_counter() - t_data
            loss, grad_norm, applied = finish_step(launched, parts)
            if last and not applied:  # a skipped step is retried on the next batches
                upcoming = self.reader.read()
        # From the previous step's end, not this step's start: the device runs the previous update
        # while the host starts this step, and a period that began at t_start would leave it out.
        end = time.perf_counter()
        seconds = end - (t_start if self.last_end is None else self.last_end)
        self.last_end = end
        health = self.float8.read_health()
        for message in health.warnings if self.is_main else ():
            warn(message)
        return StepResult(
            step=step, loss=loss, grad_norm=grad_norm, applied=applied, seconds=seconds, data_seconds=data_seconds,
            phases=PhaseMarks(self.timer, t_launch, launched.t_backward), upcoming=upcoming,
            float8_health=health.metrics,
        )


def skip_or_stop(result: StepResult, in_a_row: int, limit: int, is_main: bool) -> None:
    """A step left unapplied for a non-finite loss or grad norm: warn, or stop past `limit` of them in a row
    (training.skip_nonfinite_steps)."""
    step, loss, grad_norm = result.step, result.loss, result.grad_norm
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
