"""The training loop and the build order that precedes it.

Build order (docs/design.md): the plan (trainer/plan.py: layout, precision, float8 choices, memory
estimate, tokenizer) -> process group -> data -> model on meta -> float8 conversion -> TP -> AC ->
compile -> FSDP2 -> materialise + init/load -> optimizer and LR schedule -> (resume) -> loop
(trainer/step.py's StepRunner, with the float8 post-step hook).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

from trainer.checkpoint.context import CheckpointContext, checkpoint_folder
from trainer.checkpoint.initial_weights import check_initial_weights_fit
from trainer.checkpoint.manager import CheckpointManager
from trainer.config import Config, to_toml
from trainer.data.exchange import LocalExchange, world_exchange
from trainer.data.run_loaders import data_summary, run_loader, training_data_workers
from trainer.data.run_loaders import (
    sft_options as sft_options,  # scripts and tests import it from here
)
from trainer.distributed import process_group
from trainer.distributed.memory_plan import check_fits
from trainer.distributed.parallelize import parallelize_llama
from trainer.errors import UserError
from trainer.launch import launch_world_size, launched_by_torchrun
from trainer.log import info, warn
from trainer.loss import Loss
from trainer.metrics.logger import MetricsLogger, gpu_bf16_peak_flops, memory_stats
from trainer.metrics.profiling import StepProfiler
from trainer.metrics.wandb_sink import check_installed
from trainer.model_setup import build_meta_model, init_weights
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.plan import RunPlan
from trainer.precision import TORCH_DTYPES
from trainer.run_facts import startup_summary
from trainer.run_folder import FolderWatch, deleted, inside, keep_records
from trainer.step import BatchReader, StepParts, StepResult, StepRunner, skip_or_stop
from trainer.threads import raise_thread_failure
from trainer.train_state import LoopProgress, StopRequest, TrainState, seed_everything
from trainer.validation import Validator


class Trainer:
    """Owns the model, optimizer, data and metrics for one run."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.plan = plan = self._start()
        self.loss = Loss(plan.vocab_sharded_logits, cfg.compile.backend if plan.loss_compiled else None)
        self._build_data()
        model = build_meta_model(plan.model_args)
        plan.float8.convert(model)
        # Before any weight is allocated: the advice refuses float8 on GPUs without float8 GEMMs.
        self.advice = plan.warnings(self.device)
        self.model = parallelize_llama(
            model, self.mesh.world, tp_styles=plan.float8.tp_styles(), vocab_sharded_logits=plan.vocab_sharded_logits,
            activation_checkpoint=cfg.activation_checkpoint, compile_config=cfg.compile,
            param_dtype=TORCH_DTYPES[plan.params.dtype], reduce_dtype=TORCH_DTYPES[cfg.training.mixed_precision_reduce],
            reshard_after_forward=cfg.parallelism.reshard_after_forward, single_rank_fast_path=plan.fast_path.on,
            gradient_packing=plan.gradient_packing,
        )
        init_weights(self.model, plan.model_args, cfg.training.seed, self.device)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.state = TrainState()
        self.progress = LoopProgress(self.state)
        self.device_name, self.peak_flops = gpu_bf16_peak_flops(self.device)
        facts = plan.facts
        self.checkpointer = CheckpointManager(
            model=self.model, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, dataloader=self.dataloader,
            train_state=self.state, context=CheckpointContext.for_run(
                cfg, plan.model_args, self.dist, facts.dp, facts.tp, facts.global_batch, plan.tokenizer
            ),
        )
        self.stop_request = StopRequest(self.host_exchange.all_gather, saving=cfg.checkpoint.enable)
        self.parts = StepParts(
            self.model, self.optimizer, self.lr_scheduler, plan.float8.post_optimizer_step, self.device,
            self.mesh.data_parallel.get_group(), facts.dp, self.loss, cfg.training.max_norm,
        )

    # -- setup helpers -------------------------------------------------------

    def _start(self) -> RunPlan:
        """The run's plan, then the process group and mesh.

        Checks that need no process group come first (the plan's, the initial weights'): a bad layout
        or tokenizer then fails on every rank before any rank waits for the others.
        """
        cfg = self.cfg
        check_installed(cfg.metrics)
        simulated = cfg.parallelism.simulate_world_size
        if simulated and launched_by_torchrun():
            raise UserError("parallelism.simulate_world_size makes one process a whole world: start it with python, "
                            "not torchrun")
        plan = RunPlan.resolve(cfg, simulated or launch_world_size())
        check_initial_weights_fit(cfg.checkpoint, checkpoint_folder(cfg), plan.model_args)
        self.dist = process_group.init_distributed(plan.device_type, simulate_world_size=simulated)
        self.device, self.is_main = self.dist.device, self.dist.is_main
        # Before the data is read and any weight allocated: a plan whose memory cannot fit is
        # refused with the numbers (trainer/distributed/memory_plan.py).
        check_fits(plan.memory, self.device)
        seed_everything(cfg.training.seed, cfg.training.deterministic)
        self.mesh = process_group.build_mesh(plan.device_type, plan.facts.layout)
        self.dp_rank = self.mesh.data_parallel.get_local_rank()
        return plan

    def _build_data(self) -> None:
        cfg, plan = self.cfg, self.plan
        # One gloo group for the training and held-out loaders and the stop request: they use it in
        # turn, on this thread, in the same order on every rank, and never wait for the device there.
        # A mirror world has no other processes: this one reads every row itself, with every rank's workers.
        self.host_exchange = LocalExchange() if cfg.parallelism.simulate_world_size else world_exchange()
        loader = functools.partial(run_loader, cfg, tokenizer=plan.tokenizer, dp_rank=self.dp_rank, dp=plan.facts.dp,
                                   exchange=self.host_exchange, verbose=self.is_main)
        self.dataloader = loader("data", training_data_workers(cfg))
        self.validator = None
        if cfg.validation.enable:
            # No workers: the loader restarts for every evaluation and reads only `steps` batches.
            self.validator = Validator(
                cfg.validation, loader("validation", 0), cfg.training.steps, device=self.device,
                dp_group=self.mesh.data_parallel.get_group(), loss=self.loss,
                accuracy=cfg.data.kind == "sft",
            )

    def config_in_force(self) -> Config:
        """The config as the run uses it: the resolved parameter dtype, and after a resume the
        checkpoint's optimizer settings. `cfg` itself is never written."""
        cfg = self.cfg
        training = dataclasses.replace(cfg.training, mixed_precision_param=self.plan.params.dtype)
        optimizer = dataclasses.replace(cfg.optimizer, **self.checkpointer.optimizer_in_force)
        return dataclasses.replace(cfg, training=training, optimizer=optimizer)

    def _startup_summary(self) -> None:
        plan, args = self.plan, self.plan.model_args
        peak = f"{self.peak_flops / 1e12:.0f} TFLOP/s bf16 dense peak" if self.peak_flops else "no known peak (MFU off)"
        lines = startup_summary(
            plan.facts, self.cfg, args.n_layers, args.attention, f"{self.device_name} ({peak})",
            plan.precision.summary, plan.memory.summary(), plan.compile_text, plan.fsdp_text(),
        )
        lines += data_summary(self.cfg, self.dataloader, self.validator.loader if self.validator else None)
        for line in lines + plan.float8.summary_lines():
            info(line)
        if n := self.cfg.parallelism.simulate_world_size:
            warn(f"parallelism.simulate_world_size = {n}: this process is rank 0 of {n} mirrored ranks, whose collectives "
                 "move no data; its step is one GPU's share of the work, links aside, and its losses are not a real run's; it "
                 f"reads every rank's rows itself, with {training_data_workers(self.cfg)} data workers")

    # -- the loop ------------------------------------------------------------

    def _save_last_step(self, why_not: str | None = None) -> str:
        """Save the last completed step of a run about to stop, unless `why_not`; what its line says of it."""
        if not self.cfg.checkpoint.enable:
            return "no checkpoint (checkpointing disabled)"
        if why_not:
            return f"no checkpoint saved ({why_not})"
        self.checkpointer.maybe_save(self.progress.data_state, force=True)
        return f"checkpoint of step {self.state.step} saved"

    def _stop_on_data_error(self, error: UserError) -> None:
        """Save the last completed step, then stop naming the step whose batches hit the bad row (every rank
        learns of each row in the same exchange round, trainer/data/loader.py, so all ranks save together)."""
        step = self.state.step
        saved = self._save_last_step(None if step >= self.progress.first_step else "no step completed in this run")
        raise UserError(f"step {step + 1}: {error}; {saved} (data.bad_rows = \"skip\" skips such rows)")

    def _open_records(self, resumed: bool) -> MetricsLogger:
        """The run's first writes, once every input (data, tokenizer, checkpoint) has been accepted:
        a fresh run moves an earlier run's records aside instead of overwriting them, and config.toml
        (written once, after the load) records the config in force."""
        dump = Path(self.cfg.job.dump_folder)
        config_text = to_toml(self.config_in_force())
        if self.is_main:
            if resumed:
                info(f"resumed from checkpoint at step {self.state.step} ({self.checkpointer.last_loaded})")
            keep_records(dump, resumed, bool(self.checkpointer.rolled_back_from))
            (dump / "config.toml").write_text(config_text)
            self.dump_watch = FolderWatch(dump)
        metrics = self.cfg.metrics
        return MetricsLogger(str(dump), self.plan.facts.run_name, metrics.enable_tensorboard, self.is_main,
                             config_text=config_text, resume_step=self.state.step if resumed else None,
                             wandb_project=metrics.wandb_project if metrics.enable_wandb else None)

    def train(self) -> None:
        cfg = self.cfg
        if self.is_main:
            self._startup_summary()
            for message in self.advice:
                warn(message)
        logger = self._open_records(self.checkpointer.load_latest())
        profiler = StepProfiler(cfg.profiling, Path(cfg.job.dump_folder), self.dist.rank, self.device)
        self.stop_request.install()
        self.model.train()
        try:
            self._loop(logger, profiler)
            self.checkpointer.maybe_export_final()
        finally:
            self.checkpointer.close()
            logger.close()

    def _loop(self, logger: MetricsLogger, profiler: StepProfiler) -> None:
        """Steps until training.steps or a stop request: train step, count, record, save."""
        progress, steps = self.progress, self.cfg.training.steps
        progress.begin(time.perf_counter())
        reader = BatchReader(self.dataloader, self.cfg.training.gradient_accumulation_steps, self.cfg.data.path)
        runner = StepRunner(self.parts, reader, self.plan.float8, profiler, steps, self.is_main)
        first = reader.read()
        if first.error is not None:
            raise UserError(f"step {progress.first_step}: {first.error}")
        micro_batches, progress.data_state = first.micro_batches, first.data_state
        while self.state.step < steps:
            result = runner.run(self.state.step + 1, micro_batches)
            progress.count(result.step, result.applied, self.plan.facts.tokens_per_step)
            if not result.applied:
                skip_or_stop(result, progress.skipped_in_a_row, self.cfg.training.skip_nonfinite_steps, self.is_main)
            self._record(result, logger)
            if result.data_error is not None:
                self._stop_on_data_error(result.data_error)
            if self._save_or_stop():
                break
            if self.state.step < steps:
                micro_batches, progress.data_state = result.upcoming.micro_batches, result.upcoming.data_state

    def _record(self, result: StepResult, logger: MetricsLogger) -> None:
        """Evaluate when due, and log the step's metrics on the logged steps."""
        step, steps, progress = result.step, self.cfg.training.steps, self.progress
        if not result.applied:
            return
        validation = self.validator.evaluate(self.model, step) if self.validator and self.validator.due(step) else {}
        if not (step == 1 or step % self.cfg.metrics.log_freq == 0 or step == steps or validation
                or result.float8_health):
            return
        tps = self.plan.facts.tokens_per_gpu / result.seconds
        tflops = tps * self.plan.facts.flops_per_token / 1e12
        record = {
            "step": step, "loss": result.loss, "grad_norm": result.grad_norm,
            "lr": self.lr_scheduler.get_last_lr()[0], "tps": tps, "tflops": tflops,
            "mfu_pct": 100 * tflops * 1e12 / self.peak_flops if self.peak_flops else None,
            "step_time_s": result.seconds, "data_time_s": result.data_seconds,
            "fwd_bwd_time_s": result.phases.forward_backward_s(),
            **memory_stats(self.device), "tokens_seen": self.state.tokens_seen, "skipped_steps": progress.skipped_total,
            **self.dataloader.dataset.metrics(progress.data_state["dataset_state"]),
            **validation, **result.float8_health,
        }
        eta = (time.perf_counter() - progress.start_time) / (step - progress.first_step + 1) * (steps - step)
        logger.log(record, steps, eta)

    def _save_or_stop(self) -> bool:
        """Save when due (or asked to stop, or at the last step); True when the run stops on request."""
        stop, dump_gone = self.stop_request.agreed(self.is_main and self.dump_watch.gone())
        if dump_gone:  # saved where the checkpoint folder lay outside it (inside, the checkpoints went with it)
            dump, folder = Path(self.cfg.job.dump_folder), self.checkpointer.folder
            raise deleted(dump, self.state.step, self._save_last_step(
                f"checkpoint.folder {folder} was inside it" if inside(folder, dump) else None))
        # An exception that ended a background thread (TensorBoard's writer on a full disk) ends the run.
        raise_thread_failure()
        step = self.state.step
        self.checkpointer.maybe_save(self.progress.data_state, force=stop or step == self.cfg.training.steps)
        if stop and self.is_main:
            saved = "checkpoint saved" if self.cfg.checkpoint.enable else "no checkpoint (checkpointing disabled)"
            info(f"stopped at step {step} on request; {saved}")
        return stop

