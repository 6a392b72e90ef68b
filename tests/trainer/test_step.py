"""trainer/step.py: a non-finite step leaves weights, optimizer state and the LR schedule untouched;
a finite one is clipped as clip_grad_norm_ clips. Fused AdamW (guard on the device) and foreach
(guard on the host), on the CPU and, where there is one, on CUDA. StepRunner returns a frozen
StepResult with the next step's batches; the crash handler saves from the loop's progress."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainer.config import Float8TrainingConfig, ProfilingConfig
from trainer.crash import unexpected
from trainer.float8_seam.seam import Float8RunContext, build_seam
from trainer.loss import Loss
from trainer.metrics.logger import StepTimer
from trainer.metrics.profiling import StepProfiler
from trainer.step import BatchReader, StepParts, StepRunner, finish_step, train_step
from trainer.train_state import LoopProgress, TrainState

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
    return StepParts(model, optimizer, schedule, lambda m, amaxes: None, torch.device(device), None, 1, Loss(False, None), max_norm)


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



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["fused", "triton"])
def test_a_fused_step_is_queued_without_waiting_for_the_device(impl):
    # A host wait before finish_step (a blocking copy of the batch or its token count) leaves the
    # device idle while the host queues the next forward; sync debug mode makes any such wait raise.
    parts = _parts("cuda", "fused", max_norm=1.0)
    if impl == "triton":
        from trainer.adamw_triton import TritonAdamW

        parts = dataclasses.replace(parts, optimizer=TritonAdamW(parts.model.parameters(), 1e-2, (0.9, 0.95), 1e-8))
    _step(parts, poison=False)  # the optimizer's state and tables are built at its first step

    def loss_sum(mb):
        return (parts.model(mb["x"]) ** 2).sum() * mb["poison"]

    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = train_step(loss_sum, _batch(poison=False), parts, StepTimer(parts.device))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert finish_step(launched, parts)[2]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.out = nn.Linear(8, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(tokens))

    def set_requires_gradient_sync(self, requires: bool) -> None:
        pass


class ListLoader:
    """A loader of `n` batches whose state is how many it has handed out."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.batches = [{"input_ids": torch.randint(0, 11, (2, 5), generator=g),
                         "labels": torch.randint(0, 11, (2, 5), generator=g)} for _ in range(n)]
        self.read = 0

    def __iter__(self):
        for batch in self.batches:
            self.read += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"read": self.read}


def test_the_optimizers_weight_amaxes_reach_the_post_step_hook():
    # trainer/adamw_triton.py's optimizer computes them in its step; the float8 seam takes them.
    class WithAmaxes(torch.optim.AdamW):
        def weight_amaxes(self):
            return {p: p.detach().abs().max() for p in self.param_groups[0]["params"]}

    parts, received = _parts("cpu", "fused", 1.0), []
    for optimizer in (WithAmaxes(parts.model.parameters(), lr=1e-2, fused=True),
                      torch.optim.AdamW(parts.model.parameters(), lr=1e-2, fused=True)):
        _step(dataclasses.replace(parts, optimizer=optimizer, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                                  after_optimizer_step=lambda m, amaxes: received.append(amaxes)), poison=False)
    assert [set(a) if a is not None else None for a in received] == [set(parts.model.parameters()), None]


def _runner(n_batches: int, last_step: int) -> tuple[StepRunner, BatchReader]:
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    parts = StepParts(model, optimizer, schedule, lambda m, amaxes: None, torch.device("cpu"), None, 1, Loss(False, None), 1.0)
    reader = BatchReader(ListLoader(n_batches), 1, "data/x")
    float8 = build_seam(Float8TrainingConfig(), Float8RunContext("cpu", "none", "float32", False, 10))
    profiler = StepProfiler(ProfilingConfig(), Path("unused"), 0, torch.device("cpu"))
    return StepRunner(parts, reader, float8, profiler, last_step, is_main=True), reader


def test_a_step_returns_a_frozen_result_with_the_next_steps_batches():
    runner, reader = _runner(n_batches=3, last_step=2)
    first = reader.read()
    assert first.data_state == {"read": 1}
    result = runner.run(1, first.micro_batches)
    assert result.step == 1 and result.applied and math.isfinite(result.loss) and result.seconds > 0
    assert result.upcoming.data_state == {"read": 2} and result.data_error is None
    assert 0 <= result.phases.forward_backward_s() <= result.seconds
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.loss = 0.0
    between = time.perf_counter()
    time.sleep(0.2)  # the loop's work between steps (logging, a save): part of the next step's period
    last = runner.run(2, result.upcoming.micro_batches)
    assert last.applied and last.upcoming is None  # an applied last step reads nothing more
    # The period runs from the previous step's end: on a GPU the previous update runs while the host
    # is between steps, and a time from this step's start alone left it out (tokens/s 20% too high).
    assert last.seconds >= time.perf_counter() - between - 1e-3 >= 0.2


def test_running_out_of_data_is_the_steps_data_error():
    runner, reader = _runner(n_batches=1, last_step=3)
    result = runner.run(1, reader.read().micro_batches)
    assert result.applied and str(result.data_error) == "data.path 'data/x' produced no batches"


class FakeCheckpointer:
    def __init__(self) -> None:
        self.saved_with: list = []

    def save_after_failure(self, data_state: dict | None) -> str:
        self.saved_with.append(data_state)
        return "checkpoint of step 3 saved"


def test_the_crash_handler_saves_from_the_loop_progress(tmp_path):
    progress = LoopProgress(TrainState(step=3), data_state={"read": 3})
    checkpointer = FakeCheckpointer()
    error = unexpected(RuntimeError("boom"), str(tmp_path), progress, checkpointer)
    assert checkpointer.saved_with == [{"read": 3}]
    assert str(error).startswith("unexpected RuntimeError: boom (after step 3: checkpoint of step 3 saved; traceback in ")
    assert "before any step" not in str(unexpected(RuntimeError("boom"), str(tmp_path)))


def test_loop_progress_counts_applied_and_skipped_steps():
    progress = LoopProgress(TrainState(step=4))
    progress.begin(10.0)
    assert (progress.first_step, progress.start_time) == (5, 10.0)
    progress.count(5, applied=False, tokens=7)
    progress.count(5, applied=False, tokens=7)
    assert (progress.counters.step, progress.skipped_in_a_row, progress.skipped_total) == (4, 2, 2)
    progress.count(5, applied=True, tokens=7)
    assert (progress.counters.step, progress.counters.tokens_seen, progress.skipped_in_a_row) == (5, 21, 0)
