"""The config schema: one dataclass per TOML section, choice fields typed with `Literal`.

A choice field's `Literal` type is its only list of choices: validation, `--help`, the
choices column of docs/configuration.md (tests/trainer/test_config.py checks) and the modules that
need the list (`typing.get_args` of the alias) all read it from there.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.config.sources import SourceConfig

ModelFlavor = Literal["debug", "7B", "13B", "70B"]
AttentionKernel = Literal["auto", "sdpa", "flex"]
Float8Scaling = Literal["tensorwise", "rowwise", "rowwise_gw_hp", "blockwise"]
Float8Filter = Literal["rules", "auto"]
Float8Impl = Literal["ours", "torchao"]
# float8.operands.EAGER_CASTS (tests/trainer/float8_seam/test_seam.py holds the two equal).
Float8EagerCasts = Literal["auto", "triton", "compiled", "plain"]
CompileMode = Literal["none", "block", "model"]
ActivationCheckpointMode = Literal["none", "full", "selective"]
ParamDtype = Literal["auto", "bfloat16", "float32"]
ReduceDtype = Literal["float32", "bfloat16"]
GradientPacking = Literal["copies", "chunk_cat"]
DeviceChoice = Literal["auto", "cuda", "cpu"]
DataKind = Literal["pretrain", "sft"]
DataFormat = Literal["auto", "text", "jsonl", "parquet"]
BadRows = Literal["error", "skip"]
SFTFormat = Literal["auto", "alpaca", "chat"]
TrainOn = Literal["responses", "all"]
Truncation = Literal["truncate_prompt", "drop"]
OptimizerImplementation = Literal["auto", "fused", "foreach", "for-loop", "triton"]
LRDecay = Literal["linear", "cosine", "none"]
AsyncMode = Literal["disabled", "async"]
InitialLoadFormat = Literal["dcp", "hf", "meta", "torch"]
ExportDtype = Literal["bfloat16", "float32"]


def _opt(default: Any, help: str, **kw: Any) -> Any:
    meta = {"help": help}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def choices_of(tp: Any) -> tuple[str, ...] | None:
    """The values a field of type `tp` may take, or None when it is no choice field."""
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def _section(cls: type) -> type:
    """A config section: a dataclass whose fields' metadata["choices"] come from their Literal types."""
    hints = typing.get_type_hints(cls)
    for name, f in vars(cls).items():
        if isinstance(f, dataclasses.Field):
            f.metadata = types.MappingProxyType({**f.metadata, "choices": choices_of(hints[name])})
    return dataclass(cls)


@_section
class JobConfig:
    """Where the run writes and what it is."""

    dump_folder: str = _opt("outputs/debug", "Folder for config.toml, metrics.jsonl, tb/, checkpoints/, profiles/.")
    description: str = _opt("", "Free text describing the run; shown at startup and in TensorBoard.")
    dry_run: bool = _opt(False, "Build the model on the meta device, print the plan and exit without allocating weights.")
    dry_run_world_size: int = _opt(0, "The number of GPUs the dry run plans for (0 = torchrun's world, else the layout's degrees): plan a multi-GPU run from one process, e.g. 8 for a 7B run sharded over 8 GPUs.")
    dry_run_nproc_per_node: int = _opt(0, "GPUs per node the dry run's communication plan assumes (0 = torchrun's --nproc_per_node, else 8).")
    run_name: str = _opt("", "TensorBoard run name under <dump_folder>/tb/ (default: <flavor>-<precision>-<compile mode>).")


@_section
class ModelConfig:
    """Which model to build."""

    flavor: ModelFlavor = _opt("debug", "Model size.")
    tokenizer_path: str = _opt("data/tokenizer.model", "sentencepiece tokenizer.model (LLaMA-2 format: BOS 1, EOS 2).")
    n_layers: int = _opt(0, "Override the flavour's number of layers (0 = flavour default); e.g. fewer layers to fit one GPU.")
    max_seq_len: int = _opt(0, "Longest sequence the model is built for (RoPE table size); 0 = the flavour's (debug 2048, 7B 4096). "
                               "Set it to at least training.seq_len to train beyond the flavour's length.")
    attention: AttentionKernel = _opt(
        "auto",
        "Attention kernel for packed samples (data.pack): sdpa = SDPA with a dense document mask; flex = "
        "flex_attention with a block-sparse document mask (CUDA only: no flex backward on CPU); auto = flex "
        "when compile.mode is block or model on CUDA, else sdpa. Unpacked batches always use SDPA's causal kernel.",
    )


@_section
class Float8TrainingConfig:
    """Float8 training of the linear layers (see docs/float8/trainer.md)."""

    # Same names and defaults as float8.Float8Config (tests/trainer/float8_seam/test_seam.py checks),
    # without importing torch here: a bad config is refused before torch loads.

    enabled: bool = _opt(False, "Convert eligible nn.Linear layers to float8 training linears.")
    scaling: Float8Scaling = _opt("tensorwise", "Scaling recipe.")
    emulate: bool = _opt(False, "Emulate float8 GEMMs in high precision (for hardware without float8 GEMMs; slow).")
    fsdp_float8_all_gather: bool = _opt(False, "All-gather weights in float8 under FSDP (tensorwise, blockwise); halves weight traffic.")
    # Trainer-only: an argument of the post-step call, not a Float8Config field.
    cast_weights_once: bool = _opt(
        True,
        "With fsdp_float8_all_gather: cast each weight shard to float8 once per optimizer step, right after it, "
        "and hand those bytes to every all-gather of the next step (forward and backward); keeps 1 byte per "
        "sharded float8 weight parameter meanwhile. false = cast at every all-gather.",
    )
    filter_fqns: list[str] = _opt(["output"], "Module names to keep in high precision (substring match).")
    min_features: int = _opt(0, "Skip linears whose in or out features are below this (too small to gain from float8).")
    # Trainer-only, not a Float8Config field: "auto" times linears on the run's device at its tokens
    # per micro-batch and compile mode, which only the trainer knows (the seam passes them to float8.autofilter).
    filter: Float8Filter = _opt(
        "rules",
        "Which linears to convert: rules = every one that filter_fqns, min_features and the 16-alignment (blockwise: 128) allow; "
        "auto = of those, only the shapes whose float8 forward + backward, timed at start-up on the GPU at "
        "the run's tokens per micro-batch (eager or compiled as compile.mode), beats bf16 (on CPU: as rules).",
    )
    # Trainer-only: which implementation the trainer's float8 seam runs (trainer/float8_seam/reference.py: torchao).
    eager_casts: Float8EagerCasts = _opt(
        "auto", "How float8 casts run outside torch.compile: triton (one kernel per cast; CUDA), compiled "
                "(torch.compile'd casts), plain (eager ops), or auto (triton on CUDA where Triton imports, else "
                "compiled on CUDA, plain on CPU). Inside torch.compile, blockwise's casts also take the Triton kernels "
                "where this resolves to triton; other casts are traced. docs/float8/library.md, 'Global settings'."
    )
    impl: Float8Impl = _opt(
        "ours",
        "Float8 implementation: ours = this repository's float8/ package; torchao = the reference library "
        "torchao.float8 (pip install -e '.[reference]') with the same recipe, linears, FSDP float8 all-gather "
        "and TP styles, to compare the two in the same run (filter = 'auto' and metrics.float8_stats_freq are ours only).",
    )


@_section
class CompileConfig:
    """torch.compile granularity."""

    mode: CompileMode = _opt("none", "none = eager; block = each TransformerBlock (fullgraph); model = the whole model.")
    backend: str = _opt("inductor", "torch.compile backend. One that this torch does not have is refused before any work "
                                    "(with the closest name); with mode = \"none\" a backend other than inductor is a warning (it has no effect).")
    loss: bool = _opt(True, "With mode block or model, compile the cross-entropy too (its fp32 upcast and softmax fuse: no fp32 copy of the logits); vocab-sharded logits (TP loss_parallel) stay eager.")


@_section
class ParallelismConfig:
    """Device mesh: data-parallel replicas x data-parallel sharding (FSDP2) x tensor parallel."""

    data_parallel_replicate_degree: int = _opt(1, "HSDP: replicas of the FSDP-sharded model (gradients all-reduced across them); 1 = plain FSDP.")
    data_parallel_shard_degree: int = _opt(-1, "FSDP degree (within a replica); -1 = world size / (data_parallel_replicate_degree x tensor_parallel_degree).")
    tensor_parallel_degree: int = _opt(1, "Tensor (and sequence) parallel degree.")
    reshard_after_forward: bool = _opt(True, "FSDP: free gathered weights after forward (saves memory, regathers in backward); the last block's and the root's (embedding, norm, output), which backward needs first, stay gathered either way.")
    float8_tensor_parallel: bool = _opt(True, "With tensorwise float8, use float8-aware TP styles (all-gathers move float8).")
    loss_parallel: bool = _opt(True, "With TP: keep the logits sharded on the vocab dim and compute the cross-entropy in parallel, so no rank holds full-vocab logits.")
    single_rank_fast_path: bool = _opt(True, "At a data-parallel degree of 1: FSDP2's unshard and gradient reduction without the "
                                       "copies and host work one rank does not need (bitwise the same results; applied on the torch versions "
                                       "it was tested with, else plain FSDP2). false = plain FSDP2. docs/parallelism.md, 'One rank'.")
    gradient_packing: GradientPacking = _opt("copies", "FSDP2: how each reduce-scatter's gradients are packed into its buffer: copies = one foreach copy of every gradient's chunks "
                                             "(torch versions it was tested with); chunk_cat = FSDP2's own. The same bytes. docs/parallelism.md, 'Gradient packing'.")
    simulate_world_size: int = _opt(0, "Benchmarks: run this one process as rank 0 of N ranks whose collectives move no data (each rank "
                                    "mirrors this one): a step does one GPU's share of an N-GPU run, links aside. Not under torchrun; "
                                    "losses are not a real run's; no checkpoints; it reads every rank's rows, with data.num_workers workers for each. 0 = off. docs/parallelism.md, 'N ranks on one GPU'.")


@_section
class ActivationCheckpointConfig:
    """Recompute activations in backward to save memory."""

    mode: ActivationCheckpointMode = _opt("none", "none | full (every block) | selective.")
    selective_option: str = _opt("op", "selective: 'op' saves matmul/attention outputs and recomputes the rest; an integer N checkpoints every N-th block.")


@_section
class TrainingConfig:
    """The optimisation loop."""

    batch_size: int = _opt(8, "Sequences per micro-batch per data-parallel rank.")
    seq_len: int = _opt(256, "Tokens per sequence.")
    steps: int = _opt(100, "Optimizer steps.")
    max_norm: float = _opt(1.0, "Clip gradients to this global L2 norm (0 disables clipping).")
    gradient_accumulation_steps: int = _opt(1, "Micro-batches per optimizer step.")
    mixed_precision_param: ParamDtype = _opt(
        "auto",
        "Compute dtype of parameters (master weights stay fp32). auto = bfloat16 on CUDA and on CPUs with native "
        "bf16 (AVX512-BF16/AMX), float32 on other CPUs (bf16 is emulated there, far slower: docs/benchmarks.md, 'CPU without native bf16').",
    )
    mixed_precision_reduce: ReduceDtype = _opt("float32", "Gradient reduce dtype.")
    seed: int = _opt(42, "Seed for weights init and dropout-free randomness.")
    deterministic: bool = _opt(False, "Use deterministic algorithms (slower).")
    device: DeviceChoice = _opt("auto", "auto = CUDA when available, else CPU.")
    skip_nonfinite_steps: int = _opt(
        0,
        "A step whose loss or grad norm is NaN/inf is never applied; 0 = stop the run there, N = skip up to N "
        "such steps in a row (counted as skipped_steps in the metrics) and stop at the next.",
    )


@_section
class DataConfig:
    """Training data."""

    kind: DataKind = _opt("pretrain", "pretrain = packed text; sft = instruction tuning with prompt masking.")
    path: str = _opt("data/corpus", "File, folder or glob of .txt/.jsonl/.parquet (or a hub dataset name when online).")
    sources: list[SourceConfig] = _opt(
        [],
        "Weighted mixture instead of `path` ([[data.sources]] tables in TOML: path, weight, optional name, "
        "text_field, format); each window of N sequences holds each source's share within the tolerance of "
        "docs/data.md, 'Mixing sources'.",
    )
    format: DataFormat = _opt("auto", "Input format (auto = by file extension).")
    text_field: str = _opt("text", "Field holding the text in JSON Lines / parquet pretraining data.")
    num_workers: int = _opt(
        1,
        "Pretraining: worker processes per rank that read and tokenize this rank's share of the rows ahead "
        "of use (0 = on the training thread, when a batch is needed).",
    )
    bad_rows: BadRows = _opt(
        "error",
        "A data row that is not UTF-8, not JSON or lacks its field(s): error = stop the run naming file and line "
        "(local data up to 1 GB, and all SFT data, is checked before the first step); skip = skip it, "
        "warn once and count it as data/bad_rows in the metrics.",
    )
    sft_format: SFTFormat = _opt("auto", "SFT row format.")
    instruction_field: str = _opt("instruction", "Alpaca field with the instruction.")
    input_field: str = _opt("input", "Alpaca field with the optional input.")
    output_field: str = _opt("output", "Alpaca field with the response.")
    messages_field: str = _opt("messages", "Chat field with the list of {role, content} messages.")
    train_on: TrainOn = _opt("responses", "Tokens that carry loss in SFT.")
    pack: bool = _opt(False, "SFT: pack several samples per sequence with document-causal attention.")
    truncation: Truncation = _opt("truncate_prompt", "SFT samples longer than seq_len: cut the prompt's start, or drop them (counted in the log).")
    shuffle: bool = _opt(True, "SFT: seeded shuffle each epoch.")
    eval_path: str = _opt("", "Held-out SFT split for scripts/eval_sft.py.")


@_section
class ValidationConfig:
    """Held-out loss during training."""

    enable: bool = _opt(False, "Evaluate on held-out data every `freq` steps and at the last step.")
    path: str = _opt("", "Held-out data in data.path's formats (pretraining text or SFT rows, as data.kind says).")
    sources: list[SourceConfig] = _opt([], "Held-out mixture instead of `path` ([[validation.sources]], as [[data.sources]]).")
    freq: int = _opt(100, "Evaluate every N steps (and at the last step).")
    steps: int = _opt(10, "Batches per evaluation, each training.batch_size per DP rank: the same batches every time; "
                          "0 = the whole held-out set (every batch of its first pass).")


@_section
class OptimizerConfig:
    """AdamW."""

    lr: float = _opt(8e-4, "Peak learning rate.")
    weight_decay: float = _opt(0.1, "Decoupled weight decay (not applied to norms).")
    betas: list[float] = _opt([0.9, 0.95], "Adam betas.")
    eps: float = _opt(1e-8, "Adam epsilon.")
    implementation: OptimizerImplementation = _opt("auto", "auto = triton (one Triton launch per parameter group, float8 weights' amaxes in "
                                                   "the same pass) on CUDA where Triton imports, else fused; both guard and clip in-kernel.")


@_section
class LRSchedulerConfig:
    """Warmup then decay."""

    warmup_steps: int = _opt(10, "Linear warmup steps from 0 to the peak lr.")
    decay: LRDecay = _opt("cosine", "Decay after warmup down to min_lr_ratio * lr.")
    min_lr_ratio: float = _opt(0.1, "Final lr as a fraction of the peak lr.")


@_section
class CheckpointConfig:
    """Distributed checkpoints (DCP) and initial weights."""

    enable: bool = _opt(False, "Save checkpoints and resume from the latest complete one.")
    folder: str = _opt("checkpoints", "Checkpoint folder, relative to dump_folder unless absolute.")
    interval: int = _opt(500, "Save every N steps (and at the last step).")
    keep_latest_k: int = _opt(0, "Keep only the newest K checkpoints (0 = keep all).")
    async_mode: AsyncMode = _opt("disabled", "disabled = save in the training thread; async = save in the background.")
    load_step: int = _opt(-1, "Resume from this step (-1 = latest complete checkpoint).")
    resume_from_other_run: bool = _opt(
        False,
        "Resume from checkpoints in the folder that another run wrote (another job.dump_folder's run id); "
        "without it such a run stops, so a new run never continues or overwrites another's checkpoints.",
    )
    initial_load_path: str = _opt("", "Weights to start from when no checkpoint exists (see initial_load_format).")
    initial_load_format: InitialLoadFormat = _opt("dcp", "Format of initial_load_path.")
    export_dtype: ExportDtype = _opt("bfloat16", "dtype of the model-only export written at the end (model.safetensors).")
    export_final: bool = _opt(False, "Write <folder>/final/model.safetensors (model only) after the last step.")
    verify_checksums: bool = _opt(True, "Write a CRC-32 of every checkpoint file (checksums.json) and check them before resuming, so damaged files are refused instead of loaded.")


@_section
class MetricsConfig:
    """Console, metrics.jsonl, TensorBoard and (optionally) Weights & Biases."""

    log_freq: int = _opt(10, "Log every N steps (and at step 1).")
    enable_tensorboard: bool = _opt(True, "Write TensorBoard events under <dump_folder>/tb/<run-name>/.")
    enable_wandb: bool = _opt(
        False,
        "Also log to Weights & Biases (pip install -e '.[wandb]'): TensorBoard's keys, config.toml as the run "
        "config, a resumed run continues the same W&B run (its id in <dump_folder>/wandb_id); WANDB_MODE=offline works without network.",
    )
    wandb_project: str = _opt("f8trainer", "W&B project of the run (with enable_wandb).")
    float8_stats_freq: int = _opt(
        0, "Every N steps, log float8 health per float8 linear and operand (amax, scale, underflow, saturation "
           "and the shares of the squared norm they hold, amax growth) under float8/ (0 = off; ignored without float8). docs/float8/trainer.md, 'Is float8 hurting my loss?'."
    )


@_section
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


def field_types(section_cls: type) -> dict[str, Any]:
    """Each key of a section and its type (a `Literal` for a choice field)."""
    return typing.get_type_hints(section_cls)
