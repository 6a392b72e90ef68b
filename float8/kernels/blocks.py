"""Triton kernels for the block-scaled casts (float8/blocks.py): float8 values and per-tile scales
in the layouts cuBLAS's block-scaled GEMMs read, both layouts from one read.

One program per B x B tile of a 2-D (M, K) tensor (B = 128 for DeepSeek-V3's recipe):

    1 x B tiles   per row of the tile, its amax over the B summed values: the row-major operand
                  (M, K) with scales (M, K / B) stored column by column (strides (1, M)); per
                  column, its amax over the tile's B rows: the transposed operand (K, M) with
                  scales (K, M / B), strides (1, K). Every tile lies inside one program, so one
                  launch with no atomics and no amax pass.
    B x B blocks  one amax per tile: the row-major operand with scales (M / B, K / B), and/or the
                  transposed one with (K / B, M / B), each a view of its first columns of a buffer
                  whose rows are padded to a multiple of 4 (what cuBLAS's B x B operand takes, see
                  float8/gemm.py); or, with the scales given, the values alone (a weight recast
                  for backward).

Scales, inverses and float8 values are those of the reference casts, computed as float8/kernels/cast.py
computes them (the same helpers), so bitwise on a GPU; under TRITON_INTERPRET=1 all but the float8
rounding (the interpreter's own).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from float8.blocks import kernel_block
from float8.kernels.cast import _TRITON_DTYPES, _abs_bits, _check_2d, _scale, _to_float8


@triton.jit
def _blocks_kernel(
    x_ptr, out_ptr, out_t_ptr, scale_ptr, inv_ptr, scale_t_ptr, inv_t_ptr, M, K, s_m, s_k, t_k, t_m,
    SQUARE: tl.constexpr, SCALE_GIVEN: tl.constexpr, WRITE: tl.constexpr, WRITE_T: tl.constexpr,
    DTYPE: tl.constexpr, FMAX: tl.constexpr, POW2: tl.constexpr, EXACT: tl.constexpr, B: tl.constexpr,
):
    """Scale (i, j) of the row-major operand lives at i * s_m + j * s_k, of the transposed one at
    i * t_k + j * t_m (row, column of that operand's scales)."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm = pid_m.to(tl.int64) * B + tl.arange(0, B)
    rk = pid_k.to(tl.int64) * B + tl.arange(0, B)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    if SQUARE:
        if SCALE_GIVEN:
            scale = tl.load(scale_ptr + pid_m * s_m + pid_k * s_k)
        else:
            scale = _scale(tl.max(tl.max(_abs_bits(x), axis=1), axis=0), FMAX, POW2, EXACT)
            inv = tl.math.div_rn(1.0, scale)
            if WRITE:
                tl.store(scale_ptr + pid_m * s_m + pid_k * s_k, scale)
                tl.store(inv_ptr + pid_m * s_m + pid_k * s_k, inv)
            if WRITE_T:
                tl.store(scale_t_ptr + pid_k * t_k + pid_m * t_m, scale)
                tl.store(inv_t_ptr + pid_k * t_k + pid_m * t_m, inv)
        y = _to_float8(x, scale, FMAX, DTYPE)
        if WRITE:
            tl.store(out_ptr + rm[:, None] * K + rk[None, :], y, mask=mask)
        if WRITE_T:
            tl.store(out_t_ptr + rk[:, None] * M + rm[None, :], tl.trans(y), mask=tl.trans(mask))
    else:
        bits = _abs_bits(x)
        if WRITE:
            row_scale = _scale(tl.max(bits, axis=1), FMAX, POW2, EXACT)
            tl.store(out_ptr + rm[:, None] * K + rk[None, :], _to_float8(x, row_scale[:, None], FMAX, DTYPE), mask=mask)
            tl.store(scale_ptr + rm * s_m + pid_k * s_k, row_scale, mask=rm < M)
            tl.store(inv_ptr + rm * s_m + pid_k * s_k, tl.math.div_rn(1.0, row_scale), mask=rm < M)
        if WRITE_T:
            col_scale = _scale(tl.max(bits, axis=0), FMAX, POW2, EXACT)
            y = tl.trans(_to_float8(x, col_scale[None, :], FMAX, DTYPE))
            tl.store(out_t_ptr + rk[:, None] * M + rm[None, :], y, mask=tl.trans(mask))
            tl.store(scale_t_ptr + rk * t_k + pid_m * t_m, col_scale, mask=rk < K)
            tl.store(inv_t_ptr + rk * t_k + pid_m * t_m, tl.math.div_rn(1.0, col_scale), mask=rk < K)


def _column_first(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    return torch.empty(cols, rows, dtype=torch.float32, device=device).t()


def _padded_rows(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """(rows, cols) as the first columns of a (rows, cols rounded up to 4) buffer."""
    return torch.empty(rows, -(-cols // 4) * 4, dtype=torch.float32, device=device)[:, :cols]


def cast_blockwise_layouts(
    x: torch.Tensor, block: tuple[int, int], float8_dtype: torch.dtype, pow2: bool = True, *,
    scale: torch.Tensor | None = None, rowmajor: bool = True, transposed: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """x cast per tile of `block` row-major and/or (summing over x's dim 0) transposed: (data,
    data_t, scales, inverses, scales of data_t, their inverses), None for a layout not asked for.
    `scale`: B x B blocks' known scales (M / B, K / B), any strides; then only the data come back."""
    m, k = _check_2d(x)
    if not kernel_block(block):
        raise ValueError(f"the block cast kernels take 1 x B or B x B tiles, B a power of two >= 16, got {block}")
    b, square = block[1], block[0] == block[1]
    if scale is not None and not square:
        raise ValueError("known scales are for B x B blocks only")
    mb, kb = -(-m // b), -(-k // b)
    data = torch.empty(m, k, dtype=float8_dtype, device=x.device) if rowmajor else None
    data_t = torch.empty(k, m, dtype=float8_dtype, device=x.device) if transposed else None
    if scale is not None:
        scales = (scale, None, None, None)
    elif square:
        scales = (*(_padded_rows(mb, kb, x.device) for _ in range(2)), *(_padded_rows(kb, mb, x.device) for _ in range(2)))
    else:
        scales = (*(_column_first(m, kb, x.device) for _ in range(2)), *(_column_first(k, mb, x.device) for _ in range(2)))
    if not rowmajor and scale is None:
        scales = (None, None, *scales[2:])
    if not transposed:
        scales = (*scales[:2], None, None)
    s_m, s_k = scales[0].stride() if scales[0] is not None else (0, 0)
    t_k, t_m = scales[2].stride() if scales[2] is not None else (0, 0)
    if x.numel():
        _blocks_kernel[(mb, kb)](
            x, data, data_t, *scales, m, k, s_m, s_k, t_k, t_m, SQUARE=square, SCALE_GIVEN=scale is not None,
            WRITE=rowmajor, WRITE_T=transposed, DTYPE=_TRITON_DTYPES[float8_dtype], FMAX=torch.finfo(float8_dtype).max,
            POW2=pow2, EXACT=x.is_cuda, B=b, num_warps=8,
        )
    if scale is not None:
        return data, data_t, None, None, None, None
    return data, data_t, *scales
