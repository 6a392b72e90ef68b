"""Config schema, TOML loading, CLI overrides and validation.

Precedence: CLI ``--section.key value`` > TOML file > dataclass defaults. Every
problem with the user's config is raised as a one-line :class:`UserError` that
names the key; ``train.py`` turns it into ``error: ...`` and exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from trainer.errors import UserError

DEFAULT_CONFIG = "configs/debug.toml"


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None, **kw: Any) -> Any:
    meta = {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass
class JobConfig:
    """Where the run writes and what it is."""

    dump_folder: str = _opt("outputs/debug", "Folder for config.toml, metrics.jsonl, tb/, checkpoints/, profiles/.")
    description: str = _opt("", "Free text describing the run; shown at startup and in TensorBoard.")
    dry_run: bool = _opt(False, "Build the model on the meta device, print the plan and exit without allocating weights.")
    run_name: str = _opt("", "TensorBoard run name under <dump_folder>/tb/ (default: <flavor>-<precision>-<compile mode>).")


@dataclass
class ModelConfig:
    """Which model to build."""

    name: str = _opt("llama2", "Model family.", ("llama2",))
    flavor: str = _opt("debug", "Model size.", ("debug", "7B", "13B", "70B"))
    tokenizer_path: str = _opt("data/tokenizer.model", "sentencepiece tokenizer.model (LLaMA-2 format: BOS 1, EOS 2).")
    n_layers: int = _opt(0, "Override the flavour's number of layers (0 = flavour default); e.g. fewer layers to fit one GPU.")
    max_seq_len: int = _opt(
        0,
        "Longest sequence the model is built for (RoPE table size); 0 = the flavour's (debug 2048, 7B 4096). "
        "Set it to at least training.seq_len to train beyond the flavour's length.",
    )
    attention: str = _opt(
        "auto",
        "Attention kernel for packed samples (data.pack): sdpa = SDPA with a dense document mask; flex = "
        "flex_attention with a block-sparse document mask (CUDA only: no flex backward on CPU); auto = flex "
        "when compile.mode is block or model on CUDA, else sdpa. Unpacked batches always use SDPA's causal kernel.",
        ("auto", "sdpa", "flex"),
    )


@dataclass
class Float8TrainingConfig:
    """Float8 training of the linear layers (see docs/float8.md)."""

    # Same names and defaults as float8.Float8Config (tests/test_float8_training.py checks),
    # without importing torch here: a bad config is refused before torch loads.

    enabled: bool = _opt(False, "Convert eligible nn.Linear layers to float8 training linears.")
    scaling: str = _opt("tensorwise", "Scaling recipe.", ("tensorwise", "rowwise", "rowwise_gw_hp"))
    emulate: bool = _opt(False, "Emulate float8 GEMMs in high precision (for hardware without float8 GEMMs; slow).")
    fsdp_float8_all_gather: bool = _opt(False, "All-gather weights in float8 under FSDP (tensorwise only); halves weight traffic.")
    filter_fqns: list[str] = _opt(["output"], "Module names to keep in high precision (substring match).")
    min_features: int = _opt(0, "Skip linears whose in or out features are below this (too small to gain from float8).")


@dataclass
class CompileConfig:
    """torch.compile granularity."""

    mode: str = _opt("none", "none = eager; block = each TransformerBlock (fullgraph); model = the whole model.", ("none", "block", "model"))
    backend: str = _opt("inductor", "torch.compile backend.")


@dataclass
class ParallelismConfig:
    """Device mesh: data-parallel sharding (FSDP2) x tensor parallel."""

    data_parallel_shard_degree: int = _opt(-1, "FSDP degree; -1 = world size / tensor_parallel_degree.")
    tensor_parallel_degree: int = _opt(1, "Tensor (and sequence) parallel degree.")
    reshard_after_forward: bool = _opt(True, "FSDP: free gathered weights after forward (saves memory, regathers in backward).")
    float8_tensor_parallel: bool = _opt(True, "With tensorwise float8, use float8-aware TP styles (all-gathers move float8).")
    loss_parallel: bool = _opt(True, "With TP: keep the logits sharded on the vocab dim and compute the cross-entropy in parallel, so no rank holds full-vocab logits.")


@dataclass
class ActivationCheckpointConfig:
    """Recompute activations in backward to save memory."""

    mode: str = _opt("none", "none | full (every block) | selective.", ("none", "full", "selective"))
    selective_option: str = _opt("op", "selective: 'op' saves matmul/attention outputs and recomputes the rest; an integer N checkpoints every N-th block.")


@dataclass
class TrainingConfig:
    """The optimisation loop."""

    batch_size: int = _opt(8, "Sequences per micro-batch per data-parallel rank.")
    seq_len: int = _opt(256, "Tokens per sequence.")
    steps: int = _opt(100, "Optimizer steps.")
    max_norm: float = _opt(1.0, "Clip gradients to this global L2 norm (0 disables clipping).")
    gradient_accumulation_steps: int = _opt(1, "Micro-batches per optimizer step.")
    mixed_precision_param: str = _opt(
        "auto",
        "Compute dtype of parameters (master weights stay fp32). auto = bfloat16 on CUDA and on CPUs with native "
        "bf16 (AVX512-BF16/AMX), float32 on other CPUs (bf16 is emulated there, about 15x slower).",
        ("auto", "bfloat16", "float32"),
    )
    mixed_precision_reduce: str = _opt("float32", "Gradient reduce dtype.", ("float32", "bfloat16"))
    seed: int = _opt(42, "Seed for weights init and dropout-free randomness.")
    deterministic: bool = _opt(False, "Use deterministic algorithms (slower).")
    device: str = _opt("auto", "auto = CUDA when available, else CPU.", ("auto", "cuda", "cpu"))
    skip_nonfinite_steps: int = _opt(
        0,
        "A step whose loss or grad norm is NaN/inf is never applied; 0 = stop the run there, N = skip up to N "
        "such steps in a row (counted as skipped_steps in the metrics) and stop at the next.",
    )


@dataclass
class DataConfig:
    """Training data."""

    kind: str = _opt("pretrain", "pretrain = packed text; sft = instruction tuning with prompt masking.", ("pretrain", "sft"))
    path: str = _opt("data/corpus", "File, folder or glob of .txt/.jsonl/.parquet (or a hub dataset name when online).")
    format: str = _opt("auto", "Input format (auto = by file extension).", ("auto", "text", "jsonl", "parquet"))
    text_field: str = _opt("text", "Field holding the text in JSON Lines / parquet pretraining data.")
    num_workers: int = _opt(
        1,
        "Pretraining: worker processes per rank that read and tokenize this rank's share of the rows ahead "
        "of use (0 = on the training thread, when a batch is needed).",
    )
    bad_rows: str = _opt(
        "error",
        "A data row that is not UTF-8, not JSON or lacks its field(s): error = stop the run naming file and line "
        "(local data up to 1 GB, and all SFT data, is checked before the first step); skip = skip it, "
        "warn once and count it as data/bad_rows in the metrics.",
        ("error", "skip"),
    )
    sft_format: str = _opt("auto", "SFT row format.", ("auto", "alpaca", "chat"))
    instruction_field: str = _opt("instruction", "Alpaca field with the instruction.")
    input_field: str = _opt("input", "Alpaca field with the optional input.")
    output_field: str = _opt("output", "Alpaca field with the response.")
    messages_field: str = _opt("messages", "Chat field with the list of {role, content} messages.")
    train_on: str = _opt("responses", "Tokens that carry loss in SFT.", ("responses", "all"))
    pack: bool = _opt(False, "SFT: pack several samples per sequence with document-causal attention.")
    truncation: str = _opt("truncate_prompt", "SFT samples longer than seq_len: cut the prompt's start, or drop them (counted in the log).", ("truncate_prompt", "drop"))
    shuffle: bool = _opt(True, "SFT: seeded shuffle each epoch.")
    eval_path: str = _opt("", "Held-out SFT split for scripts/eval_sft.py.")


@dataclass
class ValidationConfig:
    """Held-out loss during training."""

    enable: bool = _opt(False, "Evaluate on held-out data every `freq` steps and at the last step.")
    path: str = _opt("", "Held-out data in data.path's formats (pretraining text or SFT rows, as data.kind says).")
    freq: int = _opt(100, "Evaluate every N steps (and at the last step).")
    steps: int = _opt(10, "Batches per evaluation, each training.batch_size per DP rank: the same batches every time.")


@dataclass
class OptimizerConfig:
    """AdamW."""

    name: str = _opt("AdamW", "Optimizer.", ("AdamW",))
    lr: float = _opt(8e-4, "Peak learning rate.")
    weight_decay: float = _opt(0.1, "Decoupled weight decay (not applied to norms).")
    betas: list[float] = _opt([0.9, 0.95], "Adam betas.")
    eps: float = _opt(1e-8, "Adam epsilon.")
    implementation: str = _opt("auto", "auto = fused on CUDA, foreach elsewhere.", ("auto", "fused", "foreach", "for-loop"))


@dataclass
class LRSchedulerConfig:
    """Warmup then decay."""

    warmup_steps: int = _opt(10, "Linear warmup steps from 0 to the peak lr.")
    decay: str = _opt("cosine", "Decay after warmup down to min_lr_ratio * lr.", ("linear", "cosine", "none"))
    min_lr_ratio: float = _opt(0.1, "Final lr as a fraction of the peak lr.")


@dataclass
class CheckpointConfig:
    """Distributed checkpoints (DCP) and initial weights."""

    enable: bool = _opt(False, "Save checkpoints and resume from the latest complete one.")
    folder: str = _opt("checkpoints", "Checkpoint folder, relative to dump_folder unless absolute.")
    interval: int = _opt(500, "Save every N steps (and at the last step).")
    keep_latest_k: int = _opt(0, "Keep only the newest K checkpoints (0 = keep all).")
    async_mode: str = _opt("disabled", "disabled = save in the training thread; async = save in the background.", ("disabled", "async"))
    load_step: int = _opt(-1, "Resume from this step (-1 = latest complete checkpoint).")
    initial_load_path: str = _opt("", "Weights to start from when no checkpoint exists (see initial_load_format).")
    initial_load_format: str = _opt("dcp", "Format of initial_load_path.", ("dcp", "hf", "meta", "torch"))
    export_dtype: str = _opt("bfloat16", "dtype of the model-only export written at the end (model.safetensors).", ("bfloat16", "float32"))
    export_final: bool = _opt(False, "Write <folder>/final/model.safetensors (model only) after the last step.")
    verify_checksums: bool = _opt(True, "Write a CRC-32 of every checkpoint file (checksums.json) and check them before resuming, so damaged files are refused instead of loaded.")


@dataclass
class MetricsConfig:
    """Console, metrics.jsonl and TensorBoard."""

    log_freq: int = _opt(10, "Log every N steps (and at step 1).")
    enable_tensorboard: bool = _opt(True, "Write TensorBoard events under <dump_folder>/tb/<run-name>/.")


@dataclass
class ProfilingConfig:
    """torch.profiler traces and CUDA memory snapshots."""

    enable: bool = _opt(False, "Record profiler traces for `steps` into <dump_folder>/profiles/step-N/.")
    steps: list[int] = _opt([3], "Steps to trace.")
    memory_snapshot: bool = _opt(False, "Record a CUDA memory snapshot (and one on OOM).")


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    float8: Float8TrainingConfig = field(default_factory=Float8TrainingConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


SECTIONS: dict[str, type] = _section_types()


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        (inner,) = typing.get_args(tp)
        return f"a list of {_type_name(inner)}s"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}[tp]


def _in_range(value: int | float, where: str) -> int | float:
    """Reject numbers no option can use: NaN and infinities, integers beyond 64 bits."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{where} must be a finite number, got {value}")
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        raise UserError(f"{where} = {value} does not fit in 64 bits")
    return value


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check a TOML value (already typed) against the field type."""
    if typing.get_origin(tp) is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise UserError(f"{where} must be {_type_name(tp)}, got {value!r}")
        return [_coerce(v, inner, where) for v in value]
    if tp is bool:
        if not isinstance(value, bool):
            raise UserError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{where} must be an integer, got {value!r}")
        return _in_range(value, where)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where} must be a number, got {value!r}")
        return _in_range(float(value), where)
    if not isinstance(value, str):
        raise UserError(f"{where} must be a string, got {value!r}")
    return value


def _parse_cli_value(text: str, tp: Any, where: str) -> Any:
    """Turn a command-line string into a value of the field's type."""
    if typing.get_origin(tp) is list:
        (inner,) = typing.get_args(tp)
        body = text.strip()
        if body.startswith("[") and body.endswith("]"):
            body = body[1:-1]
        items = [s.strip().strip("'\"") for s in body.split(",") if s.strip()]
        return [_parse_cli_value(s, inner, where) for s in items]
    if tp is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise UserError(f"{where} must be true or false, got '{text}'")
    if tp is int:
        try:
            return _in_range(int(text), where)
        except ValueError:
            raise UserError(f"{where} must be an integer, got '{text}'") from None
    if tp is float:
        try:
            return _in_range(float(text), where)
        except ValueError:
            raise UserError(f"{where} must be a number, got '{text}'") from None
    return text


def _lookup(section: str, key: str, where: str) -> Any:
    if section not in SECTIONS:
        raise UserError(f"unknown config section [{section}]{_suggest(section, list(SECTIONS))} in {where}")
    types_ = _field_types(SECTIONS[section])
    if key not in types_:
        raise UserError(f"unknown config key {section}.{key}{_suggest(key, list(types_))} in {where}")
    return types_[key]


def load_toml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a UTF-8 text file") from None


def parse_cli(argv: list[str]) -> tuple[str | None, list[tuple[str, str, str | None]], bool]:
    """Split argv into (--config path, [(section, key, raw value)], wants help)."""
    config_path = None
    overrides: list[tuple[str, str, str | None]] = []
    wants_help = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            wants_help = True
            i += 1
            continue
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument '{arg}' (options look like --section.key value)")
        name, eq, inline = arg[2:].partition("=")
        value: str | None = inline if eq else None
        if value is None and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 1
        i += 1
        if name == "config":
            if value is None:
                raise UserError("--config needs a path")
            config_path = value
            continue
        if "." not in name:
            raise UserError(f"unknown option --{name} (options look like --section.key value, e.g. --training.steps 10)")
        section, _, key = name.partition(".")
        overrides.append((section, key, value))
    return config_path, overrides, wants_help


def build_config(argv: list[str] | None = None) -> Config:
    """Resolve the config from argv (defaults < TOML < CLI) and validate it."""
    argv = sys.argv[1:] if argv is None else argv
    config_path, overrides, wants_help = parse_cli(argv)
    if wants_help:
        print(help_text())
        raise SystemExit(0)
    config_path = config_path or DEFAULT_CONFIG
    raw = load_toml(config_path)
    cfg = Config()
    for section, table in raw.items():
        if not isinstance(table, dict):
            raise UserError(f"{config_path}: '{section}' must be a [section] table{_suggest(section, list(SECTIONS))}")
        for key, value in table.items():
            tp = _lookup(section, key, config_path)
            setattr(getattr(cfg, section), key, _coerce(value, tp, f"{section}.{key} in {config_path}"))
    for section, key, text in overrides:
        tp = _lookup(section, key, "the command line")
        if text is None:
            if tp is not bool:
                raise UserError(f"--{section}.{key} needs a value")
            text = "true"
        setattr(getattr(cfg, section), key, _parse_cli_value(text, tp, f"--{section}.{key}"))
    validate(cfg)
    return cfg


def _check_choice(cfg: Config, section: str, key: str) -> None:
    f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == key)
    choices = f.metadata.get("choices")
    value = getattr(getattr(cfg, section), key)
    if choices and value not in choices:
        raise UserError(
            f"{section}.{key} = '{value}' is not one of {', '.join(choices)}{_suggest(str(value), list(choices))}"
        )


def validate(cfg: Config) -> None:
    """Checks that need no process group: choices, counts, combinations."""
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            _check_choice(cfg, section, f.name)
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
        ("checkpoint", "keep_latest_k"), ("model", "n_layers"), ("model", "max_seq_len"), ("float8", "min_features"),
        ("optimizer", "eps"), ("training", "skip_nonfinite_steps"), ("data", "num_workers"),
    ]
    for section, key in non_negative:
        value = getattr(getattr(cfg, section), key)
        if value < 0:
            raise UserError(f"{section}.{key} must be >= 0, got {value}")
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


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


def to_toml(cfg: Config) -> str:
    lines: list[str] = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
        lines.append("")
    return "\n".join(lines)


def help_text() -> str:
    out = [
        "usage: train.py [--config FILE.toml] [--section.key value ...]",
        "",
        f"Options (CLI > TOML > default). Default config: {DEFAULT_CONFIG}",
    ]
    for section, cls in SECTIONS.items():
        out.append(f"\n[{section}]  {(cls.__doc__ or '').strip()}")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = f.metadata.get("choices")
            extra = f" {{{'|'.join(choices)}}}" if choices else ""
            out.append(f"  --{section}.{f.name}{extra} (default {_toml_value(default)})")
            out.append(f"      {f.metadata['help']}")
    return "\n".join(out)
