"""The float8 GEMM itself: torch._scaled_mm on CUDA, its formula on CPU, and which recipes a device runs."""

from __future__ import annotations

import functools

import torch

from float8.scaling import E4M3


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_inv: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: torch.dtype,
    rowwise: bool,
    emulate: bool,
    fast_accum: bool = False,
) -> torch.Tensor:
    """a @ b for float8 `a` (row-major) and `b` (column-major), undoing their scales.

    `a_inv`, `b_inv`: the inverses of the multipliers the casts applied, as `torch._scaled_mm` takes them.
    """
    # cuBLAS rowwise-scaled float8 GEMMs only write bf16.
    gemm_dtype = torch.bfloat16 if rowwise else out_dtype
    if emulate:
        out = torch.mm(a.to(torch.float32), b.to(torch.float32)) * a_inv * b_inv
    elif a.device.type == "cpu":
        out = scaled_mm_cpu(a, b, a_inv, b_inv, gemm_dtype)
    else:
        out = torch._scaled_mm(
            a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=gemm_dtype, use_fast_accum=fast_accum
        )
    return out.to(gemm_dtype).to(out_dtype)


def scaled_mm_cpu(
    a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """torch._scaled_mm as ATen's own CPU kernel computes it: the float8 operands upcast to
    fp32 (exact) and scaled, one fp32 GEMM, the result cast to `out_dtype`.

    Called directly because on CPUs with AMX torch sends `_scaled_mm` to oneDNN, whose float8
    matmul there is its reference kernel: about 2,000x slower (a 256^3 GEMM takes 1-2 s) and
    summed in another order (tensorwise results within ~1e-5 relative; row-wise bitwise
    equal). This keeps CPU float8 the same on every CPU. Whether torch takes a recipe on CPU
    at all is still `scaled_mm_supported`'s probe of torch._scaled_mm itself.
    """
    return torch.mm(a.to(torch.float32) * a_inv, b.to(torch.float32) * b_inv).to(out_dtype)


@functools.cache
def scaled_mm_supported(rowwise: bool, device_type: str) -> bool:
    """Whether torch._scaled_mm runs this scaling granularity on this device type.

    CUDA float8 GEMMs (compute capability >= 8.9) take both. On CPU, torch 2.11 only
    takes per-tensor scales and 2.13 takes both: probed with a 16 x 16 GEMM, since the
    version alone does not say which build has which kernel.
    """
    if device_type == "cuda":
        return True
    rows = 16 if rowwise else 1
    a = torch.zeros(16, 16, device=device_type).to(E4M3)
    try:
        torch._scaled_mm(
            a, a.t(), scale_a=torch.ones(rows, 1, device=device_type),
            scale_b=torch.ones(1, rows, device=device_type), out_dtype=torch.bfloat16,
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True
