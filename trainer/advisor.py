"""Startup advice: settings that will be slow or pointless, each naming the setting and the fix."""

from __future__ import annotations

from typing import Any

import torch

from float8.linear import scaled_mm_supported
from float8.recipe import RECIPES
from trainer.config import Config, Float8TrainingConfig
from trainer.errors import UserError

# Below this many tokens per GPU per micro-batch the float8 GEMMs are too small to beat bf16.
MIN_FLOAT8_TOKENS = 8192


def float8_gemm_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def advise(
    cfg: Config, device: torch.device, float8_report: Any = None, dp_degree: int = 1, tp_degree: int = 1
) -> list[str]:
    """Warnings for this config on this device; raises UserError for settings that cannot run."""
    notes: list[str] = []
    f8 = cfg.float8
    if not f8.enabled:
        return notes
    recipe = RECIPES[f8.scaling]
    if device.type == "cuda" and not f8.emulate and not float8_gemm_supported(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise UserError(
            f"float8.enabled needs float8 GEMMs (compute capability >= 8.9: H100/H200/L40/RTX 4090); "
            f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}. Set float8.emulate = true to test, "
            "or float8.enabled = false"
        )
    if device.type == "cpu" and not f8.emulate and not scaled_mm_supported(recipe.rowwise_gemms, "cpu"):
        raise UserError(
            f"float8.scaling = '{f8.scaling}' needs row-wise scaled float8 GEMMs, which torch "
            f"{torch.__version__} does not run on CPU (torch >= 2.13 does); set float8.emulate = true to test here"
        )
    if f8.emulate:
        notes.append("float8.emulate = true: float8 rounding with high-precision GEMMs, slower than bf16; for testing only")
    if cfg.compile.mode == "none":
        notes.append(
            "float8.enabled with compile.mode = 'none': eager float8 runs its casts as separate kernels and "
            "gains little or nothing over bf16 (docs/benchmarks.md, table 'Full LLaMA-2-7B, FSDP2 on 2 H200s'); "
            "set compile.mode = 'block'"
        )
    tokens = cfg.training.batch_size * cfg.training.seq_len // max(tp_degree, 1)
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
    not_filtered = [(fqn, why) for fqn, why in skipped if not any(s in fqn for s in f8.filter_fqns)]
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


def _first_four(names: list[str]) -> str:
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return ", ".join(names[:4]) + more
