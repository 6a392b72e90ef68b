"""`[float8] impl = "ours"`: the trainer's float8 seam on this repository's float8/ package.

Besides the rules base (rules.py): `filter = "auto"` (time the linears' shapes on the GPU and
convert those float8 runs faster), the float8 TP styles, the float8 all-gather's post-step
scales (with `cast_weights_once`, the kept float8 weight shards), float8 health, and the advice
on GEMM sizes, the eager casts and the layers left in high precision.
"""

from __future__ import annotations

from collections.abc import Mapping

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
from float8.autofilter import AUTO_RULE, Timer, describe_shapes
from float8.convert import FILTER_FQNS, TensorParallelAlignment, all_of
from float8.health import Float8HealthMonitor, HealthReport
from float8.operands import eager_backend
from float8.recipe import RECIPES
from float8.tp import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
from trainer.config import Float8TrainingConfig
from trainer.distributed.memory_plan import Float8Memory
from trainer.distributed.parallelize import PLAIN_TP_STYLES, TPStyles
from trainer.float8_seam.rules import (
    Float8Rules,
    Float8RunContext,
    first_four,
    gathers_float8_weights,
)

# The float8 gathers hand local tensors to the float8 colwise linears (float8/tp.py).
FLOAT8_TP_STYLES = TPStyles(
    Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput, local_inputs=True, float8_gathers=True
)
# Below this many tokens per GPU per micro-batch the float8 GEMMs are too small to beat bf16.
MIN_FLOAT8_TOKENS = 8192
# When to pick blockwise, from issue #40's GEMM timings at LLaMA-2-7B shapes (one H200, M = 8192).
BLOCKWISE_NOTE = (
    "float8.scaling = 'blockwise' puts accuracy first: its GEMMs gain 1.5 dB SQNR forward and 4.5-7 dB backward over "
    "tensorwise, but run at 0.64-0.92x tensorwise's speed (a 7B layer's GEMMs 10.2-10.4 ms against 7.7 tensorwise and "
    "13.9-14.1 bf16); for speed use 'tensorwise' (docs/float8/trainer.md, 'Which recipe?')"
)

# Seen on a 2-core AVX512 Xeon with GCC 12.2, torch 2.11 and 2.13: inductor's backward kernel transposes
# two bf16 tiles in one loop, which GCC 12.2 at -O3 miscompiles into uninitialised values
# (docs/history/2026-12-05-cpu-rowwise-nan-gcc12.md); rowwise_gw_hp's and tensorwise's graphs did not.
CPU_COMPILED_ROWWISE_NOTE = (
    "float8.scaling = 'rowwise' compiled on a CPU with bf16 params gave NaN gradients at step 1 on an AVX512 CPU "
    "(GCC 12 miscompiles inductor's bf16 tile transposes there, torch 2.11 and 2.13; docs/float8/trainer.md); set "
    "training.mixed_precision_param = 'float32' or compile.mode = 'none'"
)


def float8_config(f8: Float8TrainingConfig, single_rank_fast_path: bool = False) -> Float8Config:
    """The package's config for the trainer's `[float8]` section (same names, same defaults); on the
    one-GPU fast path, weights cast per row in the step are read as stored (no unshard copy)."""
    return Float8Config(
        scaling=f8.scaling,
        emulate=f8.emulate,
        # The package itself would refuse a recipe that cannot gather float8 weights with the flag.
        fsdp_float8_all_gather=gathers_float8_weights(f8),
        fsdp_unshard_as_stored=single_rank_fast_path and RECIPES[f8.scaling].weight_cast_per_row,
        filter_fqns=list(f8.filter_fqns),
        min_features=f8.min_features, eager_casts=f8.eager_casts,
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


def _eager_note(eager_casts: str) -> str:
    """What compile.mode = 'none' costs a float8 run whose casts run on the `eager_casts` backend."""
    if eager_casts == "triton":
        return ("float8.enabled with compile.mode = 'none': eager float8 with the Triton cast kernels beats eager "
                "bf16, and compiled blocks are faster still (docs/benchmarks.md, table 'Eager float8 by cast "
                "backend, one H200'); set compile.mode = 'block' for the full speed-up")
    return ("float8.enabled with compile.mode = 'none': without Triton (float8/kernels) eager float8 runs its casts "
            "as separate kernels and gains little or nothing over bf16 (docs/benchmarks.md, table 'Eager float8 by "
            "cast backend, one H200', its compiled-casts column); set compile.mode = 'block'")


class OursFloat8Training(Float8Rules):
    """Float8 training of a run's linears by this repository's float8/ package."""

    emulate_note = "float8.emulate = true: float8 rounding with high-precision GEMMs, slower than bf16; for testing only"

    def __init__(self, f8: Float8TrainingConfig, run: Float8RunContext, timer: Timer | None = None) -> None:
        super().__init__(f8, run)
        self.config = float8_config(f8, run.single_rank_fast_path)
        # How filter = "auto" times a linear shape: float8.autofilter.time_linear_shape unless a test stubs it.
        self.timer = timer
        self._notes: list[str] = []
        self._health: Float8HealthMonitor | None = None

    @classmethod
    def memory(cls, f8: Float8TrainingConfig, single_rank_fast_path: bool = False) -> Float8Memory:
        # float8.cast_weights_once keeps each float8 weight shard from one step to the next; weights read as
        # stored keep their transposed float8 bytes from forward to backward.
        config = float8_config(f8, single_rank_fast_path)
        return Float8Memory(linears=True, kept_shards=gathers_float8_weights(f8) and f8.cast_weights_once,
                            weights_for_backward=config.fsdp_unshard_as_stored)

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
        # Under TP each rank's shard of a converted linear must keep the recipe's alignment (blockwise: whole blocks).
        tp = TensorParallelAlignment(self.config, self.run.tp_degree) if self.run.tp_degree > 1 else None
        self.report = convert_to_float8_training(model, config=self.config, module_filter_fn=all_of(tp, auto))
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
        self.refuse_unrunnable(device)
        timings = time_linear_shapes(shapes.values(), tokens, self.config, compiled, device, self.timer)
        self.filter_note = f"auto timed {timed}: {describe_shapes(shapes, timings)}"
        return AutoFilter(timings, tokens)

    def tp_styles(self) -> TPStyles:
        if self.wants_float8_tp() and float8_tp_styles_compile_correctly(self.run):
            return FLOAT8_TP_STYLES
        return PLAIN_TP_STYLES

    def post_optimizer_step(self, model: nn.Module, weight_amaxes: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None:
        """After each optimizer step: the float8 all-gather's weight scales, in one all-reduce, and
        with `float8.cast_weights_once` the float8 weight shards its all-gathers hand on;
        `weight_amaxes` (by parameter, from the optimizer's step) spare their amax pass. Weights
        unsharded as stored (rowwise on the one-GPU fast path): their rows' and columns' amaxes."""
        if self.config.fsdp_float8_all_gather or self.config.fsdp_unshard_as_stored:
            precompute_float8_scales_for_fsdp(model, cast_weights=self.f8.cast_weights_once, amaxes=weight_amaxes)

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

    def eager_note(self, device: torch.device) -> str:
        return _eager_note(eager_backend(device.type, self.config.eager_casts))

    def cuda_refusal(self, device: torch.device) -> str:
        major, minor = torch.cuda.get_device_capability(device)
        return (
            f"float8.enabled needs float8 GEMMs (compute capability >= 8.9: H100/H200/L40/RTX 4090); "
            f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}. Set float8.emulate = true to test, "
            "or float8.enabled = false"
        )

    def cpu_refusal_since(self, rowwise: bool) -> str:
        return " (torch >= 2.13 does)" if rowwise else ""

    def device_notes(self, device: torch.device, tp_degree: int) -> list[str]:
        tokens = self.run.micro_batch_tokens // max(tp_degree, 1)
        notes = [BLOCKWISE_NOTE] if device.type == "cuda" and self.recipe.blockwise_gemms and not self.f8.emulate else []
        if (device.type == "cpu" and self.f8.scaling == "rowwise" and self.run.compile_mode != "none"
                and self.run.param_dtype == "bfloat16"):
            notes.append(CPU_COMPILED_ROWWISE_NOTE)
        if device.type == "cuda" and tokens < MIN_FLOAT8_TOKENS:
            notes.append(
                f"float8 with training.batch_size x training.seq_len = {tokens} tokens per GPU per micro-batch: "
                f"GEMMs this small gain little from float8; use >= {MIN_FLOAT8_TOKENS} tokens or float8.enabled = false"
            )
        return notes

    def layer_notes(self, tp_degree: int) -> list[str]:
        notes = []
        report = self.report or Float8ConversionReport()
        # What filter = "auto" keeps is no surprise: the summary lists it with its timings.
        not_filtered = [(fqn, why) for fqn, why in report.skipped if report.kept_by[fqn] not in (FILTER_FQNS, AUTO_RULE)]
        if not_filtered:
            notes.append(
                f"{len(not_filtered)} linear layers stay in high precision: "
                + first_four([f"{fqn} ({why})" for fqn, why in not_filtered])
            )
        # The output layer is filtered by default (float8 logits cost accuracy, gain little);
        # anything more the user filtered out runs at bf16 speed, which is worth a reminder.
        default_filter = Float8TrainingConfig().filter_fqns
        user_filtered = [
            fqn for fqn, rule in report.kept_by.items()
            if rule == FILTER_FQNS and not any(s in fqn for s in default_filter)
        ]
        if user_filtered:
            notes.append(
                f"float8.filter_fqns keeps {len(user_filtered)} more linear layers in high precision than the "
                f"default {default_filter}: {first_four(user_filtered)}; they get no float8 speed-up"
            )
        if tp_degree > 1 and self.wants_float8_tp() and not float8_tp_styles_compile_correctly(self.run):
            notes.append(
                f"torch {torch.__version__} miscompiles the float8 tensor-parallel styles with float32 "
                "parameters: activations are all-gathered in float32 instead; use "
                "training.mixed_precision_param = 'bfloat16' or torch >= 2.13 for float8 all-gathers"
            )
        return notes

    def summary_lines(self) -> list[str]:
        notes = [f"filter {self.filter_note}", *self._notes] if self.filter_note else self._notes
        return [f"float8: {self.report}", *(f"float8: {note}" for note in notes)]
