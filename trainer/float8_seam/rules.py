"""What the trainer's float8 implementations share: the run context and the rules base.

`Float8Rules` holds every float8 rule the trainer applies that does not depend on whose float8
linears run: the recipe's facts (FSDP float8 all-gather, float8 TP), the precision labels, the
memory the estimate counts, the advice every implementation gives, and the no-op hooks. Each
implementation (off.py, ours.py, reference.py) subclasses it and overrides what differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from float8 import Float8ConversionReport
from float8.gemm import blockwise_gemm_supported, scaled_mm_supported
from float8.health import HealthReport
from float8.recipe import RECIPES
from trainer.config import Config, Float8TrainingConfig
from trainer.distributed.memory_plan import Float8Memory
from trainer.distributed.parallelize import PLAIN_TP_STYLES, TPStyles
from trainer.errors import UserError


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
    # parallelism.tensor_parallel_degree: each rank holds 1/tp of every converted linear.
    tp_degree: int = 1
    # The one-GPU fast path is on (trainer/distributed/single_rank_fast_path.py): FSDP over one rank,
    # whose unshard keeps what a weight hands it.
    single_rank_fast_path: bool = False

    @staticmethod
    def for_run(cfg: Config, device_type: str, param_dtype: str, single_rank_fast_path: bool = False) -> Float8RunContext:
        return Float8RunContext(
            device_type=device_type, compile_mode=cfg.compile.mode, param_dtype=param_dtype,
            float8_tensor_parallel=cfg.parallelism.float8_tensor_parallel,
            micro_batch_tokens=cfg.training.batch_size * cfg.training.seq_len,
            health_freq=cfg.metrics.float8_stats_freq, tp_degree=cfg.parallelism.tensor_parallel_degree,
            single_rank_fast_path=single_rank_fast_path,
        )


def gathers_float8_weights(f8: Float8TrainingConfig) -> bool:
    """`fsdp_float8_all_gather` as it applies: recipes whose weight casts differ from the float8
    all-gather's gather high-precision weights instead (the advice says so)."""
    return f8.fsdp_float8_all_gather and RECIPES[f8.scaling].weight_gatherable_in_float8


class Float8Rules:
    """The rules base of the three implementations: float8 on with `[float8]`'s recipe, hooks doing nothing."""

    # Which implementation, as the run name and the dry run show it ("" for ours).
    impl_label: ClassVar[str] = ""
    # The advice's line for float8.emulate = true.
    emulate_note: ClassVar[str] = ""

    def __init__(self, f8: Float8TrainingConfig, run: Float8RunContext) -> None:
        self.f8 = f8
        self.run = run
        self.recipe_name: str | None = f8.scaling
        self.recipe = RECIPES[f8.scaling]
        self.all_gather = gathers_float8_weights(f8)
        self.report: Float8ConversionReport | None = None
        # What filter = "auto" timed and decided, or why it did not time; None where nothing was asked.
        self.filter_note: str | None = None

    @classmethod
    def memory(cls, f8: Float8TrainingConfig, single_rank_fast_path: bool = False) -> Float8Memory:
        """What the memory estimate counts of float8 (before any seam is built: it runs first)."""
        return Float8Memory(linears=True)

    def gathered_in_float8(self) -> set[str]:
        """The linears (module names) whose weights FSDP all-gathers in float8, once `convert` has run."""
        return set(self.report.converted) if self.all_gather and self.report else set()

    # -- labels: the precision of the run, each said in one place ---------------------------------------

    def run_name_precision(self, param_dtype: str) -> str:
        """The precision part of the default run name: the recipe, with another impl than ours its name."""
        return f"{self.recipe_name}-{self.impl_label}" if self.impl_label else str(self.recipe_name)

    def plan_precision(self, param_dtype: str) -> str:
        """The dry run's precision."""
        return f"float8 {self.recipe_name}" + (f" ({self.impl_label})" if self.impl_label else "")

    def describe(self, params: str) -> str:
        """The precision of the run, for the startup summary."""
        return f"float8 {self.recipe_name}, {params}"

    def summary_lines(self) -> list[str]:
        return []

    # -- the build and the loop ----------------------------------------------------------------------------

    def convert(self, model: nn.Module, time_linears: bool = True) -> Float8ConversionReport | None:
        return None

    def wants_float8_tp(self) -> bool:
        """A recipe whose activation casts the float8 TP gathers reproduce, and
        `parallelism.float8_tensor_parallel`."""
        return self.recipe.activations_gatherable_in_float8 and self.run.float8_tensor_parallel

    def tp_styles(self) -> TPStyles:
        return PLAIN_TP_STYLES

    def post_optimizer_step(self, model: nn.Module, weight_amaxes: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None:
        return None

    def arm_health(self, model: nn.Module, step: int, device: torch.device) -> None:
        return None

    def read_health(self) -> HealthReport:
        return HealthReport({}, [])

    # -- advice -----------------------------------------------------------------------------------------

    def advice(self, device: torch.device, dp_degree: int, tp_degree: int) -> list[str]:
        """Float8 settings that will be slow or pointless, each naming the setting and the fix;
        raises UserError for settings that cannot run on this device."""
        self.refuse_unrunnable(device)
        notes: list[str] = []
        if self.f8.emulate:
            notes.append(self.emulate_note)
        if self.run.compile_mode == "none":
            notes.append(self.eager_note(device))
        notes += self.device_notes(device, tp_degree)
        if self.f8.fsdp_float8_all_gather and not self.all_gather:
            notes.append(
                f"float8.fsdp_float8_all_gather has no effect with float8.scaling = '{self.f8.scaling}' (weights are "
                "all-gathered in bf16); use scaling = 'tensorwise' or 'blockwise', or set it false"
            )
        if self.recipe.weight_gatherable_in_float8 and not self.all_gather and dp_degree > 1:
            notes.append(
                f"float8 {self.f8.scaling} without float8.fsdp_float8_all_gather: FSDP all-gathers bf16 weights; set "
                "float8.fsdp_float8_all_gather = true to halve that traffic"
            )
        return notes + self.layer_notes(tp_degree)

    def eager_note(self, device: torch.device) -> str:
        """What compile.mode = 'none' costs this implementation's float8 on `device`."""
        raise NotImplementedError

    def device_notes(self, device: torch.device, tp_degree: int) -> list[str]:
        """This implementation's notes on the device and the GEMM sizes."""
        return []

    def layer_notes(self, tp_degree: int) -> list[str]:
        """This implementation's notes on the converted layers and their TP styles."""
        return []

    def refuse_unrunnable(self, device: torch.device) -> None:
        """UserError for float8 settings this device cannot run: `cuda_refusal` on a GPU without
        float8 GEMMs, and a recipe whose scaled GEMMs this CPU's torch lacks."""
        if self.f8.emulate:
            return
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise UserError(self.cuda_refusal(device))
        if self.recipe.blockwise_gemms:
            if not blockwise_gemm_supported(device):
                raise UserError(
                    f"float8.scaling = '{self.f8.scaling}' needs block-scaled float8 GEMMs, which torch runs on sm_90 "
                    f"(H100/H200) only, not {torch.cuda.get_device_name(device)}; set float8.emulate = true to test, or "
                    "scaling = 'rowwise' for per-row scales"
                )
            return  # a CPU runs them as their formula, whatever its torch (float8/gemm.py)
        rowwise = self.recipe.rowwise_gemms
        if device.type == "cpu" and not scaled_mm_supported(rowwise, "cpu"):
            raise UserError(
                f"float8.scaling = '{self.f8.scaling}' needs {'row-wise' if rowwise else 'per-tensor'} scaled float8 "
                f"GEMMs, which torch {torch.__version__} does not run on this CPU{self.cpu_refusal_since(rowwise)}; "
                "set float8.emulate = true to test here"
            )

    def cuda_refusal(self, device: torch.device) -> str:
        raise NotImplementedError

    def cpu_refusal_since(self, rowwise: bool) -> str:
        return ""


def first_four(names: list[str]) -> str:
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return ", ".join(names[:4]) + more
