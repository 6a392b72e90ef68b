"""Amax, scales and casts to float8.

A *scale* here multiplies the high-precision tensor into the float8 range
(``x_f8 = clamp(x * scale)``); ``torch._scaled_mm`` wants the inverse, which the
GEMM callers pass. Scales are fp32 tensors, never Python numbers, so no
function here synchronises with the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# Floor for amax: all-zero tensors get a large finite scale instead of inf.
EPS = 1e-12

F = TypeVar("F", bound=Callable)


def _fused_in_eager(fn: F) -> F:
    """Run `fn` as one compiled kernel set outside torch.compile, when `fused`.

    Eager PyTorch would run abs, max, multiply, clamp and convert as separate
    full-tensor passes (plus fp32 temporaries); that is most of why eager float8
    is slower than eager bf16. Inside an outer torch.compile the plain function is
    traced and fused with its neighbours instead. Callers in a backward pass pass
    `fused` decided in the forward: torch 2.11 does not report the compiled backward
    as compiling, and calling the compiled casts there yields zero gradients.
    `fused=None` compiles on CUDA tensors outside torch.compile.

    Each cast compiles once per (float8 dtype, input dtype, layout, scale rounding): more
    variants than dynamo's default recompile limit (8 per function) may allow, see
    `raise_dynamo_recompile_limit`. This wrapper changes no global setting itself.
    """
    compiled: Callable | None = None

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, fused: bool | None = None):
        nonlocal compiled
        if fused is None:
            fused = x.device.type == "cuda" and not torch.compiler.is_compiling()
        if fused:
            if compiled is None:
                # dynamic: one kernel set serves every layer shape and token count.
                compiled = torch.compile(fn, fullgraph=True, dynamic=True)
            # Parameters and plain tensors are distinct guard types; the cast needs no autograd.
            return compiled(x.detach(), *args)
        return fn(x, *args)

    return wrapper  # type: ignore[return-value]


def raise_dynamo_recompile_limit(limit: int) -> tuple[int, int] | None:
    """Raise torch._dynamo's process-wide per-function recompile limit to at least `limit`.

    The self-compiled eager casts need a handful of variants each (see `_fused_in_eager`);
    past the limit dynamo runs the further variants unfused. Returns (old, new) when it
    changed the limit, None when it was already high enough.
    """
    old = torch._dynamo.config.recompile_limit
    if old >= limit:
        return None
    torch._dynamo.config.recompile_limit = limit
    return old, limit


def amax_to_scale(amax: torch.Tensor, float8_dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """fp32 scale mapping `amax` to the largest float8 value; `pow2` rounds it down to 2**k.

    Power-of-two scales make scaling exact (only the float8 rounding loses bits)
    and, being rounded down, can never push amax past the float8 maximum.
    """
    scale = torch.finfo(float8_dtype).max / torch.clamp(amax.to(torch.float32), min=EPS)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` rounded to the nearest bf16 (ties to even, NaN kept), still fp32: `x.to(bf16).float()`
    in integer bits, which a compiled graph keeps (inductor's fused kernels skip a bf16 round trip)."""
    bits = x.view(torch.int32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)
    return torch.where(x.isnan(), x, rounded)


def cast_with_scale(x: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """Scale in fp32, clamp to the float8 range (float8 conversion does not saturate), cast."""
    fmax = torch.finfo(float8_dtype).max
    return (x.to(torch.float32) * scale).clamp(-fmax, fmax).to(float8_dtype)


@_fused_in_eager
def cast_tensorwise(
    x: torch.Tensor, float8_dtype: torch.dtype, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One dynamic scale for the whole tensor: (float8 data, 0-dim fp32 scale)."""
    # abs().max() rather than amax(): selective activation checkpointing policies (a
    # caller's, docs/float8/background.md) key on aten.max to keep these reductions saved.
    scale = amax_to_scale(x.abs().max(), float8_dtype, pow2)
    return cast_with_scale(x, scale, float8_dtype), scale


@_fused_in_eager
def cast_tensorwise_t(x: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """Cast a 2-D tensor with a known scale straight into its transposed (row-major) layout."""
    return cast_with_scale(x, scale, float8_dtype).t().contiguous()


@_fused_in_eager
def cast_rowwise(
    x: torch.Tensor, dim: int, float8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per slice along `dim` (amax over `dim`, scale keeps the dim as 1)."""
    scale = amax_to_scale(torch.amax(x.abs(), dim=dim, keepdim=True), float8_dtype, pow2)
    return cast_with_scale(x, scale, float8_dtype), scale


@_fused_in_eager
def cast_rows_with_amax(
    x: torch.Tensor, amax: torch.Tensor, float8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cast_rowwise` of a 2-D (M, K) tensor along its last dim with the rows' amaxes (M,) known."""
    scale = amax_to_scale(amax[:, None], float8_dtype, pow2)
    return cast_with_scale(x, scale, float8_dtype), scale


@_fused_in_eager
def cast_colwise_t_with_amax(
    x: torch.Tensor, amax: torch.Tensor, float8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cast_colwise_t` of a 2-D (M, K) tensor with the columns' amaxes (K,) known."""
    # Already fused, or deliberately not: the inner cast must not decide again.
    data, scale = cast_rows_with_amax(x.t(), amax, float8_dtype, pow2, fused=False)
    return data.contiguous(), scale


@_fused_in_eager
def cast_colwise_t(
    x: torch.Tensor, float8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise cast of a 2-D (M, K) tensor along dim 0, returned transposed and row-major.

    (K, 1)-shaped scales and (K, M) data: the layout a GEMM summing over M reads.
    """
    # Already fused, or deliberately not: the inner cast must not decide again.
    data, scale = cast_rowwise(x, 0, float8_dtype, pow2, fused=False)
    return data.t().contiguous(), scale.t()


def from_float8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize: the high-precision values the float8 data stands for."""
    return (data.to(torch.float32) / scale).to(dtype)
