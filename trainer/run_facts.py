"""What a run is, derived once from its config and layout by the run's plan (trainer/plan.py): the
numbers the trainer, its startup summary and the dry run (trainer/dry_run.py) all print or use."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import Config, Layout


@dataclass(frozen=True)
class RunFacts:
    layout: Layout
    batch_size: int
    seq_len: int
    grad_accum: int
    # Sequences per optimizer step over all DP ranks (a TP group shares one DP rank's batch).
    global_batch: int
    tokens_per_step: int
    # Tokens per step each GPU works on: its DP rank's tokens, split over the TP group.
    tokens_per_gpu: float
    param_dtype: str
    # bf16, fp32 or the float8 recipe (with a float8.impl other than ours: tensorwise-torchao):
    # the precision part of the default run name, as the float8 seam says.
    precision: str
    run_name: str
    n_params: int
    flops_per_token: int

    @staticmethod
    def for_run(
        cfg: Config, layout: Layout, param_dtype: str, precision: str, n_params: int, flops_per_token: int,
    ) -> RunFacts:
        """`param_dtype` is training.mixed_precision_param resolved for the device (never 'auto'),
        `precision` the float8 seam's `run_name_precision`."""
        t = cfg.training
        tokens_per_rank = t.batch_size * t.seq_len * t.gradient_accumulation_steps
        dp, tp = layout.dp, layout.tp
        return RunFacts(
            layout=layout, batch_size=t.batch_size, seq_len=t.seq_len,
            grad_accum=t.gradient_accumulation_steps, global_batch=t.batch_size * t.gradient_accumulation_steps * dp,
            tokens_per_step=tokens_per_rank * dp, tokens_per_gpu=tokens_per_rank / tp, param_dtype=param_dtype,
            precision=precision,
            run_name=cfg.job.run_name or f"{cfg.model.flavor}-{precision}-{cfg.compile.mode}",
            n_params=n_params, flops_per_token=flops_per_token,
        )

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dp(self) -> int:
        """Data-parallel ranks (replicas x shards): each reads its own batch."""
        return self.layout.dp

    @property
    def tp(self) -> int:
        return self.layout.tp

    def mesh_text(self) -> str:
        """The mesh as the startup summary says it: `dp=4 tp=2`, and under HSDP its two data-parallel dims."""
        replicas = f" (replicate {self.layout.replicate} x shard {self.layout.shard}, HSDP)" if self.layout.replicate > 1 else ""
        return f"dp={self.dp}{replicas} tp={self.tp}"

    def tokens_per_step_text(self) -> str:
        return (f"{self.tokens_per_step:,} (batch {self.batch_size} x seq {self.seq_len} x accum {self.grad_accum} "
                f"x dp {self.dp})")


def startup_summary(
    facts: RunFacts, cfg: Config, n_layers: int, attention: str, device: str, precision: str, memory: str,
    compile_text: str, fsdp: str | None = None,
) -> list[str]:
    """The lines the trainer prints before the first step; `device`, `precision` and `memory` are
    the device with its peak, the float8 seam's precision text and the memory estimate; `compile_text` the
    compile mode with the loss's part (trainer/loss.py's choose_loss_compile); `fsdp` says
    whether FSDP2 takes the one-rank fast path and how it packs gradients, where there is something to say."""
    run = f"run {facts.run_name}: {cfg.job.description}" if cfg.job.description else f"run {facts.run_name}"
    return [
        run,
        f"model llama2 {cfg.model.flavor}: {facts.n_params:,} params, {n_layers} layers, "
        f"{facts.flops_per_token / 1e9:.2f} GFLOP/token",
        f"device {device} x {facts.world_size}; mesh {facts.mesh_text()}" + (f"; {fsdp}" if fsdp else ""),
        f"precision {precision}; compile {compile_text}; activation checkpoint {cfg.activation_checkpoint.mode}; "
        f"packed attention {attention}",
        f"tokens per step {facts.tokens_per_step_text()}",
        f"memory estimate {memory}",
    ]
