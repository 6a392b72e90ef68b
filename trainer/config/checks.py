"""Checks of a resolved config: choices, counts and combinations (`validate`), and the parallel layout."""

from __future__ import annotations

import dataclasses
import difflib

from trainer.config.schema import SECTIONS, Config
from trainer.errors import UserError
from trainer.float8_seam.options import unsupported_option


def did_you_mean(name: str, options: list[str]) -> str:
    """` (did you mean 'x'?)` for the option closest to `name`, or "" when none is close."""
    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_choices(cfg: Config) -> None:
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            choices = f.metadata["choices"]
            value = getattr(getattr(cfg, section), f.name)
            if choices and value not in choices:
                raise UserError(
                    f"{section}.{f.name} = '{value}' is not one of {', '.join(choices)}"
                    f"{did_you_mean(str(value), list(choices))}"
                )


def validate(cfg: Config) -> None:
    """Checks that need no process group: choices, counts, combinations."""
    _check_choices(cfg)
    positive = [
        ("training", "batch_size"), ("training", "seq_len"), ("training", "steps"),
        ("training", "gradient_accumulation_steps"), ("metrics", "log_freq"),
        ("checkpoint", "interval"), ("parallelism", "tensor_parallel_degree"),
        ("validation", "freq"), ("validation", "steps"),
    ]
    for section, key in positive:
        value = getattr(getattr(cfg, section), key)
        if value <= 0:
            raise UserError(f"{section}.{key} must be positive, got {value}")
    non_negative = [
        ("training", "max_norm"), ("optimizer", "weight_decay"), ("lr_scheduler", "warmup_steps"),
        ("checkpoint", "keep_latest_k"), ("metrics", "float8_stats_freq"), ("model", "n_layers"), ("model", "max_seq_len"), ("float8", "min_features"),
        ("optimizer", "eps"), ("training", "skip_nonfinite_steps"), ("data", "num_workers"),
    ]
    for section, key in non_negative:
        value = getattr(getattr(cfg, section), key)
        if value < 0:
            raise UserError(f"{section}.{key} must be >= 0, got {value}")
    # An empty value is most often an unset shell variable; none of these has a meaning when empty.
    for section, key in (("job", "dump_folder"), ("model", "tokenizer_path"), ("data", "path"), ("checkpoint", "folder")):
        if not getattr(getattr(cfg, section), key).strip():
            raise UserError(f"{section}.{key} is empty (an unset shell variable?); give it a value")
    if cfg.validation.enable and not cfg.validation.path:
        raise UserError("validation.enable = true needs validation.path (held-out data in data.path's formats)")
    if cfg.optimizer.lr <= 0:
        raise UserError(f"optimizer.lr must be positive, got {cfg.optimizer.lr}")
    if len(cfg.optimizer.betas) != 2 or not all(0 <= b < 1 for b in cfg.optimizer.betas):
        raise UserError(f"optimizer.betas must be two numbers in [0, 1), got {cfg.optimizer.betas}")
    if not 0 <= cfg.lr_scheduler.min_lr_ratio <= 1:
        raise UserError(f"lr_scheduler.min_lr_ratio must be in [0, 1], got {cfg.lr_scheduler.min_lr_ratio}")
    if cfg.compile.mode == "model" and cfg.parallelism.tensor_parallel_degree > 1:
        # torch cannot compile the vocab-parallel embedding (its mask lives in DTensor
        # placement metadata): "Mixing fake modes NYI", pytorch/torchtitan#534.
        raise UserError(
            "compile.mode = 'model' does not work with tensor_parallel_degree > 1 "
            "(torch cannot compile the vocab-parallel embedding); use compile.mode = 'block'"
        )
    dp = cfg.parallelism.data_parallel_shard_degree
    if dp == 0 or dp < -1:
        raise UserError(f"parallelism.data_parallel_shard_degree must be -1 or positive, got {dp}")
    sel = cfg.activation_checkpoint.selective_option
    if cfg.activation_checkpoint.mode == "selective" and sel != "op" and not (sel.isdigit() and int(sel) > 0):
        raise UserError(f"activation_checkpoint.selective_option must be 'op' or a positive integer, got '{sel}'")
    if any(s <= 0 for s in cfg.profiling.steps):
        raise UserError(f"profiling.steps must be positive step numbers, got {cfg.profiling.steps}")
    if problem := unsupported_option(cfg.float8, cfg.metrics.float8_stats_freq):
        raise UserError(problem)


def check_layout(cfg: Config, world_size: int, n_heads: int, n_kv_heads: int) -> tuple[int, int]:
    """Resolve (dp, tp) for this world size, or raise a one-line UserError."""
    tp = cfg.parallelism.tensor_parallel_degree
    dp = cfg.parallelism.data_parallel_shard_degree
    if world_size % tp:
        raise UserError(f"parallelism.tensor_parallel_degree = {tp} does not divide the world size {world_size}")
    if dp == -1:
        dp = world_size // tp
    if dp * tp != world_size:
        raise UserError(
            f"parallelism.data_parallel_shard_degree ({dp}) x tensor_parallel_degree ({tp}) = {dp * tp} "
            f"does not match the world size {world_size}"
        )
    if n_heads % tp or n_kv_heads % tp:
        raise UserError(
            f"parallelism.tensor_parallel_degree = {tp} must divide the number of heads ({n_heads}) "
            f"and KV heads ({n_kv_heads}) of the model"
        )
    if tp > 1 and cfg.training.seq_len % tp:
        raise UserError(f"training.seq_len = {cfg.training.seq_len} must be divisible by tensor_parallel_degree = {tp} (sequence parallel)")
    return dp, tp
