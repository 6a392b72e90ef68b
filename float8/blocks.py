"""Block-scaled casts (one scale per tile of a 2-D operand) and what their scales mean.

An operand as its GEMM reads it is 2-D, (rows, summed), row-major. A `Cast` with
`block=(br, bc)` gives each tile of br rows x bc summed values one scale, from that tile's amax
(floored at EPS, so an all-zero tile gets a large finite scale, never inf or NaN). The scales
are (ceil(rows / br), ceil(summed / bc)), fp32, in this logical layout; the GEMM (float8/gemm.py)
arranges them as its kernel wants. A tile that runs past the tensor's end takes the amax of the
values it holds: zero padding adds nothing to an amax.

These are the reference casts; float8/kernels/blocks.py writes the same bytes from one read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from float8.scaling import _fused_in_eager, amax_to_scale, cast_with_scale


def _tiles(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x (m, k) zero-padded to whole tiles, as (m / br, br, k / bc, bc)."""
    (m, k), (br, bc) = x.shape, block
    pad_m, pad_k = -m % br, -k % bc
    if pad_m or pad_k:
        x = F.pad(x, (0, pad_k, 0, pad_m))
    return x.reshape(x.shape[0] // br, br, x.shape[1] // bc, bc)


def _cast_tiles(x: torch.Tensor, block: tuple[int, int], scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    m, k = x.shape
    tiles = _tiles(x, block)
    data = cast_with_scale(tiles, scale[:, None, :, None], float8_dtype).reshape(tiles.shape[0] * tiles.shape[1], -1)
    return data if data.shape == (m, k) else data[:m, :k].contiguous()


def _cast_blockwise(
    x: torch.Tensor, block: tuple[int, int], float8_dtype: torch.dtype, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    # amax over the tile's two dims, each a plain reduction (abs then amax: one pass when compiled).
    amax = torch.amax(_tiles(x, block).abs(), dim=(1, 3))
    scale = amax_to_scale(amax, float8_dtype, pow2)
    return _cast_tiles(x, block, scale, float8_dtype), scale


@_fused_in_eager
def cast_blockwise(
    x: torch.Tensor, block: tuple[int, int], float8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (m, k) cast with one scale per (br x bc) tile: (float8 data (m, k), scales (m / br, k / bc))."""
    return _cast_blockwise(x, block, float8_dtype, pow2)


@_fused_in_eager
def cast_blockwise_t(
    x: torch.Tensor, block: tuple[int, int], float8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """x.T (k, m), row-major, cast with one scale per (br x bc) tile of x.T: the operand of a GEMM
    that sums over x's dim 0."""
    return _cast_blockwise(x.t(), block, float8_dtype, pow2)


@_fused_in_eager
def cast_blocks_with_scale(
    x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], float8_dtype: torch.dtype
) -> torch.Tensor:
    """x (m, k) cast with known per-tile scales (m / br, k / bc): a weight recast for backward,
    or an FSDP shard cast where it lives."""
    return _cast_tiles(x, block, scale, float8_dtype)


def kernel_block(block: tuple[int, int]) -> bool:
    """Whether float8/kernels/blocks.py casts `block`: 1 x B tiles or B x B blocks, B a power of two >= 16."""
    b = block[1]
    return block[0] in (1, b) and b >= 16 and b & (b - 1) == 0


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """Per-tile scales repeated to one per element of a (shape) operand."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]


def block_dequantize(data: torch.Tensor, inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The fp32 values float8 `data` with per-tile inverse scales `inv` stand for: what a
    block-scaled GEMM multiplies (each product of a float8 value and a power-of-two inverse is exact)."""
    (m, k), tiles = data.shape, _tiles(data.to(torch.float32), block)
    values = (tiles * inv[:, None, :, None]).reshape(tiles.shape[0] * tiles.shape[1], -1)
    return values if values.shape == (m, k) else values[:m, :k]
