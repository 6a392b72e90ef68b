"""The trainer's one seam to float8: conversion, TP styles, the post-optimizer step and advice.

`Float8Training.from_config(cfg, device_type)` gives a `Float8Training` when `[float8]
enabled`, else a `NoFloat8Training` with the same methods doing nothing, so the trainer
calls them unconditionally. Build order (README, "Parallelism"): `convert` on the meta
model, `advice` before any weight is allocated, `tp_styles` for `parallelize_llama`, and
`post_optimizer_step` after every applied optimizer step.
"""

from __future__ import annotations

import torch
from torch import nn

from float8 import (
    Float8Config,
    Float8ConversionReport,
    convert_to_float8_training,
    precompute_float8_scales_for_fsdp,
    raise_dynamo_recompile_limit,
)
from float8.recipe import RECIPES
from float8.scaling import casts_compiled_in_eager
from float8.tp import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
from trainer.advisor import advise
from trainer.config import Config, Float8TrainingConfig
from trainer.distributed.parallelize import PLAIN_TP_STYLES, TPStyles

# The float8 gathers hand local tensors to the float8 colwise linears (float8/tp.py).
FLOAT8_TP_STYLES = TPStyles(
    Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput, local_inputs=True
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


def float8_tp_styles_compile_correctly(cfg: Config) -> bool:
    """False where torch miscompiles the float8 TP styles: torch 2.11 with float32 parameters.

    There a TP=2 float8 block compiled per block got a step-1 grad norm of 13.10 against
    17.87 eager (CPU, gloo); bf16 parameters, torch 2.13, and the plain TP styles with the
    same float8 linears are right.
    """
    if cfg.compile.mode == "none" or cfg.training.mixed_precision_param != "float32":
        return True
    return tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)


class Float8Training:
    """Float8 training of a run's linears, as `[float8]` and the rest of the config ask."""

    def __init__(self, cfg: Config, config: Float8Config, device_type: str) -> None:
        self.cfg = cfg
        self.config = config
        self.device_type = device_type
        self.recipe_name: str | None = config.scaling
        self.report: Float8ConversionReport | None = None
        self._notes: list[str] = []

    @staticmethod
    def from_config(cfg: Config, device_type: str) -> Float8Training | NoFloat8Training:
        if not cfg.float8.enabled:
            return NoFloat8Training()
        return Float8Training(cfg, float8_config(cfg.float8), device_type)

    def convert(self, model: nn.Module) -> Float8ConversionReport:
        """Swap eligible linears for float8 ones, on the meta model before any parallelism.

        Where the casts run as compiled kernels outside torch.compile (CUDA by default), this
        also raises dynamo's process-wide recompile limit to `dynamo_recompile_limit`: the
        package never changes it on its own. `summary_lines` says when it did.
        """
        self.report = convert_to_float8_training(model, config=self.config)
        if casts_compiled_in_eager(self.device_type, self.config.compile_casts_in_eager):
            raised = raise_dynamo_recompile_limit(self.config.dynamo_recompile_limit)
            if raised:
                self._notes.append(
                    f"torch._dynamo.config.recompile_limit raised from {raised[0]} to {raised[1]} "
                    "for the compiled eager float8 casts"
                )
        return self.report

    def _wants_float8_tp(self) -> bool:
        """A recipe whose activation casts the float8 TP gathers reproduce, and
        `parallelism.float8_tensor_parallel`."""
        return self.config.recipe.activations_gatherable_in_float8 and self.cfg.parallelism.float8_tensor_parallel

    def tp_styles(self) -> TPStyles:
        if self._wants_float8_tp() and float8_tp_styles_compile_correctly(self.cfg):
            return FLOAT8_TP_STYLES
        return PLAIN_TP_STYLES

    def post_optimizer_step(self, model: nn.Module) -> None:
        """After each applied optimizer step: the float8 all-gather's weight scales, in one all-reduce."""
        if self.config.fsdp_float8_all_gather:
            precompute_float8_scales_for_fsdp(model)

    def advice(self, device: torch.device, dp_degree: int, tp_degree: int) -> list[str]:
        """The advisor's warnings for this run; raises UserError for settings that cannot run."""
        notes = advise(self.cfg, device, self.report, dp_degree, tp_degree)
        if tp_degree > 1 and self._wants_float8_tp() and not float8_tp_styles_compile_correctly(self.cfg):
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
        return [f"float8: {self.report}", *(f"float8: {note}" for note in self._notes)]


class NoFloat8Training:
    """Float8 off: every hook of `Float8Training`, doing nothing."""

    recipe_name: str | None = None
    report: Float8ConversionReport | None = None

    def convert(self, model: nn.Module) -> None:
        return None

    def tp_styles(self) -> TPStyles:
        return PLAIN_TP_STYLES

    def post_optimizer_step(self, model: nn.Module) -> None:
        return None

    def advice(self, device: torch.device, dp_degree: int, tp_degree: int) -> list[str]:
        return []

    def describe(self, params: str) -> str:
        return params

    def summary_lines(self) -> list[str]:
        return []
