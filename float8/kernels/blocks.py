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
from float8.ops import define_op


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


def _scale_buffers(rows: int, cols: int, b: int, square: bool, device: torch.device) -> list[torch.Tensor]:
    """Dense buffers for the scales of a (rows, cols) operand's tiles and for their inverses, as
    `_scale_view` reads them: B x B blocks' in rows padded to a multiple of 4, 1 x B tiles' column by column."""
    n_cols = -(-cols // b)
    shape = (-(-rows // b), -(-n_cols // 4) * 4) if square else (n_cols, rows)
    return [torch.empty(shape, dtype=torch.float32, device=device) for _ in range(2)]


def _scale_view(buffer: torch.Tensor, cols: int, b: int, square: bool) -> torch.Tensor:
    """A `_scale_buffers` buffer as the operand's (rows / br, cols / B) scales in the layout cuBLAS
    reads (float8/gemm.py): B x B blocks' the first columns of padded rows, 1 x B tiles' strides (1, rows)."""
    return buffer[:, : -(-cols // b)] if square else buffer.t()


def _outputs(x: torch.Tensor, block: list[int], float8_dtype: torch.dtype, scaled: bool, rowmajor: bool,
             transposed: bool) -> list[torch.Tensor]:
    """The cast's outputs, dense: per layout asked for (row-major, then transposed), its float8
    data, then (unless the scales are given) the buffers of its scales and of their inverses."""
    (m, k), b, square = x.shape, block[1], block[0] == block[1]
    out = []
    for rows, cols, wanted in ((m, k, rowmajor), (k, m, transposed)):
        if wanted:
            out.append(torch.empty(rows, cols, dtype=float8_dtype, device=x.device))
            out += [] if scaled else _scale_buffers(rows, cols, b, square, x.device)
    return out


def _layouts(out: list[torch.Tensor], scaled: bool, rowmajor: bool, transposed: bool) -> list[list[torch.Tensor | None]]:
    """`_outputs`'s list as [data, scale buffer, inverse buffer] per layout, None where absent."""
    parts, n = iter(out), 1 if scaled else 3
    return [[next(parts) for _ in range(n)] + [None] * (3 - n) if wanted else [None] * 3 for wanted in (rowmajor, transposed)]


def _views(layouts: list[list[torch.Tensor | None]], m: int, k: int, b: int, square: bool) -> list[torch.Tensor | None]:
    """(data, data_t, scales, inverses, scales of data_t, their inverses) from `_layouts`."""
    (data, s, inv), (data_t, s_t, inv_t) = layouts
    s, inv, s_t, inv_t = (None if t is None else _scale_view(t, cols, b, square) for t, cols in ((s, k), (inv, k), (s_t, m), (inv_t, m)))
    return [data, data_t, s, inv, s_t, inv_t]


def _cast_blocks(
    x: torch.Tensor, scale: torch.Tensor | None, block: list[int], float8_dtype: torch.dtype, pow2: bool,
    rowmajor: bool, transposed: bool,
) -> list[torch.Tensor]:
    out = _outputs(x, block, float8_dtype, scale is not None, rowmajor, transposed)
    if not x.numel():
        return out
    (m, k), b, square = x.shape, block[1], block[0] == block[1]
    data, data_t, s, inv, s_t, inv_t = _views(_layouts(out, scale is not None, rowmajor, transposed), m, k, b, square)
    s = scale if scale is not None else s
    s_m, s_k = s.stride() if s is not None else (0, 0)
    t_k, t_m = s_t.stride() if s_t is not None else (0, 0)
    _blocks_kernel[(-(-m // b), -(-k // b))](
        x, data, data_t, s, inv, s_t, inv_t, m, k, s_m, s_k, t_k, t_m, SQUARE=square, SCALE_GIVEN=scale is not None,
        WRITE=rowmajor, WRITE_T=transposed, DTYPE=_TRITON_DTYPES[float8_dtype], FMAX=torch.finfo(float8_dtype).max,
        POW2=pow2, EXACT=x.is_cuda, B=b, num_warps=8,
    )
    return out


# The kernels as one op that torch.compile keeps whole: traced, a cast of 128-value tiles becomes
# inductor's own tile reductions, which read a transposed layout far slower than this one read
# writing both (docs/benchmarks.md, "Blockwise float8 in the trainer"). Its fake allocates the outputs.
_cast_blocks_op = define_op(
    "cast_blocks", _cast_blocks,
    lambda x, scale, block, float8_dtype, pow2, rowmajor, transposed: _outputs(
        x, block, float8_dtype, scale is not None, rowmajor, transposed),
)


def cast_blockwise_layouts(
    x: torch.Tensor, block: tuple[int, int], float8_dtype: torch.dtype, pow2: bool = True, *,
    scale: torch.Tensor | None = None, rowmajor: bool = True, transposed: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """x cast per tile of `block` row-major and/or (summing over x's dim 0) transposed: (data,
    data_t, scales, inverses, scales of data_t, their inverses), None for a layout not asked for.
    `scale`: B x B blocks' known scales (M / B, K / B), any strides; then only the data come back.
    Inside torch.compile, one op."""
    m, k = _check_2d(x)
    if not kernel_block(block):
        raise ValueError(f"the block cast kernels take 1 x B or B x B tiles, B a power of two >= 16, got {block}")
    b, square = block[1], block[0] == block[1]
    if scale is not None and not square:
        raise ValueError("known scales are for B x B blocks only")
    # Outside a compile the kernels are called straight, without the op's dispatch (~7 us of host time a call).
    cast = _cast_blocks_op if torch.compiler.is_compiling() else _cast_blocks
    out = cast(x, scale, list(block), float8_dtype, pow2, rowmajor, transposed)
    return tuple(_views(_layouts(out, scale is not None, rowmajor, transposed), m, k, b, square))
