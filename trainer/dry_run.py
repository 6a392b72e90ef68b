"""`--job.dry_run true`: the run's plan (trainer/plan.py, the object the Trainer builds from), printed
with the float8 conversion of the model on the meta device; no weight is allocated, no data read."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from trainer.config import Config
from trainer.distributed.comm_plan import GB, Collective, StepShape, comm_plan
from trainer.distributed.memory_plan import check_fits
from trainer.launch import launch_world_size, launched_by_torchrun, local_world_size
from trainer.log import info
from trainer.model_setup import build_meta_model
from trainer.plan import RunPlan
from trainer.precision import TORCH_DTYPES

# A GPU host's usual count, for a plan made without torchrun and without job.dry_run_nproc_per_node.
DEFAULT_NPROC_PER_NODE = 8


def _given_world_size(cfg: Config) -> int:
    """The world the config names outright: job.dry_run_world_size, else the simulated world; 0 for neither."""
    return cfg.job.dry_run_world_size or cfg.parallelism.simulate_world_size


def _planned_world_size(cfg: Config) -> int:
    """The given world size, else torchrun's, or, planned without either, the layout the config names."""
    if given := _given_world_size(cfg):
        return given
    if launched_by_torchrun():
        return launch_world_size()
    p = cfg.parallelism
    replicas_tp = p.data_parallel_replicate_degree * p.tensor_parallel_degree
    return p.data_parallel_shard_degree * replicas_tp if p.data_parallel_shard_degree > 0 else replicas_tp


def print_plan(cfg: Config) -> None:
    """Print parameters, FLOPs, tokens per step, layout, float8 layers, compile and AC; no weights."""
    plan = RunPlan.resolve(cfg, _planned_world_size(cfg), load_tokenizer=False)
    device = torch.device(plan.device_type)
    # The dry run never times linears (filter = "auto"): it lists the ones the run would time.
    model = build_meta_model(plan.model_args)
    plan.float8.convert(model, time_linears=False)
    warnings = plan.warnings(device)
    # On a host without a GPU, a plan left on training.device = 'auto' is likely meant for a GPU
    # machine: one that cannot fit this host is a warning; a plan for this device is refused.
    planned_elsewhere = device.type == "cpu" and cfg.training.device == "auto"
    if too_big := check_fits(plan.memory, device, refuse=not planned_elsewhere):
        warnings.append(too_big.replace("the plan needs", "on this host (no GPU) the plan needs", 1))
    info("\n".join(plan_lines(cfg, plan, warnings, comm_lines(cfg, plan, model))))


def plan_lines(cfg: Config, plan: RunPlan, warnings: list[str], comm: Sequence[str] = ()) -> list[str]:
    """The dry run's text: `plan` (its float8 seam's report once it has converted a model), the communication
    plan's lines `comm` and `warnings`."""
    facts, args, t = plan.facts, plan.model_args, cfg.training
    fpt = facts.flops_per_token
    replicate, shard, tp = facts.layout
    data_parallel = f"dp {facts.dp} (HSDP: replicate {replicate} x shard {shard})" if replicate > 1 else f"dp {facts.dp} (FSDP2)"
    layout = f"world {facts.world_size} = {data_parallel} x tp {tp}"
    if cfg.parallelism.data_parallel_shard_degree == -1 and not launched_by_torchrun() and not _given_world_size(cfg):
        layout += " (dp = -1 takes the rest of the world at launch)"
    if fsdp := plan.fsdp_text():
        layout += f"; {fsdp}"
    ac = cfg.activation_checkpoint
    lines = [
        f"dry run: llama2 {cfg.model.flavor}",
        f"  parameters        {facts.n_params:,} ({plan.params_without_embedding:,} without the embedding)",
        f"  shape             dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads, "
        f"{args.n_kv_heads} KV heads, FFN {args.hidden_dim}, vocab {args.vocab_size}",
        f"  FLOPs per token   {fpt:,} ({fpt / 1e9:.2f} GFLOP; 6N + 12·L·d·S at seq {t.seq_len})",
        f"  tokens per step   {facts.tokens_per_step_text()}",
        f"  layout            {layout}",
        f"  precision         {plan.precision.plan}",
        f"  compile           {plan.compile_text}",
        f"  packed attention  {args.attention}",
        f"  activation ckpt   {ac.mode}" + (f" ({ac.selective_option})" if ac.mode == "selective" else ""),
    ]
    v = cfg.validation
    if v.enable:
        lines.append(f"  validation        {v.path}: {v.steps} batches every {v.freq} steps and at step {t.steps}")
    if plan.float8.report is not None:
        lines.append("  float8 linears    " + str(plan.float8.report).replace("\n", "\n                    "))
    if plan.float8.filter_note:
        lines.append(f"  float8 filter     {plan.float8.filter_note}")
    lines.append(f"  memory estimate   {plan.memory.summary()}")
    return [*lines, *comm, *(f"  warning: {note}" for note in warnings)]


def comm_rows(cfg: Config, plan: RunPlan, model: nn.Module) -> tuple[list[Collective], int]:
    """The communication plan of `model` (on meta, float8-converted) in the plan's layout, and the GPUs per node
    it assumes."""
    t, ac = cfg.training, cfg.activation_checkpoint
    shape = StepShape(
        tokens=t.batch_size * t.seq_len, grad_accum=t.gradient_accumulation_steps,
        param_bytes=TORCH_DTYPES[plan.params.dtype].itemsize, reduce_bytes=TORCH_DTYPES[t.mixed_precision_reduce].itemsize,
        reshard_after_forward=cfg.parallelism.reshard_after_forward, tp_float8=plan.float8.tp_styles().float8_gathers,
        loss_parallel=plan.vocab_sharded_logits, ac_mode=ac.mode, ac_option=ac.selective_option,
    )
    per_node = cfg.job.dry_run_nproc_per_node or (local_world_size() if launched_by_torchrun() else DEFAULT_NPROC_PER_NODE)
    return comm_plan(model, plan.facts.layout, shape, plan.float8.gathered_in_float8(), per_node), per_node


def comm_lines(cfg: Config, plan: RunPlan, model: nn.Module) -> list[str]:
    """The communication plan as the dry run prints it: a line per collective."""
    rows, per_node = comm_rows(cfg, plan, model)
    lines = [f"  communication     per GPU per step (bus bytes), {per_node} GPUs per node:"]
    lines += [f"    {r.what:<46} {f'{r.dim} x{r.ranks}':<16} {_amount(r.bytes):>9}  "
              f"{'across nodes' if r.crosses_nodes else 'within a node'}" for r in rows]
    across = sum(r.bytes for r in rows if r.crosses_nodes)
    total = f"{_amount(sum(r.bytes for r in rows)):>9}, {_amount(across)} across nodes" if rows else "nothing (one rank)"
    return [*lines, f"    {'total':<46} {'':<16} {total}"]


def _amount(n: float) -> str:
    """`n` bytes in GB, MB, kB or B (decimal units, as link bandwidths are given)."""
    for unit, size in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
