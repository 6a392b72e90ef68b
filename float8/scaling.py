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


def compile_casts_in_eager(x: torch.Tensor) -> bool:
    """Whether casts of `x` outside torch.compile run as compiled kernels (CUDA: Triton)."""
    return x.is_cuda


def _fused_in_eager(fn: F) -> F:
    """Run `fn` as one compiled kernel set on CUDA outside torch.compile.

    Eager PyTorch would run abs, max, multiply, clamp and convert as separate
    full-tensor passes (plus fp32 temporaries); that is most of why eager float8
    is slower than eager bf16. Inside an outer torch.compile the plain function is
    traced and fused with its neighbours instead. Callers in a backward pass pass
    `fused` decided in the forward: torch 2.11 does not report the compiled backward
    as compiling, and calling the compiled casts there yields zero gradients.
    """
    compiled: Callable | None = None

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, fused: bool | None = None):
        nonlocal compiled
        if fused is None:
            fused = compile_casts_in_eager(x) and not torch.compiler.is_compiling()
        if fused:
            if compiled is None:
                _allow_cast_variants()
                # dynamic: one kernel set serves every layer shape and token count.
                compiled = torch.compile(fn, fullgraph=True, dynamic=True)
            # Parameters and plain tensors are distinct guard types; the cast needs no autograd.
            return compiled(x.detach(), *args)
        return fn(x, *args)

    return wrapper  # type: ignore[return-value]


def _allow_cast_variants() -> None:
    """Each cast compiles once per (float8 dtype, input dtype, layout): a handful of variants
    that dynamo's default recompile limit (8 per function) can fall short of."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 64))


def amax_to_scale(amax: torch.Tensor, float8_dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """fp32 scale mapping `amax` to the largest float8 value; `pow2` rounds it down to 2**k.

    Power-of-two scales make scaling exact (only the float8 rounding loses bits)
    and, being rounded down, can never push amax past the float8 maximum.
    """
    scale = torch.finfo(float8_dtype).max / torch.clamp(amax.to(torch.float32), min=EPS)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def cast_with_scale(x: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """Scale in fp32, clamp to the float8 range (float8 conversion does not saturate), cast."""
    fmax = torch.finfo(float8_dtype).max
    return (x.to(torch.float32) * scale).clamp(-fmax, fmax).to(float8_dtype)


@_fused_in_eager
def cast_tensorwise(x: torch.Tensor, float8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One dynamic scale for the whole tensor: (float8 data, 0-dim fp32 scale)."""
    # abs().max() rather than amax(): selective activation checkpointing policies
    # (trainer/parallelize.py) key on aten.max to keep these reductions saved.
    scale = amax_to_scale(x.abs().max(), float8_dtype)
    return cast_with_scale(x, scale, float8_dtype), scale


@_fused_in_eager
def cast_tensorwise_t(x: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """Cast a 2-D tensor with a known scale straight into its transposed (row-major) layout."""
    return cast_with_scale(x, scale, float8_dtype).t().contiguous()


@_fused_in_eager
def cast_rowwise(
    x: torch.Tensor, dim: int, float8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-of-two scale per slice along `dim` (amax over `dim`, scale keeps the dim as 1)."""
    scale = amax_to_scale(torch.amax(x.abs(), dim=dim, keepdim=True), float8_dtype, pow2=True)
    return cast_with_scale(x, scale, float8_dtype), scale


@_fused_in_eager
def cast_colwise_t(x: torch.Tensor, float8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise cast of a 2-D tensor along dim 0, returned transposed and row-major.

    (K, 1)-shaped scales and (K, M) data: the layout the weight-gradient GEMM reads.
    """
    data, scale = cast_rowwise(x, 0, float8_dtype)
    return data.t().contiguous(), scale.t()


def to_float8(
    x: torch.Tensor, float8_dtype: torch.dtype = E4M3, rowwise: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Public cast: tensorwise, or rowwise along the last dim; returns (data, scale)."""
    if rowwise:
        return cast_rowwise(x, -1, float8_dtype)
    return cast_tensorwise(x, float8_dtype)


def from_float8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize: the high-precision values the float8 data stands for."""
    return (data.to(torch.float32) / scale).to(dtype)
