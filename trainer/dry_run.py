"""`--job.dry_run true`: the plan of a run, built on the meta device without allocating weights."""

from __future__ import annotations

import torch

from models.llama import num_params
from trainer.config import Config, check_layout
from trainer.config import notes as config_notes
from trainer.distributed.memory_plan import check_plan
from trainer.distributed.single_rank_fast_path import choose_fast_path
from trainer.float8_seam.seam import Float8RunContext, build_seam, float8_memory
from trainer.launch import launch_world_size, launched_by_torchrun, pick_device_type
from trainer.log import info
from trainer.metrics.logger import flops_per_token
from trainer.model_setup import build_meta_model, model_args_for
from trainer.precision import resolve_param_precision
from trainer.run_facts import RunFacts


def _planned_world_size(cfg: Config) -> int:
    """job.dry_run_world_size when given, else torchrun's world, or, planned without it, the layout the config names."""
    if cfg.job.dry_run_world_size:
        return cfg.job.dry_run_world_size
    if launched_by_torchrun():
        return launch_world_size()
    dp, tp = cfg.parallelism.data_parallel_shard_degree, cfg.parallelism.tensor_parallel_degree
    return dp * tp if dp > 0 else tp


def print_plan(cfg: Config) -> None:
    """Print parameters, FLOPs, tokens per step, layout, float8 layers, compile and AC; no weights."""
    device = torch.device(pick_device_type(cfg.training.device))
    t = cfg.training
    params = resolve_param_precision(t.mixed_precision_param, device.type)
    args = model_args_for(cfg, None, device.type)
    world = _planned_world_size(cfg)
    dp, tp = check_layout(cfg, world, args.n_heads, args.n_kv_heads)
    model = build_meta_model(args)
    float8 = build_seam(cfg.float8, Float8RunContext.for_run(cfg, device.type, params.dtype))
    # The dry run never times linears (filter = "auto"): it lists the ones the run would time.
    report = float8.convert(model, time_linears=False)
    without_embedding = num_params(model, exclude_embedding=True)
    facts = RunFacts.for_run(
        cfg, world, dp, tp, params.dtype, float8.run_name_precision(params.dtype), num_params(model),
        flops_per_token(without_embedding, args.n_layers, args.dim, t.seq_len),
    )
    fpt = facts.flops_per_token
    precision = float8.plan_precision(params.dtype)
    layout = f"world {world} = dp {dp} (FSDP2) x tp {tp}"
    if cfg.parallelism.data_parallel_shard_degree == -1 and not launched_by_torchrun() and not cfg.job.dry_run_world_size:
        layout += " (dp = -1 takes the rest of the world at launch)"
    if fast_path := choose_fast_path(cfg.parallelism.single_rank_fast_path, dp).text:
        layout += f"; {fast_path}"
    lines = [
        f"dry run: llama2 {cfg.model.flavor}",
        f"  parameters        {facts.n_params:,} ({without_embedding:,} without the embedding)",
        f"  shape             dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads, "
        f"{args.n_kv_heads} KV heads, FFN {args.hidden_dim}, vocab {args.vocab_size}",
        f"  FLOPs per token   {fpt:,} ({fpt / 1e9:.2f} GFLOP; 6N + 12·L·d·S at seq {t.seq_len})",
        f"  tokens per step   {facts.tokens_per_step_text()}",
        f"  layout            {layout}",
        f"  precision         {precision}; params {params.dtype} ({params.reason}), reduce {t.mixed_precision_reduce}",
        f"  compile           {cfg.compile.mode}",
        f"  packed attention  {args.attention}",
        f"  activation ckpt   {cfg.activation_checkpoint.mode}"
        + (f" ({cfg.activation_checkpoint.selective_option})" if cfg.activation_checkpoint.mode == "selective" else ""),
    ]
    v = cfg.validation
    if v.enable:
        lines.append(f"  validation        {v.path}: {v.steps} batches every {v.freq} steps and at step {t.steps}")
    if report is not None:
        lines.append("  float8 linears    " + str(report).replace("\n", "\n                    "))
    if float8.filter_note:
        lines.append(f"  float8 filter     {float8.filter_note}")
    notes = [*config_notes(cfg), *float8.advice(device, dp, tp)]
    # On a host without a GPU, a plan left on training.device = 'auto' is likely meant for a GPU
    # machine: one that cannot fit this host is a warning; a plan for this device is refused.
    planned_elsewhere = device.type == "cpu" and t.device == "auto"
    vocab_sharded_logits = tp > 1 and cfg.parallelism.loss_parallel
    memory, too_big = check_plan(
        cfg, args, device, dp, tp, params.dtype, vocab_sharded_logits, float8_memory(cfg.float8), refuse=not planned_elsewhere
    )
    lines.append(f"  memory estimate   {memory.summary()}")
    if too_big:
        notes.append(too_big.replace("the plan needs", "on this host (no GPU) the plan needs", 1))
    for note in [params.warning, *notes] if params.warning else notes:
        lines.append(f"  warning: {note}")
    info("\n".join(lines))
