"""The trainer's one seam to float8: conversion, TP styles, the post-optimizer step and advice.

`Float8Training.from_config(cfg.float8, Float8RunContext.for_run(...))` gives a
`Float8Training` when `[float8] enabled`, else a `NoFloat8Training` with the same methods
doing nothing, so the trainer calls them unconditionally. Build order (docs/design.md):
`convert` on the meta model, `advice` before any weight is allocated, `tp_styles` for
`parallelize_llama`, and `post_optimizer_step` after every applied optimizer step. Every
float8 rule of the trainer lives here: the TP style choice, `filter = "auto"` and the startup advice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from float8 import (
    AutoFilter,
    Float8Config,
    Float8ConversionReport,
    convert_to_float8_training,
    linear_shapes,
    precompute_float8_scales_for_fsdp,
    raise_dynamo_recompile_limit,
    time_linear_shapes,
)
from float8.autofilter import AUTO_REASON_PREFIX, Timer, describe_shapes
from float8.gemm import scaled_mm_supported
from float8.health import Float8HealthMonitor, HealthReport
from float8.operands import eager_backend
from float8.recipe import RECIPES
from float8.tp import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
from trainer.config import Config, Float8TrainingConfig
from trainer.distributed.parallelize import PLAIN_TP_STYLES, TPStyles
from trainer.errors import UserError
from trainer.float8_seam.reference import TorchaoFloat8Training

# The float8 gathers hand local tensors to the float8 colwise linears (float8/tp.py).
FLOAT8_TP_STYLES = TPStyles(
    Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput, local_inputs=True
)
# Below this many tokens per GPU per micro-batch the float8 GEMMs are too small to beat bf16.
MIN_FLOAT8_TOKENS = 8192


@dataclass(frozen=True)
class Float8RunContext:
    """What the float8 seam needs of the run besides `[float8]`: resolved values, not the config."""

    device_type: str
    compile_mode: str
    # training.mixed_precision_param resolved for the device ('bfloat16' or 'float32').
    param_dtype: str
    float8_tensor_parallel: bool
    # batch_size x seq_len of one micro-batch of one DP rank (its TP group shares it).
    micro_batch_tokens: int
    # metrics.float8_stats_freq: float8 health every N steps, 0 = never.
    health_freq: int = 0

    @staticmethod
    def for_run(cfg: Config, device_type: str, param_dtype: str) -> Float8RunContext:
        return Float8RunContext(
            device_type=device_type, compile_mode=cfg.compile.mode, param_dtype=param_dtype,
            float8_tensor_parallel=cfg.parallelism.float8_tensor_parallel,
            micro_batch_tokens=cfg.training.batch_size * cfg.training.seq_len,
            health_freq=cfg.metrics.float8_stats_freq,
        )


def float8_config(f8: Float8TrainingConfig) -> Float8Config:
    """The package's config for the trainer's `[float8]` section (same names, same defaults)."""
    return Float8Config(
        scaling=f8.scaling,
        emulate=f8.emulate,
        # Recipes whose weight casts differ from the float8 all-gather's gather high-precision
        # weights instead (the advisor says so); the package itself would refuse the pair.
        fsdp_float8_all_gather=f8.fsdp_float8_all_gather and RECIPES[f8.scaling].weight_gatherable_in_float8,
        filter_fqns=list(f8.filter_fqns),
        min_features=f8.min_features,
    )


def float8_tp_styles_compile_correctly(run: Float8RunContext) -> bool:
    """False where torch miscompiles the float8 TP styles: torch 2.11 with float32 parameters.

    There a TP=2 float8 block compiled per block got a step-1 grad norm of 13.10 against
    17.87 eager (CPU, gloo); bf16 parameters, torch 2.13, and the plain TP styles with the
    same float8 linears are right.
    """
    if run.compile_mode == "none" or run.param_dtype != "float32":
        return True
    return tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)


def float8_gemm_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def refuse_unrunnable(f8: Float8TrainingConfig, device: torch.device) -> None:
    """UserError for float8 settings this device cannot run."""
    if device.type == "cuda" and not f8.emulate and not float8_gemm_supported(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise UserError(
            f"float8.enabled needs float8 GEMMs (compute capability >= 8.9: H100/H200/L40/RTX 4090); "
            f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}. Set float8.emulate = true to test, "
            "or float8.enabled = false"
        )
    rowwise = RECIPES[f8.scaling].rowwise_gemms
    if device.type == "cpu" and not f8.emulate and not scaled_mm_supported(rowwise, "cpu"):
        since = " (torch >= 2.13 does)" if rowwise else ""
        raise UserError(
            f"float8.scaling = '{f8.scaling}' needs {'row-wise' if rowwise else 'per-tensor'} scaled float8 "
            f"GEMMs, which torch {torch.__version__} does not run on this CPU{since}; set float8.emulate = true "
            "to test here"
        )


def advise(
    f8: Float8TrainingConfig, run: Float8RunContext, device: torch.device, float8_report: Any = None,
    dp_degree: int = 1, tp_degree: int = 1,
) -> list[str]:
    """Float8 settings that will be slow or pointless, each naming the setting and the fix;
    raises UserError for settings that cannot run on this device."""
    notes: list[str] = []
    if not f8.enabled:
        return notes
    refuse_unrunnable(f8, device)
    recipe = RECIPES[f8.scaling]
    if f8.emulate:
        notes.append("float8.emulate = true: float8 rounding with high-precision GEMMs, slower than bf16; for testing only")
    if run.compile_mode == "none":
        notes.append(_eager_note(eager_backend(device.type, float8_config(f8).eager_casts)))
    tokens = run.micro_batch_tokens // max(tp_degree, 1)
    if device.type == "cuda" and tokens < MIN_FLOAT8_TOKENS:
        notes.append(
            f"float8 with training.batch_size x training.seq_len = {tokens} tokens per GPU per micro-batch: "
            f"GEMMs this small gain little from float8; use >= {MIN_FLOAT8_TOKENS} tokens or float8.enabled = false"
        )
    if f8.fsdp_float8_all_gather and not recipe.weight_gatherable_in_float8:
        notes.append(
            f"float8.fsdp_float8_all_gather has no effect with float8.scaling = '{f8.scaling}' (weights are "
            "all-gathered in bf16); use scaling = 'tensorwise' or set it false"
        )
    if recipe.weight_gatherable_in_float8 and not f8.fsdp_float8_all_gather and dp_degree > 1:
        notes.append(
            f"float8 {f8.scaling} without float8.fsdp_float8_all_gather: FSDP all-gathers bf16 weights; set "
            "float8.fsdp_float8_all_gather = true to halve that traffic"
        )
    skipped = getattr(float8_report, "skipped", None) or []
    # What filter = "auto" keeps is no surprise: the summary lists it with its timings.
    not_filtered = [
        (fqn, why) for fqn, why in skipped
        if not any(s in fqn for s in f8.filter_fqns) and not why.startswith(AUTO_REASON_PREFIX)
    ]
    if not_filtered:
        notes.append(
            f"{len(not_filtered)} linear layers stay in high precision: "
            + _first_four([f"{fqn} ({why})" for fqn, why in not_filtered])
        )
    # The output layer is filtered by default (float8 logits cost accuracy, gain little);
    # anything more the user filtered out runs at bf16 speed, which is worth a reminder.
    default_filter = Float8TrainingConfig().filter_fqns
    user_filtered = [
        fqn for fqn, _ in skipped
        if any(s in fqn for s in f8.filter_fqns) and not any(s in fqn for s in default_filter)
    ]
    if user_filtered:
        notes.append(
            f"float8.filter_fqns keeps {len(user_filtered)} more linear layers in high precision than the "
            f"default {default_filter}: {_first_four(user_filtered)}; they get no float8 speed-up"
        )
    return notes


def _eager_note(eager_casts: str) -> str:
    """What compile.mode = 'none' costs a float8 run whose casts run on the `eager_casts` backend."""
    if eager_casts == "triton":
        return ("float8.enabled with compile.mode = 'none': eager float8 with the Triton cast kernels beats eager "
                "bf16, and compiled blocks are faster still (docs/benchmarks.md, table 'Eager float8 with Triton "
                "cast kernels, one H200'); set compile.mode = 'block' for the full speed-up")
    return ("float8.enabled with compile.mode = 'none': without Triton (float8/kernels) eager float8 runs its casts "
            "as separate kernels and gains little or nothing over bf16 (docs/benchmarks.md, table 'Full LLaMA-2-7B, "
            "FSDP2 on 2 H200s'); set compile.mode = 'block'")


def _first_four(names: list[str]) -> str:
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return ", ".join(names[:4]) + more


class Float8Training:
    """Float8 training of a run's linears, as `[float8]` and the rest of the config ask."""

    def __init__(
        self, f8: Float8TrainingConfig, config: Float8Config, run: Float8RunContext, timer: Timer | None = None
    ) -> None:
        self.f8 = f8
        self.config = config
        self.run = run
        # How filter = "auto" times a linear shape: float8.autofilter.time_linear_shape unless a test stubs it.
        self.timer = timer
        self.recipe_name: str | None = config.scaling
        self.report: Float8ConversionReport | None = None
        # What filter = "auto" timed and decided, or why it did not time ("auto: ..."); None with "rules".
        self.filter_note: str | None = None
        self._notes: list[str] = []
        self._health: Float8HealthMonitor | None = None

    @staticmethod
    def from_config(
        f8: Float8TrainingConfig, run: Float8RunContext, timer: Timer | None = None
    ) -> Float8Training | NoFloat8Training | TorchaoFloat8Training:
        if not f8.enabled:
            return NoFloat8Training()
        if f8.impl == "torchao":
            return TorchaoFloat8Training(f8, run)
        return Float8Training(f8, float8_config(f8), run, timer)

    def convert(self, model: nn.Module, time_linears: bool = True) -> Float8ConversionReport:
        """Swap eligible linears for float8 ones, on the meta model before any parallelism.

        Where the casts run as torch.compile'd kernels outside torch.compile, this
        first raises dynamo's process-wide recompile limit to `dynamo_recompile_limit` (the
        package never changes it on its own; `summary_lines` says when it did). With
        `filter = "auto"` on CUDA it then times the linears' shapes (every rank, the same
        decision on all) and converts those float8 runs faster; on CPU, or with
        `time_linears=False` (the dry run), it converts what the rules convert.
        """
        if eager_backend(self.run.device_type, self.config.eager_casts) == "compiled":
            raised = raise_dynamo_recompile_limit(self.config.dynamo_recompile_limit)
            if raised:
                self._notes.append(
                    f"torch._dynamo.config.recompile_limit raised from {raised[0]} to {raised[1]} "
                    "for the compiled eager float8 casts"
                )
        auto = self._auto_filter(model, time_linears) if self.f8.filter == "auto" else None
        self.report = convert_to_float8_training(model, config=self.config, module_filter_fn=auto)
        return self.report

    def _auto_filter(self, model: nn.Module, time_linears: bool) -> AutoFilter | None:
        """filter = "auto": the filter from timings on this rank's GPU, or None (the rules decide)
        where it cannot or must not time; `filter_note` says which."""
        run = self.run
        if run.device_type != "cuda" and time_linears:
            self.filter_note = (
                f"auto: auto-timing needs a GPU, so this {run.device_type} run converts what filter = 'rules' converts"
            )
            return None
        shapes = linear_shapes(model, self.config)
        tokens, compiled = run.micro_batch_tokens, run.compile_mode != "none"
        timed = (f"{len(set(shapes.values()))} linear shapes at {tokens:,} tokens per micro-batch, "
                 + ("compiled" if compiled else "eager"))
        if not time_linears:
            cannot = " (and cannot without a GPU)" if run.device_type != "cuda" else ""
            self.filter_note = (
                f"auto: at start-up would time {timed}: {describe_shapes(shapes)}; the dry run never "
                f"times{cannot}: the linears above are what filter = 'rules' converts"
            )
            return None
        device = torch.device("cuda")  # this rank's current device, which init_distributed set
        # A GPU without float8 GEMMs fails in the timing: refuse it first, as `advice` would.
        refuse_unrunnable(self.f8, device)
        timings = time_linear_shapes(shapes.values(), tokens, self.config, compiled, device, self.timer)
        self.filter_note = f"auto timed {timed}: {describe_shapes(shapes, timings)}"
        return AutoFilter(timings, tokens)

    def _wants_float8_tp(self) -> bool:
        """A recipe whose activation casts the float8 TP gathers reproduce, and
        `parallelism.float8_tensor_parallel`."""
        return self.config.recipe.activations_gatherable_in_float8 and self.run.float8_tensor_parallel

    def tp_styles(self) -> TPStyles:
        if self._wants_float8_tp() and float8_tp_styles_compile_correctly(self.run):
            return FLOAT8_TP_STYLES
        return PLAIN_TP_STYLES

    def post_optimizer_step(self, model: nn.Module) -> None:
        """After each optimizer step: the float8 all-gather's weight scales, in one all-reduce, and
        with `float8.cast_weights_once` the float8 weight shards its all-gathers hand on."""
        if self.config.fsdp_float8_all_gather:
            precompute_float8_scales_for_fsdp(model, cast_weights=self.f8.cast_weights_once)

    def arm_health(self, model: nn.Module, step: int, device: torch.device) -> None:
        """Before a step's forward: on every `metrics.float8_stats_freq`-th step, have the float8
        linears report what their casts do (float8/health.py)."""
        if self.run.health_freq and step % self.run.health_freq == 0:
            if self._health is None:
                self._health = Float8HealthMonitor(model, device)
            self._health.arm()

    def read_health(self) -> HealthReport:
        """After the armed step: its float8 health over every rank (all ranks call this); empty otherwise."""
        if self._health is None or not self._health.armed:
            return HealthReport({}, [])
        return self._health.collect()

    def advice(self, device: torch.device, dp_degree: int, tp_degree: int) -> list[str]:
        """The advisor's warnings for this run; raises UserError for settings that cannot run."""
        notes = advise(self.f8, self.run, device, self.report, dp_degree, tp_degree)
        if tp_degree > 1 and self._wants_float8_tp() and not float8_tp_styles_compile_correctly(self.run):
            notes.append(
                f"torch {torch.__version__} miscompiles the float8 tensor-parallel styles with float32 "
                "parameters: activations are all-gathered in float32 instead; use "
                "training.mixed_precision_param = 'bfloat16' or torch >= 2.13 for float8 all-gathers"
            )
        return notes

    def describe(self, params: str) -> str:
        """The precision of the run, for the startup summary."""
        return f"float8 {self.recipe_name}, {params}"

    def summary_lines(self) -> list[str]:
        notes = [f"filter {self.filter_note}", *self._notes] if self.filter_note else self._notes
        return [f"float8: {self.report}", *(f"float8: {note}" for note in notes)]


class NoFloat8Training:
    """Float8 off: every hook of `Float8Training`, doing nothing."""

    recipe_name: str | None = None
    report: Float8ConversionReport | None = None
    filter_note: str | None = None

    def convert(self, model: nn.Module, time_linears: bool = True) -> None:
        return None

    def tp_styles(self) -> TPStyles:
        return PLAIN_TP_STYLES

    def post_optimizer_step(self, model: nn.Module) -> None:
        return None

    def arm_health(self, model: nn.Module, step: int, device: torch.device) -> None:
        return None

    def read_health(self) -> HealthReport:
        return HealthReport({}, [])

    def advice(self, device: torch.device, dp_degree: int, tp_degree: int) -> list[str]:
        return []

    def describe(self, params: str) -> str:
        return params

    def summary_lines(self) -> list[str]:
        return []
