"""The compute dtype of the parameters, fitted to the device (`training.mixed_precision_param`).

bf16 halves memory traffic and runs at full speed on GPUs and on CPUs with bf16
instructions (AVX512-BF16, AMX). A CPU without them emulates bf16 matmuls, which then
run one to two orders of magnitude slower than float32 (how much depends on the CPU), so
`auto` picks float32 there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The dtypes a config names (mixed_precision_param/reduce, checkpoint.export_dtype), as torch's.
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Where the slowdown was measured: the factor differs from one CPU to the next.
NON_NATIVE_BF16_MEASURED = "docs/benchmarks.md, section 'CPU without native bf16'"


def cpu_bf16_support() -> tuple[bool, str]:
    """(whether this CPU computes bf16 natively, the CPU capability torch runs with)."""
    capability = torch.backends.cpu.get_cpu_capability()
    # ATen's vectorised kernels only use bf16 instructions in their AVX512 build.
    native = capability == "AVX512" and (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    )
    return native, capability


@dataclass(frozen=True)
class ParamPrecision:
    dtype: str
    reason: str
    warning: str | None = None


def resolve_param_precision(requested: str, device_type: str) -> ParamPrecision:
    """`auto` becomes bfloat16 or float32; an explicit slow choice comes with a warning."""
    if device_type != "cpu":
        if requested == "auto":
            return ParamPrecision("bfloat16", f"auto: bf16 on {device_type.upper()}")
        return ParamPrecision(requested, "set in the config")
    native, capability = cpu_bf16_support()
    if requested == "auto":
        if native:
            return ParamPrecision("bfloat16", f"auto: this CPU computes bf16 natively ({capability})")
        return ParamPrecision(
            "float32", f"auto: this CPU ({capability}) has no native bf16, where float32 is much faster "
            f"({NON_NATIVE_BF16_MEASURED})"
        )
    warning = None
    if requested == "bfloat16" and not native:
        warning = (
            f"training.mixed_precision_param = 'bfloat16' on a CPU without native bf16 ({capability}): "
            f"bf16 matmuls are emulated and run many times slower than float32 ({NON_NATIVE_BF16_MEASURED}); "
            "'auto' picks float32"
        )
    return ParamPrecision(requested, "set in the config", warning)
