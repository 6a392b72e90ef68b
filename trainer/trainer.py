"""The training loop and the build order that precedes it.

Build order (docs/design.md): tokenizer + data -> model on meta -> float8 conversion ->
FLOPs per token -> TP -> AC -> compile -> FSDP2 -> materialise + init/load ->
optimizer and LR schedule -> (resume) -> loop, with the float8 post-step hook.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from models.llama import num_params
from trainer.checkpoint.context import CheckpointContext
from trainer.checkpoint.manager import CheckpointManager
from trainer.config import Config, check_layout, to_toml
from trainer.data.exchange import world_exchange
from trainer.data.loader import build_dataloader
from trainer.data.sft import SFTOptions
from trainer.data.tokenizer import Tokenizer
from trainer.distributed import process_group
from trainer.distributed.memory_plan import check_plan
from trainer.distributed.parallelize import parallelize_llama
from trainer.errors import UserError
from trainer.float8_training import Float8Training
from trainer.log import info, warn
from trainer.loss import IGNORE_INDEX, cross_entropy_sum, loss_context
from trainer.metrics.logger import (
    MetricsLogger,
    StepTimer,
    flops_per_token,
    gpu_bf16_peak_flops,
    memory_stats,
    reset_peak_memory,
)
from trainer.metrics.profiling import StepProfiler
from trainer.model_setup import build_meta_model, model_args_for
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.precision import resolve_param_precision
from trainer.run_facts import RunFacts, startup_summary
from trainer.run_folder import move_previous_records
from trainer.train_state import StopRequest, TrainState, seed_everything
from trainer.validation import Validator


def sft_options(cfg: Config) -> SFTOptions | None:
    return SFTOptions.from_config(cfg.data) if cfg.data.kind == "sft" else None


class Trainer:
    """Owns the model, optimizer, data and metrics for one run."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        device_type = process_group.pick_device_type(cfg.training.device)
        if device_type == "cuda" and not torch.cuda.is_available():
            raise UserError("training.device = 'cuda' but no CUDA device is available")
        # Resolved in the config itself, so config.toml records the dtype the run uses.
        self.param_precision = resolve_param_precision(cfg.training.mixed_precision_param, device_type)
        cfg.training.mixed_precision_param = self.param_precision.dtype
        # Checks that need no process group come first: a bad layout or tokenizer then
        # fails on every rank before any rank waits for the others.
        self.tokenizer = Tokenizer(cfg.model.tokenizer_path)
        self.model_args = model_args_for(cfg, self.tokenizer.n_words)
        dp, tp = check_layout(cfg, process_group.planned_world_size(), self.model_args.n_heads, self.model_args.n_kv_heads)
        self.dp, self.tp = dp, tp
        self.vocab_sharded_logits = tp > 1 and cfg.parallelism.loss_parallel
        self.dist = process_group.init_distributed(device_type)
        self.device = self.dist.device
        self.is_main = self.dist.is_main
        # Before the data is read and any weight allocated: a plan whose memory cannot fit is
        # refused with the numbers (trainer/distributed/memory_plan.py).
        self.memory, _ = check_plan(cfg, self.model_args, self.device, dp, tp, cfg.training.mixed_precision_param)
        seed_everything(cfg.training.seed, cfg.training.deterministic)
        self.mesh = process_group.build_mesh(device_type, dp, tp)
        self.dp_rank = self.mesh["dp"].get_local_rank()

        # One gloo group for the training and held-out loaders: they read in turn, on this thread,
        # in the same order on every rank.
        self.data_exchange = world_exchange()
        self.dataloader = self._loader(cfg.data.path, cfg.data.num_workers)
        self.validator = None
        if cfg.validation.enable:
            # No workers: the loader restarts for every evaluation and reads only `steps` batches.
            self.validator = Validator(
                cfg.validation, self._loader(cfg.validation.path, 0), cfg.training.steps, device=self.device,
                dp_group=self.mesh["dp"].get_group(), vocab_sharded_logits=self.vocab_sharded_logits,
                accuracy=cfg.data.kind == "sft",
            )

        model = build_meta_model(self.model_args)
        # Float8 off gives a no-op seam: nothing below asks whether float8 is on.
        self.float8 = Float8Training.from_config(cfg, device_type)
        self.float8.convert(model)
        self.facts = RunFacts.for_run(
            cfg, process_group.planned_world_size(), dp, tp, self.param_precision.dtype, num_params(model),
            flops_per_token(num_params(model, exclude_embedding=True), self.model_args.n_layers, self.model_args.dim,
                            cfg.training.seq_len),
        )
        # Before any weight is allocated: the advice refuses float8 on GPUs without float8 GEMMs.
        self.advice = self.float8.advice(self.device, dp, tp)
        if self.param_precision.warning:
            self.advice.insert(0, self.param_precision.warning)
        self.model = parallelize_llama(model, self.mesh, cfg, self.float8.tp_styles())
        self._materialize()

        self.optimizer = build_optimizer(self.model, cfg.optimizer, device_type)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.state = TrainState()
        self.device_name, self.peak_flops = gpu_bf16_peak_flops(self.device)

        self.checkpointer = CheckpointManager(
            model=self.model, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, dataloader=self.dataloader,
            train_state=self.state, context=CheckpointContext.for_run(
                cfg, self.model_args, self.dist, dp, tp, self.facts.global_batch
            ),
        )
        self.stop_request = StopRequest(self.device, saving=cfg.checkpoint.enable)

    # -- setup helpers -------------------------------------------------------

    def _loader(self, path: str, num_workers: int):
        """The data loader for `path` (training or held-out data) with this run's data settings."""
        cfg = self.cfg
        return build_dataloader(
            kind=cfg.data.kind, path=path, tokenizer=self.tokenizer, seq_len=cfg.training.seq_len,
            batch_size=cfg.training.batch_size, dp_rank=self.dp_rank, dp_degree=self.dp, seed=cfg.training.seed,
            text_field=cfg.data.text_field, data_format=cfg.data.format, sft_options=sft_options(cfg),
            bad_rows=cfg.data.bad_rows, num_workers=num_workers, exchange=self.data_exchange,
            verbose=self.is_main,
        )

    def _materialize(self) -> None:
        """Allocate the sharded weights and initialise them identically for any layout."""
        from trainer.model_setup import init_weights

        init_weights(self.model, self.model_args, self.cfg, self.device)

    def _startup_summary(self) -> None:
        params = f"params {self.facts.param_dtype} ({self.param_precision.reason})"
        peak = f"{self.peak_flops / 1e12:.0f} TFLOP/s bf16 dense peak" if self.peak_flops else "no known peak (MFU off)"
        lines = startup_summary(
            self.facts, self.cfg, self.model_args.n_layers, self.model_args.attention, f"{self.device_name} ({peak})",
            self.float8.describe(params), self.memory.summary(),
        )
        for line in lines + self.float8.summary_lines():
            info(line)

    # -- the loop ------------------------------------------------------------

    def _next_micro_batches(self, data_iter) -> list[dict[str, torch.Tensor]]:
        try:
            return [next(data_iter) for _ in range(self.cfg.training.gradient_accumulation_steps)]
        except StopIteration:
            raise UserError(f"data.path '{self.cfg.data.path}' produced no batches") from None

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        kwargs = {k: batch[k] for k in ("position_ids", "document_ids") if k in batch}
        return cross_entropy_sum(self.model(batch["input_ids"], **kwargs), batch["labels"])

    def train_step(
        self, micro_batches: list[dict[str, torch.Tensor]], timer: StepTimer
    ) -> tuple[float, float, bool, Any]:
        """One optimizer step over the micro-batches, applied only when its loss and grad norm are finite.

        Returns the mean loss, the grad norm, whether the step was applied and the timer
        mark where backward ended. Reading the loss and grad norm waits for backward (one
        sync per step): the decision must precede the optimizer step, and a non-finite
        gradient applied once would leave non-finite weights behind.
        """
        cfg = self.cfg
        # The loss is a mean over every target token of the global batch, so the same
        # step gives the same gradient whatever the DP degree or accumulation split.
        # Counted on the host copies: no device sync.
        n_local = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
        micro_batches = [{k: v.to(self.device, non_blocking=True) for k, v in mb.items()} for mb in micro_batches]
        n_tokens = torch.tensor(n_local, device=self.device, dtype=torch.float64)
        dp_group = self.mesh["dp"].get_group()
        dist.all_reduce(n_tokens, group=dp_group)
        n_tokens = n_tokens.clamp(min=1.0)
        # FSDP averages gradients over dp ranks; this makes the result a global token mean.
        loss_scale = self.dp / n_tokens
        loss_total = torch.zeros((), device=self.device, dtype=torch.float64)
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(i == last)
            with loss_context(self.vocab_sharded_logits):
                loss_sum = self._loss_sum(mb)
                (loss_sum * loss_scale).backward()
            loss_total += loss_sum.detach().double()
        dist.all_reduce(loss_total, group=dp_group)
        t_backward = timer.mark()
        max_norm = cfg.training.max_norm if cfg.training.max_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        # Both are global (all-reduced), so every rank takes the same decision.
        loss, norm = torch.stack([loss_total / n_tokens, grad_norm.double()]).tolist()
        applied = math.isfinite(loss) and math.isfinite(norm)
        if applied:
            self.optimizer.step()
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if applied:
            self.float8.post_optimizer_step(self.model)
        return loss, norm, applied, t_backward

    def _skip_or_stop(self, step: int, loss: float, grad_norm: float, in_a_row: int) -> None:
        """A step left unapplied for a non-finite loss or grad norm: warn, or stop past the allowed run of them."""
        which, value = ("loss", loss) if not math.isfinite(loss) else ("grad_norm", grad_norm)
        limit = self.cfg.training.skip_nonfinite_steps
        if in_a_row > limit:
            allowed = f" ({in_a_row} in a row, training.skip_nonfinite_steps = {limit})" if limit else ""
            raise UserError(
                f"step {step}: {which} is {value}, the step was not applied{allowed}; lower optimizer.lr or "
                "raise lr_scheduler.warmup_steps (or allow skipped steps with training.skip_nonfinite_steps)"
            )
        if self.is_main:
            warn(f"step {step}: {which} is {value}, step skipped and retried on the next batch "
                 f"({in_a_row} of at most {limit} in a row)")

    def _data_stats(self) -> dict[str, int]:
        """Epoch, bad rows skipped and, for SFT, samples truncated or dropped to fit seq_len (data/* in the metrics)."""
        stats = self.data_state["dataset_state"]
        keys = ("epoch", "samples", "truncated", "dropped", "bad_rows")
        return {f"data/{k}": int(stats[k]) for k in keys if k in stats}

    def _stop_on_data_error(self, error: UserError, first_step: int) -> None:
        """Save the last completed step, then stop naming the step whose batches hit the bad row.

        Every rank learns of each row in the same exchange round (trainer/data/loader.py), so all ranks meet
        the row together and save together.
        """
        step = self.state.step
        if not self.cfg.checkpoint.enable:
            saved = "no checkpoint (checkpointing disabled)"
        elif step >= first_step:
            self.checkpointer.maybe_save(self.data_state, force=True)
            saved = f"checkpoint of step {step} saved"
        else:
            saved = "no checkpoint saved (no step completed in this run)"
        raise UserError(
            f"step {step + 1}: {error}; {saved} (data.bad_rows = \"skip\" skips such rows)"
        )

    def train(self) -> None:
        cfg = self.cfg
        dump = Path(cfg.job.dump_folder)
        if self.is_main:
            self._startup_summary()
            for message in self.advice:
                warn(message)
        resumed = self.checkpointer.load_latest()
        # The first write, once every input (data, tokenizer, checkpoint) has been accepted: a
        # fresh run moves an earlier run's records aside instead of overwriting them. The config
        # is written after the load, which may put the checkpoint's values in force.
        if self.is_main:
            if resumed:
                info(f"resumed from checkpoint at step {self.state.step} ({self.checkpointer.last_loaded})")
            else:
                kept = move_previous_records(dump)
                if kept is not None:
                    info(f"the previous run's records in {dump} were moved to {kept}")
            (dump / "config.toml").write_text(to_toml(cfg))
        logger = MetricsLogger(str(dump), self.facts.run_name, cfg.metrics.enable_tensorboard, self.is_main,
                               config_text=to_toml(cfg), resume_step=self.state.step if resumed else None)
        profiler = StepProfiler(cfg.profiling, dump, self.dist.rank, self.device)
        self.stop_request.install()
        timer = StepTimer(self.device)
        self.model.train()
        data_iter = iter(self.dataloader)
        train_start = time.perf_counter()
        first_step = self.state.step + 1
        skipped_total = skipped_in_a_row = 0
        try:
            try:
                micro_batches = self._next_micro_batches(data_iter)
            except UserError as e:
                raise UserError(f"step {first_step}: {e}") from None
            # The loader state after the batches of the step about to run: what a checkpoint
            # of that step records, although the next step's batches are read meanwhile.
            self.data_state = self.dataloader.state_dict()
            while self.state.step < cfg.training.steps:
                step = self.state.step + 1
                reset_peak_memory(self.device)
                with profiler.step(step):
                    t_start = time.perf_counter()
                    t_launch = timer.mark()
                    loss, grad_norm, applied, t_backward = self.train_step(micro_batches, timer)
                    t_done = timer.mark()
                    # The device runs the optimizer step while the host reads the next batches;
                    # a skipped step is retried on them, so the last step may need them too.
                    t_data = time.perf_counter()
                    data_error = None
                    if step < cfg.training.steps or not applied:
                        try:
                            next_batches = self._next_micro_batches(data_iter)
                            next_state = self.dataloader.state_dict()
                        except UserError as e:  # a bad data row: this step is still completed and saved
                            data_error = e
                    data_time = time.perf_counter() - t_data
                t_end = time.perf_counter()
                self.state.tokens_seen += self.facts.tokens_per_step
                if applied:
                    self.state.step = step
                    skipped_in_a_row = 0
                else:
                    skipped_total += 1
                    skipped_in_a_row += 1
                    self._skip_or_stop(step, loss, grad_norm, skipped_in_a_row)
                validation = {}
                if applied and self.validator is not None and self.validator.due(step):
                    validation = self.validator.evaluate(self.model, step)
                if applied and (
                    step == 1 or step % cfg.metrics.log_freq == 0 or step == cfg.training.steps or validation
                ):
                    step_time = t_end - t_start
                    tps = self.facts.tokens_per_gpu / step_time
                    tflops = tps * self.facts.flops_per_token / 1e12
                    record = {
                        "step": step, "loss": loss, "grad_norm": grad_norm,
                        "lr": self.lr_scheduler.get_last_lr()[0], "tps": tps, "tflops": tflops,
                        "mfu_pct": 100 * tflops * 1e12 / self.peak_flops if self.peak_flops else None,
                        "step_time_s": step_time, "data_time_s": data_time,
                        "fwd_bwd_time_s": timer.seconds(t_launch, t_backward),
                        "optim_time_s": timer.seconds(t_backward, t_done),
                        **memory_stats(self.device), "tokens_seen": self.state.tokens_seen,
                        "skipped_steps": skipped_total, **self._data_stats(), **validation,
                    }
                    done = step - first_step + 1
                    eta = (time.perf_counter() - train_start) / done * (cfg.training.steps - step)
                    logger.log(record, cfg.training.steps, eta)
                if data_error is not None:
                    self._stop_on_data_error(data_error, first_step)
                stop = self.stop_request.agreed()
                step = self.state.step
                self.checkpointer.maybe_save(self.data_state, force=stop or step == cfg.training.steps)
                if stop:
                    if self.is_main:
                        saved = "checkpoint saved" if cfg.checkpoint.enable else "no checkpoint (checkpointing disabled)"
                        info(f"stopped at step {step} on request; {saved}")
                    break
                if step < cfg.training.steps:
                    micro_batches, self.data_state = next_batches, next_state
            self.checkpointer.maybe_export_final()
        finally:
            self.checkpointer.close()
            logger.close()
