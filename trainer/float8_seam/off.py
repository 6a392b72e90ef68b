"""`[float8] enabled = false`: the seam with every hook doing nothing, so the trainer calls them unconditionally."""

from __future__ import annotations

import torch

from trainer.config import Float8TrainingConfig
from trainer.distributed.memory_plan import Float8Memory
from trainer.float8_seam.rules import Float8Rules, Float8RunContext

_SHORT_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}


class NoFloat8Training(Float8Rules):
    """Float8 off: high-precision linears, no float8 advice, the parameter dtype as the precision."""

    def __init__(self, f8: Float8TrainingConfig, run: Float8RunContext) -> None:
        super().__init__(f8, run)
        self.recipe_name = None

    @classmethod
    def memory(cls, f8: Float8TrainingConfig, single_rank_fast_path: bool = False) -> Float8Memory:
        return Float8Memory()

    def run_name_precision(self, param_dtype: str) -> str:
        return _SHORT_DTYPES[param_dtype]

    def plan_precision(self, param_dtype: str) -> str:
        return param_dtype

    def describe(self, params: str) -> str:
        return params

    def advice(self, device: torch.device, dp_degree: int, tp_degree: int) -> list[str]:
        return []
