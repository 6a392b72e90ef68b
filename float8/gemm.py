"""The float8 GEMM itself: torch._scaled_mm on CUDA, its formula on CPU, and which recipes a device runs.

Block-scaled GEMMs (`blockwise_mm`) run `aten._scaled_mm_v2` on CUDA, never `torch._scaled_mm`:
given block scales, the latter takes unpadded weight scales and for K = 11008 (86 blocks) returns
garbage (-70 dB) without an error (torch 2.11, cuBLASLt 13.1).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from float8.blocks import block_dequantize
from float8.ops import define_op
from float8.scaling import E4M3

# The tiles cuBLAS scales by (sm_90, cuBLASLt >= 12.9): 1x128 on either operand, 128x128 blocks
# on the second; names of torch.nn.functional.ScalingType.
_CUBLAS_BLOCKS = {(1, 128): "BlockWise1x128", (128, 128): "BlockWise128x128"}


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


def blockwise_mm(
    a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
    a_block: tuple[int, int], b_block: tuple[int, int], out_dtype: torch.dtype, emulate: bool,
) -> torch.Tensor:
    """a @ b.T for float8 `a` (M, K) and `b` (N, K), both row-major with the summed dim last, each
    with per-tile inverse scales (M / a_block[0], K / a_block[1]) and (N / b_block[0], K / b_block[1]).

    Written in bf16, as cuBLAS's scaled kernels write; on CPU and with `emulate`, every float8 value
    times its tile's inverse scale in fp32 and one fp32 GEMM: what the float8 operands mean.
    """
    if emulate or a.device.type != "cuda":
        out = torch.mm(block_dequantize(a, a_inv, a_block), block_dequantize(b, b_inv, b_block).t())
    else:
        out = _cublas_blockwise_mm(a, b, a_inv, b_inv, a_block, b_block)
    return out.to(torch.bfloat16).to(out_dtype)


def _column_first(t: torch.Tensor) -> torch.Tensor:
    """t (r, c) stored column by column (strides (1, r)): cuBLAS's layout of 1x128 tile scales."""
    return t if t.stride() == (1, t.shape[0]) or (t.shape[1] == 1 and t.stride(0) == 1) else t.t().contiguous().t()


def _padded_block_scales(inv: torch.Tensor) -> torch.Tensor:
    """128x128 block scales (N / 128, K / 128) as cuBLAS takes them: (L4, N / 128) with strides
    (1, L4), L4 the K-block count rounded up to a multiple of 4 (the padding matters: without it
    K = 11008 gives wrong results). The Triton casts store them so already (a view of the first
    K / 128 of L4 columns); others are padded here."""
    n_blocks, k_blocks = inv.shape
    l4 = -(-k_blocks // 4) * 4
    if inv.stride() == (l4, 1):
        return inv.as_strided((l4, n_blocks), (1, l4))
    # contiguous first: with nothing to pad, F.pad clones and keeps a transposed view's strides (the
    # backward's weight scales), and the .t() below would then hand cuBLAS row-major scales.
    return F.pad(inv.contiguous(), (0, l4 - k_blocks)).t()


def _cublas_blockwise_mm(
    a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
    a_block: tuple[int, int], b_block: tuple[int, int],
) -> torch.Tensor:
    """`aten._scaled_mm_v2` on the layouts cuBLAS's block-scaled GEMMs take (sm_90): A row-major,
    B column-major, M a multiple of 4 and K of 128 (zero rows and columns added here, sliced off),
    fp32 scales, no fast accumulation. `F.scaled_mm` would do the same, but torch.compile(fullgraph=True)
    cannot trace it; the aten op compiles (called through `_blockwise_scaled_mm`, below)."""
    from torch.nn.functional import ScalingType

    if a_block != (1, 128) or b_block not in _CUBLAS_BLOCKS or a.dtype != E4M3 or b.dtype != E4M3:
        raise ValueError(f"cuBLAS scales e4m3 1x128 tiles by 1x128 or 128x128 ones, got {a.dtype} {a_block} x {b.dtype} {b_block}")
    # Row-major, whatever layout a traced cast of a transposed operand came out in (inductor then
    # writes it so; the kernels' casts already are).
    a, b = a.contiguous(), b.contiguous()
    m, pad_m, pad_k = a.shape[0], -a.shape[0] % 4, -a.shape[1] % 128
    if pad_m or pad_k:
        # float8 has no pad kernel on every backend; the same zero bytes as uint8 do. Added tokens'
        # scales are 1; the summed dim's last tile keeps its scale (zeros change no amax).
        a = F.pad(a.view(torch.uint8), (0, pad_k, 0, pad_m)).view(a.dtype)
        b = F.pad(b.view(torch.uint8), (0, pad_k)).view(b.dtype)
        a_inv = F.pad(a_inv, (0, 0, 0, pad_m), value=1.0)
    b_scale = _padded_block_scales(b_inv) if b_block == (128, 128) else _column_first(b_inv)
    recipe = getattr(ScalingType, _CUBLAS_BLOCKS[b_block]).value
    out = _blockwise_scaled_mm(a, b.t(), _column_first(a_inv), b_scale, recipe)
    return out[:m] if pad_m else out


def _scaled_mm_v2_blocks(
    a: torch.Tensor, b_t: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, b_recipe: int
) -> torch.Tensor:
    from torch.nn.functional import ScalingType, SwizzleType

    none = SwizzleType.NO_SWIZZLE.value
    return torch.ops.aten._scaled_mm_v2.default(
        a, b_t, [a_scale], [ScalingType.BlockWise1x128.value], [none], [b_scale], [b_recipe], [none],
        None, torch.bfloat16, [], False,
    )


# The aten op as an op whose inputs inductor passes with their exact strides: an implicit fallback
# of an aten op in a compiled backward gets contiguous inputs (torch 2.11's inductor, graph.py),
# which would turn B (column-major) and the scales (column by column, padded) into what cuBLAS
# refuses or misreads. Its fake runs the aten op's own meta kernel, which checks the layouts.
_blockwise_scaled_mm = define_op(
    "blockwise_scaled_mm", _scaled_mm_v2_blocks, _scaled_mm_v2_blocks, tags=(torch.Tag.needs_exact_strides,)
)


def blockwise_gemm_supported(device: torch.device) -> bool:
    """Whether `device` runs block-scaled float8 GEMMs: CUDA on sm_90 (H100/H200) only, where
    torch's DeepSeek-style kernels are cuBLAS's; every CPU runs the emulated one."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] == 9
