"""`[float8] impl = "torchao"`: the trainer's float8 seam on the reference library, torchao.float8.

`build_seam` (trainer/float8_seam/seam.py) returns a `TorchaoFloat8Training` for impl = "torchao":
the seam's methods, doing with torchao what the trainer does with ours, so one trainer, data,
layout and compile mode run either implementation. torchao is imported
only here, inside functions, and only for impl = "torchao" (the optional `reference` extra):

    ours (float8/)                          torchao.float8
    tensorwise                              Float8LinearConfig(enable_fsdp_float8_all_gather=...)
    rowwise                                 Float8LinearConfig.from_recipe_name("rowwise")
    rowwise_gw_hp                           Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")
    emulate                                 Float8LinearConfig.emulate (fp32 GEMMs of the float8 values)
    filter_fqns, min_features, 16-aligned   module_filter_fn: float8.convert.rules_skip
    precompute_float8_scales_for_fsdp       precompute_float8_dynamic_scale_for_fsdp
    float8.tp styles (tensorwise)           torchao.float8.float8_tensor_parallel styles

`filter = "auto"` and `metrics.float8_stats_freq` are this package's alone: options.py
refuses them with impl = "torchao". scripts/harness/float8_bench/impls.py converts benchmark modules with these.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from float8 import Float8Config, Float8ConversionReport
from float8.convert import rules_skip
from trainer.config import Float8TrainingConfig
from trainer.distributed.parallelize import PLAIN_TP_STYLES, TPStyles
from trainer.errors import UserError
from trainer.float8_seam.rules import Float8Rules, Float8RunContext

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

# Our recipe name -> torchao's (None: Float8LinearConfig's default, which is tensorwise).
TORCHAO_RECIPES = {"tensorwise": None, "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}
INSTALL_HINT = 'pip install -e ".[reference]"'
TRAINER_OPTION = "float8.impl = 'torchao'"


class ReferenceMissing(UserError):
    """torchao is not installed (or not importable with this torch): one line, exit 2."""


def torchao_version(asked_by: str) -> str:
    """The version of torchao, with torchao.float8 imported; raises ReferenceMissing naming
    `asked_by` (the option that wants torchao) and the install command."""
    # torchao logs a warning per CUDA extension it cannot load (none is float8 training's; on a
    # CPU build, every one), and torch one that torchao registers an Enum as a pytree constant.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    pytree = logging.getLogger("torch.utils._pytree")
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        import torchao
        import torchao.float8
    except ImportError as e:
        raise ReferenceMissing(f"{asked_by} needs the reference library torchao ({e}): {INSTALL_HINT}") from None
    finally:
        pytree.setLevel(level)
    return torchao.__version__


def torchao_config(scaling: str, fsdp_float8_all_gather: bool = False, emulate: bool = False) -> Float8LinearConfig:
    """torchao's config for our recipe `scaling` (torchao_version first: this imports torchao)."""
    from torchao.float8 import Float8LinearConfig

    recipe = TORCHAO_RECIPES[scaling]
    if recipe is None:
        return Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=emulate)
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


class TorchaoFloat8Training(Float8Rules):
    """Float8 training of a run's linears by torchao.float8."""

    impl_label = "torchao"
    emulate_note = "float8.emulate = true: torchao's float8 rounding with fp32 GEMMs, slower than bf16; for testing only"

    def __init__(self, f8: Float8TrainingConfig, run: Float8RunContext) -> None:
        super().__init__(f8, run)
        self.version = torchao_version(TRAINER_OPTION)
        # Our conversion rules pick torchao's linears too, so both implementations convert the same ones.
        self.rules = Float8Config(filter_fqns=list(f8.filter_fqns), min_features=f8.min_features)

    def convert(self, model: nn.Module, time_linears: bool = True) -> Float8ConversionReport:
        """Swap the linears our rules convert for torchao's Float8Linear, on the meta model; the
        report lists them in the order float8.convert_to_float8_training does."""
        from torchao.float8 import convert_to_float8_training

        report = Float8ConversionReport()
        for parent_fqn, parent in model.named_modules():
            for name, child in parent.named_children():
                if isinstance(child, nn.Linear):
                    fqn = f"{parent_fqn}.{name}" if parent_fqn else name
                    skip = rules_skip(fqn, child, self.rules)
                    if skip is None:
                        report.converted.append(fqn)
                    else:
                        report.skip(fqn, *skip)
        converted = set(report.converted)
        config = torchao_config(self.f8.scaling, self.all_gather, self.f8.emulate)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in converted)
        self.report = report
        return report

    def tp_styles(self) -> TPStyles:
        """torchao's float8 styles where ours would use float8 ones (tensorwise) on CUDA, else torch's
        plain ones: torchao all-gathers float8 dtypes, which gloo cannot ("Invalid scalar type")."""
        if not (self.wants_float8_tp() and self.run.device_type == "cuda"):
            return PLAIN_TP_STYLES
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        # torchao's module-input style hands its colwise linears float8 DTensors, which they take as
        # they are: no local inputs.
        return TPStyles(Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput, float8_gathers=True)

    def post_optimizer_step(self, model: nn.Module, weight_amaxes: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None:
        """After each optimizer step: the float8 all-gather's weight scales, in one all-reduce (torchao
        computes its own amaxes: `weight_amaxes` is not used)."""
        if self.all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)

    def eager_note(self, device: torch.device) -> str:
        return ("float8.impl = 'torchao' with compile.mode = 'none': torchao's eager float8 runs each cast as "
                "separate kernels (about half bf16's speed, docs/float8/background.md); set compile.mode = 'block'")

    def device_notes(self, device: torch.device, tp_degree: int) -> list[str]:
        notes = []
        if device.type == "cpu" and not self.f8.emulate and torch.cpu._is_amx_tile_supported():
            notes.append("float8.impl = 'torchao' on a CPU with AMX: torch._scaled_mm runs oneDNN's reference float8 "
                         "kernel there, about 1,000x slower than ATen's (docs/float8/library.md, 'On CPU')")
        if tp_degree > 1 and self.wants_float8_tp() and device.type != "cuda":
            notes.append(f"float8.impl = 'torchao' on {device.type}: torchao's float8 tensor-parallel styles "
                         "all-gather float8 dtypes, which gloo cannot; activations are all-gathered in high "
                         "precision instead")
        return notes

    def cuda_refusal(self, device: torch.device) -> str:
        return (f"{TRAINER_OPTION} needs float8 GEMMs (compute capability >= 8.9: H100/H200/L40/RTX "
                "4090); set float8.emulate = true to test, or float8.enabled = false")

    def describe(self, params: str) -> str:
        """The precision of the run, for the startup summary."""
        return f"float8 {self.recipe_name} (torchao {self.version}), {params}"

    def summary_lines(self) -> list[str]:
        lines = [f"float8 (torchao {self.version}): {self.report}"]
        if self.all_gather and self.f8.cast_weights_once:
            # The default: refusing it would make every torchao all-gather run set it false.
            lines.append("float8: float8.cast_weights_once is ours only (ignored): torchao casts each weight "
                         "shard to float8 at every all-gather")
        return lines
