"""The seam the trainer calls: `Float8Seam`, and `build_seam`, which picks its implementation.

Build order (docs/design.md): `convert` on the meta model, `advice` before any weight is
allocated, `tp_styles` for `parallelize_llama`, `post_optimizer_step` after every applied
optimizer step, `arm_health`/`read_health` around a step. `float8_memory` is asked before
any of these (the memory check runs first). The trainer holds no float8 branches: float8 off
is an implementation too (off.py). The rest of the trainer imports this module only (and
options.py, for the config checks); tests/test_layering.py holds it to that.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn

from float8 import Float8ConversionReport
from float8.autofilter import Timer
from float8.health import HealthReport
from trainer.config import Float8TrainingConfig
from trainer.distributed.memory_plan import Float8Memory
from trainer.distributed.parallelize import TPStyles
from trainer.float8_seam.off import NoFloat8Training
from trainer.float8_seam.ours import OursFloat8Training
from trainer.float8_seam.reference import TorchaoFloat8Training
from trainer.float8_seam.rules import Float8Rules, Float8RunContext

__all__ = ["Float8RunContext", "Float8Seam", "build_seam", "float8_memory"]

# float8.impl -> its seam class (float8.impl's choices in the config schema name the same).
IMPLEMENTATIONS: dict[str, type[Float8Rules]] = {"ours": OursFloat8Training, "torchao": TorchaoFloat8Training}


class Float8Seam(Protocol):
    """What the trainer and the dry run call of float8, whichever implementation runs (or none)."""

    report: Float8ConversionReport | None
    filter_note: str | None

    def convert(self, model: nn.Module, time_linears: bool = True) -> Float8ConversionReport | None: ...
    def tp_styles(self) -> TPStyles: ...
    def gathered_in_float8(self) -> set[str]: ...
    def post_optimizer_step(self, model: nn.Module, weight_amaxes: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None: ...
    def arm_health(self, model: nn.Module, step: int, device: torch.device) -> None: ...
    def read_health(self) -> HealthReport: ...
    def advice(self, device: torch.device, dp_degree: int, tp_degree: int) -> list[str]: ...
    def run_name_precision(self, param_dtype: str) -> str: ...
    def plan_precision(self, param_dtype: str) -> str: ...
    def describe(self, params: str) -> str: ...
    def summary_lines(self) -> list[str]: ...


def seam_class(f8: Float8TrainingConfig) -> type[Float8Rules]:
    return IMPLEMENTATIONS[f8.impl] if f8.enabled else NoFloat8Training


def float8_memory(f8: Float8TrainingConfig, single_rank_fast_path: bool = False) -> Float8Memory:
    """What the memory estimate counts of float8 for `[float8]`, before any seam is built."""
    return seam_class(f8).memory(f8, single_rank_fast_path)


def build_seam(f8: Float8TrainingConfig, run: Float8RunContext, timer: Timer | None = None) -> Float8Seam:
    """The run's float8 seam; `timer` (tests) times filter = "auto"'s shapes with ours."""
    if f8.enabled and f8.impl == "ours":
        return OursFloat8Training(f8, run, timer)
    return seam_class(f8)(f8, run)
