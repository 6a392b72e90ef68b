"""Triton kernels for the eager float8 casts: amax, scale, inverse scale and both layouts.

A cast of a 2-D (M, K) tensor is two launches after a zeroed amax buffer: `_amax_*` reduces
|x| (tensorwise: one value; rowwise: per row and/or per column, by atomic max over tiles),
and `_cast_kernel` reads x once more, computes the scales from the amaxes in its prologue
(every program, so no launch in between), and writes the float8 values row-major and/or
transposed; the programs on the first row/column of tiles also write the scales and their
inverses (what torch._scaled_mm takes). A row-major cast with a given scale (a weight shard's,
after the optimizer step) is one flat stream instead, `_cast_flat_kernel`. Values are bitwise those of float8/scaling.py's
reference cast on a GPU; under TRITON_INTERPRET=1 everything but the float8 rounding itself
is (the interpreter rounds float8 its own way). The rowwise cast is an op, `float8_training::cast_rows`,
which torch.compile calls as it is rather than tracing it.

Amaxes are reduced as the int32 bits of |x|: for non-negative floats the bit order is the
value order, NaN above inf, so an integer max is exact, order-independent and keeps a NaN
the way torch's max does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from float8.ops import define_op
from float8.scaling import EPS

# Tile of the 2-D kernels, and elements per program of the flat amax and the flat cast.
BLOCK_M, BLOCK_K, AMAX_BLOCK, CAST_BLOCK = 64, 64, 8192, 4096
_TRITON_DTYPES = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}
# Kernels read module globals only as constexprs.
_EPS = tl.constexpr(EPS)


@triton.jit
def _abs_bits(x):
    return tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True)


@triton.jit
def _bf16_rounded_bits(bits):
    """fp32 bits rounded to the nearest bf16, ties to even, as torch's .to does; NaN kept. In integer
    bits, since Triton's interpreter truncates in `.to(tl.bfloat16)`."""
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, bits, (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536)


@triton.jit
def _load(ptr, mask, BF16_FIRST: tl.constexpr):
    """x as fp32; with BF16_FIRST (fp32 x) rounded to bf16 first: a weight read as stored cast as the
    bf16 copy FSDP would have made of it."""
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    if BF16_FIRST:
        x = _bf16_rounded_bits(x.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    return x


@triton.jit
def _load_amax(ptr, mask, BF16_FIRST: tl.constexpr):
    """Amax bits; with BF16_FIRST rounded to bf16 as the values they bound are: rounding to nearest is
    monotonic, so the amax of the rounded values is the rounded amax (and rounding twice is rounding once)."""
    bits = tl.load(ptr, mask=mask, other=0)
    if BF16_FIRST:
        bits = _bf16_rounded_bits(bits)
    return bits


@triton.jit
def _scale(amax_bits, FMAX: tl.constexpr, POW2: tl.constexpr, EXACT: tl.constexpr):
    """amax_to_scale: FMAX * 1/clamp(amax, EPS) (torch's float / tensor is reciprocal then
    multiply), rounded down to a power of two if POW2; a NaN amax stays NaN, as in torch.clamp."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    amax = tl.where(amax != amax, amax, tl.maximum(amax, _EPS))
    scale = tl.math.div_rn(1.0, amax) * FMAX
    if POW2:
        # CUDA's log2f/exp2f as torch calls them; the interpreter has no libdevice.
        if EXACT:
            scale = libdevice.exp2(libdevice.floor(libdevice.log2(scale)))
        else:
            scale = tl.exp2(tl.floor(tl.log2(scale)))
    return scale


@triton.jit
def _to_float8(x, scale, FMAX: tl.constexpr, DTYPE: tl.constexpr):
    """cast_with_scale: fp32 multiply, clamp to +-FMAX keeping NaN, round to float8."""
    y = x * scale
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMAX), FMAX))
    return y.to(DTYPE)


@triton.jit
def _amax_flat_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.atomic_max(amax_ptr, tl.max(_abs_bits(x), axis=0))


@triton.jit
def _padded4(n):
    """n rounded up to a multiple of 4: where `_padded` puts the next part of a buffer."""
    return (n + 3) // 4 * 4


@triton.jit
def _amax_2d_kernel(x_ptr, amax_ptr, M, K, ROWS: tl.constexpr, COLS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Per-row amaxes into amax[0:M], per-column into amax[M:M + K]."""
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rk = tl.program_id(1).to(tl.int64) * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    bits = _abs_bits(tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mask, other=0.0))
    if ROWS:
        tl.atomic_max(amax_ptr + rm, tl.max(bits, axis=1), mask=rm < M)
    if COLS:
        tl.atomic_max(amax_ptr + M + rk, tl.max(bits, axis=0), mask=rk < K)


@triton.jit
def _cast_kernel(
    x_ptr, out_ptr, out_t_ptr, amax_ptr, scales_ptr, M, K,
    ROWWISE: tl.constexpr, SCALE_GIVEN: tl.constexpr, WRITE: tl.constexpr, WRITE_T: tl.constexpr,
    DTYPE: tl.constexpr, FMAX: tl.constexpr, POW2: tl.constexpr, EXACT: tl.constexpr, BF16_FIRST: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    """x (M, K) -> out (M, K) and/or out_t (K, M). Tensorwise: one scale, given at scales[0] or from
    amax[0] (then written to scales[0], its inverse to scales[4]). Rowwise: out uses per-row scales
    (from amax[0:M]), out_t per-column ones (amax[M:M + K]), written as `_rows_parts` reads them:
    row scales, their inverses, column scales, theirs, each part starting at a multiple of 4."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rk = pid_k.to(tl.int64) * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = _load(x_ptr + rm[:, None] * K + rk[None, :], mask, BF16_FIRST)
    if ROWWISE:
        pm = _padded4(M)
        if WRITE:
            row_scale = _scale(_load_amax(amax_ptr + rm, rm < M, BF16_FIRST), FMAX, POW2, EXACT)
            tl.store(out_ptr + rm[:, None] * K + rk[None, :], _to_float8(x, row_scale[:, None], FMAX, DTYPE), mask=mask)
            if pid_k == 0:
                tl.store(scales_ptr + rm, row_scale, mask=rm < M)
                tl.store(scales_ptr + pm + rm, tl.math.div_rn(1.0, row_scale), mask=rm < M)
        if WRITE_T:
            col_scale = _scale(_load_amax(amax_ptr + M + rk, rk < K, BF16_FIRST), FMAX, POW2, EXACT)
            y = tl.trans(_to_float8(x, col_scale[None, :], FMAX, DTYPE))
            tl.store(out_t_ptr + rk[:, None] * M + rm[None, :], y, mask=tl.trans(mask))
            if pid_m == 0:
                tl.store(scales_ptr + 2 * pm + rk, col_scale, mask=rk < K)
                tl.store(scales_ptr + 2 * pm + _padded4(K) + rk, tl.math.div_rn(1.0, col_scale), mask=rk < K)
    else:
        if SCALE_GIVEN:
            scale = tl.load(scales_ptr)
        else:
            scale = _scale(tl.load(amax_ptr), FMAX, POW2, EXACT)
            if (pid_m == 0) & (pid_k == 0):
                tl.store(scales_ptr, scale)
                tl.store(scales_ptr + _padded4(1), tl.math.div_rn(1.0, scale))
        y = _to_float8(x, scale, FMAX, DTYPE)
        if WRITE:
            tl.store(out_ptr + rm[:, None] * K + rk[None, :], y, mask=mask)
        if WRITE_T:
            tl.store(out_t_ptr + rk[:, None] * M + rm[None, :], tl.trans(y), mask=tl.trans(mask))


@triton.jit
def _cast_flat_kernel(x_ptr, out_ptr, scale_ptr, n, DTYPE: tl.constexpr, FMAX: tl.constexpr, BLOCK: tl.constexpr):
    """x -> out row-major with a given scale: the weights' cast, a stream the 2-D tiles (64-byte
    float8 row segments per program) write below the memory bandwidth."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _to_float8(x, tl.load(scale_ptr), FMAX, DTYPE), mask=offs < n)


@triton.jit
def _transpose_kernel(x_ptr, out_ptr, M, K, BM: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rk = tl.program_id(1).to(tl.int64) * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mask)
    tl.store(out_ptr + rk[:, None] * M + rm[None, :], tl.trans(x), mask=tl.trans(mask))


def _check_2d(x: torch.Tensor) -> tuple[int, int]:
    if x.ndim != 2 or not x.is_contiguous():
        raise ValueError(f"float8 cast kernels take a contiguous 2-D tensor, got shape {tuple(x.shape)} strides {x.stride()}")
    return x.shape


def _grid(m: int, k: int) -> tuple[int, int]:
    return triton.cdiv(m, BLOCK_M), triton.cdiv(k, BLOCK_K)


def _padded(sizes: list[int]) -> list[int]:
    """Sizes rounded up to a multiple of 4 float32s (the kernels' `_padded4`): cuBLAS float8 GEMMs
    refuse scale pointers that are not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED)."""
    return [-(-n // 4) * 4 for n in sizes]


def _aligned_views(buffer: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Consecutive parts of `buffer` of these sizes, each starting 16-byte aligned."""
    padded = _padded(sizes)
    return [buffer[sum(padded[:i]):sum(padded[:i]) + n] for i, n in enumerate(sizes)]


def _constants(x: torch.Tensor, float8_dtype: torch.dtype, pow2: bool, bf16_first: bool = False) -> dict:
    return {
        "DTYPE": _TRITON_DTYPES[float8_dtype], "FMAX": torch.finfo(float8_dtype).max, "POW2": pow2,
        "EXACT": x.is_cuda, "BF16_FIRST": bf16_first, "BM": BLOCK_M, "BK": BLOCK_K,
    }


def cast_tensorwise_layouts(
    x: torch.Tensor, float8_dtype: torch.dtype, pow2: bool = False, *, scale: torch.Tensor | None = None,
    rowmajor: bool = True, transposed: bool = False, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """x cast with one scale (its own amax's, or `scale`): (data (M, K) or None, data.T row-major
    (K, M) or None, 0-dim scale, 0-dim inverse scale or None when the scale was given). `out`, a
    contiguous (M, K) float8 tensor, receives the row-major data instead of a new one."""
    m, k = _check_2d(x)
    if out is not None and (out.shape != (m, k) or out.dtype != float8_dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous ({m}, {k}) {float8_dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    data = (out if out is not None else torch.empty(m, k, dtype=float8_dtype, device=x.device)) if rowmajor else None
    data_t = torch.empty(k, m, dtype=float8_dtype, device=x.device) if transposed else None
    if scale is not None and rowmajor and not transposed:
        if data.numel():
            constants = _constants(x, float8_dtype, False)
            _cast_flat_kernel[(triton.cdiv(data.numel(), CAST_BLOCK),)](
                x, data, scale, data.numel(), DTYPE=constants["DTYPE"], FMAX=constants["FMAX"], BLOCK=CAST_BLOCK,
                num_warps=8,
            )
        return data, None, scale, None
    if scale is None:
        amax = torch.zeros(1, dtype=torch.int32, device=x.device)
        _amax_flat_kernel[(triton.cdiv(x.numel(), AMAX_BLOCK),)](x, amax, x.numel(), BLOCK=AMAX_BLOCK)
        scales = torch.empty(sum(_padded([1, 1])), dtype=torch.float32, device=x.device)
        scale, inv = (t[0] for t in _aligned_views(scales, [1, 1]))
    else:
        amax, scales, inv = None, scale, None
    _cast_kernel[_grid(m, k)](
        x, data, data_t, amax, scales, m, k, ROWWISE=False, SCALE_GIVEN=amax is None,
        WRITE=rowmajor, WRITE_T=transposed, **_constants(x, float8_dtype, pow2),
    )
    return data, data_t, scale, inv


def _rows_outputs(x: torch.Tensor, float8_dtype: torch.dtype, rowmajor: bool, transposed: bool) -> list[torch.Tensor]:
    """The rowwise cast's outputs: the float8 data of each layout asked for (row-major, then
    transposed), then one buffer holding the row scales, their inverses, the column scales and
    theirs (`_aligned_views`'s parts of sizes M, M, K, K)."""
    m, k = x.shape
    out = [torch.empty(m, k, dtype=float8_dtype, device=x.device)] if rowmajor else []
    out += [torch.empty(k, m, dtype=float8_dtype, device=x.device)] if transposed else []
    return [*out, torch.empty(sum(_padded([m, m, k, k])), dtype=torch.float32, device=x.device)]


def _rows_parts(out: list[torch.Tensor], m: int, k: int, rowmajor: bool, transposed: bool) -> list[torch.Tensor | None]:
    """`_rows_outputs`'s list as (data, data_t, row scales, their inverses, column scales, theirs),
    the scales 1-D, None for a layout not asked for."""
    data = out[0] if rowmajor else None
    data_t = out[int(rowmajor)] if transposed else None
    return [data, data_t, *_aligned_views(out[-1], [m, m, k, k])]


def _amax_bits(x: torch.Tensor, rows: bool, cols: bool) -> torch.Tensor:
    """(M + K,) int32: the |value| bits' max of each row of a non-empty (M, K) `x` (if `rows`), then of each
    column (if `cols`); zeros for those not asked. One buffer, indexed in the kernels: views cost host time."""
    m, k = x.shape
    amax = torch.zeros(m + k, dtype=torch.int32, device=x.device)
    _amax_2d_kernel[_grid(m, k)](x, amax, m, k, ROWS=rows, COLS=cols, BM=BLOCK_M, BK=BLOCK_K)
    return amax


def amax_rows_and_columns(x: torch.Tensor) -> torch.Tensor:
    """(M + K,) fp32: the max |value| of each row of a 2-D (M, K) `x`, then of each column, from one read:
    what `cast_rowwise_layouts` takes as `amax`."""
    m, k = _check_2d(x)
    if not x.numel():
        return torch.zeros(m + k, dtype=torch.float32, device=x.device)
    return _amax_bits(x, rows=True, cols=True).view(torch.float32)


def _cast_rows(x: torch.Tensor, float8_dtype: torch.dtype, pow2: bool, rowmajor: bool, transposed: bool,
               bf16_first: bool, amax: torch.Tensor | None) -> list[torch.Tensor]:
    out = _rows_outputs(x, float8_dtype, rowmajor, transposed)
    m, k = x.shape
    if not x.numel():
        return out
    amax = _amax_bits(x, rows=rowmajor, cols=transposed) if amax is None else amax.view(torch.int32)
    _cast_kernel[_grid(m, k)](
        x, out[0] if rowmajor else None, out[int(rowmajor)] if transposed else None, amax, out[-1], m, k,
        ROWWISE=True, SCALE_GIVEN=False, WRITE=rowmajor, WRITE_T=transposed,
        **_constants(x, float8_dtype, pow2, bf16_first),
    )
    return out


# The kernels as one op that torch.compile keeps whole: traced, a per-column amax is an inductor
# reduction across rows, fused with its producer and far slower than these two launches that
# write both layouts (docs/benchmarks.md, "Rowwise casts as the kernels' op"). Its fake allocates.
_cast_rows_op = define_op(
    "cast_rows", _cast_rows,
    lambda x, float8_dtype, pow2, rowmajor, transposed, bf16_first, amax: _rows_outputs(x, float8_dtype, rowmajor, transposed),
)


def cast_rowwise_layouts(
    x: torch.Tensor, float8_dtype: torch.dtype, pow2: bool = True, *, rowmajor: bool = True, transposed: bool = False,
    bf16_first: bool = False, amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
           torch.Tensor | None, torch.Tensor | None]:
    """x cast with one scale per row (amax over K) row-major and/or one per column (amax over M)
    transposed: (data, data_t, row scales (M, 1), their inverses, column scales (K, 1), their
    inverses), None for a layout not asked for; with `bf16_first`, the cast of `x.to(torch.bfloat16)`,
    read from `x` itself (no bf16 copy). Inside torch.compile, one op. `amax`: `x`'s amaxes already
    known, as `amax_rows_and_columns` gives them (of `x` as stored, rounded here with `bf16_first`): one
    read of `x` instead of two."""
    m, k = _check_2d(x)
    # Outside a compile the kernels are called straight, without the op's dispatch (~7 us of host time a call).
    out = (_cast_rows_op if torch.compiler.is_compiling() else _cast_rows)(x, float8_dtype, pow2, rowmajor, transposed,
                                                                           bf16_first, amax)
    data, data_t, *scales = _rows_parts(out, m, k, rowmajor, transposed)
    row_scale, row_inv, col_scale, col_inv = (t[:, None] for t in scales)
    if not rowmajor:
        row_scale = row_inv = None
    if not transposed:
        col_scale = col_inv = None
    return data, data_t, row_scale, row_inv, col_scale, col_inv


def transpose(data: torch.Tensor) -> torch.Tensor:
    """data.t().contiguous() of a 2-D float8 (or any 1-byte) tensor, at copy bandwidth."""
    m, k = _check_2d(data)
    out = torch.empty(k, m, dtype=data.dtype, device=data.device)
    if data.numel():
        _transpose_kernel[_grid(m, k)](data.view(torch.uint8), out.view(torch.uint8), m, k, BM=BLOCK_M, BK=BLOCK_K)
    return out
