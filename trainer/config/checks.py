"""Checks of a resolved config: choices, counts and combinations (`validate`), and the parallel layout."""

from __future__ import annotations

import dataclasses
import difflib
from typing import NamedTuple

from trainer.config.schema import SECTIONS, Config, DataFormat, choices_of
from trainer.config.sources import SourceConfig
from trainer.errors import UserError
from trainer.float8_seam.options import health_cost_note, unsupported_option


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
    _check_signs(cfg)
    # An empty value is most often an unset shell variable; none of these has a meaning when empty.
    for section, key in (("job", "dump_folder"), ("model", "tokenizer_path"), ("data", "path"), ("checkpoint", "folder")):
        if not getattr(getattr(cfg, section), key).strip():
            raise UserError(f"{section}.{key} is empty (an unset shell variable?); give it a value")
    if cfg.validation.enable and not (cfg.validation.path or cfg.validation.sources):
        raise UserError("validation.enable = true needs validation.path or [[validation.sources]] "
                        "(held-out data in data.path's formats)")
    for section in ("data", "validation"):
        _check_sources(section, getattr(cfg, section).sources)
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
    if cfg.parallelism.simulate_world_size and cfg.checkpoint.enable:
        raise UserError("parallelism.simulate_world_size measures a step and saves nothing (its weights are not a real "
                        "run's): set checkpoint.enable = false")
    dp = cfg.parallelism.data_parallel_shard_degree
    if dp == 0 or dp < -1:
        raise UserError(f"parallelism.data_parallel_shard_degree must be -1 or positive, got {dp}")
    sel = cfg.activation_checkpoint.selective_option
    if cfg.activation_checkpoint.mode == "selective" and sel != "op" and not (sel.isdigit() and int(sel) > 0):
        raise UserError(f"activation_checkpoint.selective_option must be 'op' or a positive integer, got '{sel}'")
    if any(s <= 0 for s in cfg.profiling.steps):
        raise UserError(f"profiling.steps must be positive step numbers, got {cfg.profiling.steps}")
    past = [s for s in cfg.profiling.steps if s > cfg.training.steps]
    if cfg.profiling.enable and past:
        raise UserError(f"profiling.steps {past} lie past training.steps = {cfg.training.steps}: they would never "
                        "be traced; pick steps of the run")
    if cfg.compile.mode != "none":  # uncompiled, the backend is never read (notes() says so)
        _check_compile_backend(cfg.compile.backend)
    if problem := unsupported_option(cfg.float8, cfg.metrics.float8_stats_freq):
        raise UserError(problem)


def _check_signs(cfg: Config) -> None:
    positive = [
        ("training", "batch_size"), ("training", "seq_len"), ("training", "steps"),
        ("training", "gradient_accumulation_steps"), ("metrics", "log_freq"),
        ("checkpoint", "interval"), ("parallelism", "tensor_parallel_degree"),
        ("parallelism", "data_parallel_replicate_degree"),
        ("validation", "freq"),
    ]
    for section, key in positive:
        value = getattr(getattr(cfg, section), key)
        if value <= 0:
            raise UserError(f"{section}.{key} must be positive, got {value}")
    non_negative = [
        ("training", "max_norm"), ("optimizer", "weight_decay"), ("lr_scheduler", "warmup_steps"),
        ("checkpoint", "keep_latest_k"), ("metrics", "float8_stats_freq"), ("validation", "steps"), ("model", "n_layers"), ("model", "max_seq_len"), ("float8", "min_features"),
        ("optimizer", "eps"), ("training", "skip_nonfinite_steps"), ("data", "num_workers"),
        ("job", "dry_run_world_size"), ("job", "dry_run_nproc_per_node"), ("parallelism", "simulate_world_size"),
    ]
    for section, key in non_negative:
        value = getattr(getattr(cfg, section), key)
        if value < 0:
            raise UserError(f"{section}.{key} must be >= 0, got {value}")


def _check_compile_backend(backend: str) -> None:
    """A torch.compile backend that exists, checked before any work (the default needs no look-up:
    listing the backends imports torch._dynamo, seconds)."""
    if backend == "inductor":
        return
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    if backend not in known:
        raise UserError(f"compile.backend = '{backend}' is not a torch.compile backend{did_you_mean(backend, known)}"
                        f" (this torch has: {', '.join(sorted(known))})")


def notes(cfg: Config) -> list[str]:
    """Warnings about a config that runs, but not as its author probably meant."""
    found = []
    if cfg.lr_scheduler.warmup_steps >= cfg.training.steps:
        found.append(f"lr_scheduler.warmup_steps = {cfg.lr_scheduler.warmup_steps} is not below training.steps = "
                     f"{cfg.training.steps}: the run ends before the learning rate reaches optimizer.lr")
    if cfg.compile.mode == "none" and cfg.compile.backend != "inductor":
        found.append(f"compile.backend = '{cfg.compile.backend}' has no effect with compile.mode = 'none'")
    if note := health_cost_note(cfg.float8, cfg.metrics.float8_stats_freq, cfg.compile.mode):
        found.append(note)
    return found


def _check_sources(section: str, sources: list[SourceConfig]) -> None:
    """A mixture's sources: a path each, positive weights, known formats, distinct names usable in metric keys."""
    seen: dict[str, int] = {}
    for i, src in enumerate(sources):
        where, name = src.option(section, i), src.label(i)
        if not src.path.strip():
            raise UserError(f"{where}: path is empty; give a file, folder, glob or hub dataset")
        if not src.weight > 0:
            raise UserError(f"{where}: weight must be positive, got {src.weight}")
        if src.format and src.format not in choices_of(DataFormat):
            raise UserError(f"{where}: format '{src.format}' is not one of {', '.join(choices_of(DataFormat))}")
        if not all(c.isalnum() or c in "_-." for c in name):
            raise UserError(f"{where}: name '{name}' may hold only letters, digits, '_', '-' and '.' (it is a metric key)")
        if name in seen:
            raise UserError(f"{where}: name '{name}' clashes with {section}.sources[{seen[name]}]; "
                            "give each source a distinct name")
        seen[name] = i


class Layout(NamedTuple):
    """The parallel layout: `replicate` copies (HSDP) of a model FSDP-sharded over `shard` ranks, each rank
    of which is a TP group of `tp`. The data-parallel ranks are replicate x shard: each reads its own batch."""

    replicate: int
    shard: int
    tp: int

    @property
    def dp(self) -> int:
        return self.replicate * self.shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp


def check_layout(cfg: Config, world_size: int, n_heads: int, n_kv_heads: int) -> Layout:
    """Resolve the layout for this world size, or raise a one-line UserError."""
    tp = cfg.parallelism.tensor_parallel_degree
    replicate = cfg.parallelism.data_parallel_replicate_degree
    shard = cfg.parallelism.data_parallel_shard_degree
    if world_size % tp:
        raise UserError(f"parallelism.tensor_parallel_degree = {tp} does not divide the world size {world_size}")
    if world_size % (replicate * tp):
        raise UserError(f"parallelism.data_parallel_replicate_degree ({replicate}) x tensor_parallel_degree ({tp}) = "
                        f"{replicate * tp} does not divide the world size {world_size}")
    if shard == -1:
        shard = world_size // (replicate * tp)
    if replicate * shard * tp != world_size:
        if replicate == 1:
            raise UserError(
                f"parallelism.data_parallel_shard_degree ({shard}) x tensor_parallel_degree ({tp}) = {shard * tp} "
                f"does not match the world size {world_size}"
            )
        raise UserError(
            f"parallelism.data_parallel_replicate_degree ({replicate}) x data_parallel_shard_degree ({shard}) x "
            f"tensor_parallel_degree ({tp}) = {replicate * shard * tp} does not match the world size {world_size}"
        )
    if n_heads % tp or n_kv_heads % tp:
        raise UserError(
            f"parallelism.tensor_parallel_degree = {tp} must divide the number of heads ({n_heads}) "
            f"and KV heads ({n_kv_heads}) of the model"
        )
    if tp > 1 and cfg.training.seq_len % tp:
        raise UserError(f"training.seq_len = {cfg.training.seq_len} must be divisible by tensor_parallel_degree = {tp} (sequence parallel)")
    return Layout(replicate, shard, tp)
