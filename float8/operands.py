"""The float8 matmul's GEMM operands: a tensor cast as a recipe's `Cast` says, by one of three
eager cast backends, or one inside torch.compile.

    "triton"    float8/kernels: one read of the tensor writes both layouts a linear needs, the
                scale and its inverse come from the cast's own kernels (CUDA; on a CPU only
                under TRITON_INTERPRET=1, for tests)
    "compiled"  float8/scaling.py's casts, each compiled into a fused kernel by torch.compile
    "plain"     the same casts as eager PyTorch ops; also what an outer torch.compile traces
    "graph"     inside torch.compile where "triton" runs: casts traced as "plain" (inductor fuses
                them with their neighbours), but block-scaled ones and per-row ones that write a
                transposed layout call the kernels' ops, which write both layouts from one read
                (inductor's reductions across the rows of a transposed layout are far slower)

"triton" and "plain" give the same bytes (float8/kernels/cast.py says how exactly); "compiled"
can round a scale 1 ulp off theirs (inductor's division), so its bytes differ now and then.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from typing import NamedTuple

import torch

from float8.blocks import cast_blocks_with_scale, cast_blockwise, cast_blockwise_t, kernel_block
from float8.recipe import Cast
from float8.scaling import (
    cast_colwise_t,
    cast_colwise_t_with_amax,
    cast_rows_with_amax,
    cast_rowwise,
    cast_tensorwise,
    cast_tensorwise_t,
    cast_with_scale,
    round_to_bf16,
)

# Float8Config.eager_casts: "auto" is triton on CUDA where Triton imports (and converts to float8:
# compute capability 8.9+), else compiled on CUDA and plain elsewhere.
EAGER_CASTS = ("auto", "triton", "compiled", "plain")


class Operand(NamedTuple):
    """A GEMM operand: data with the summed dim last and row-major; scale None for a
    high-precision operand, 0-dim for one per tensor, (rows, 1) for one per row, (rows / br,
    summed / bc) for one per tile (float8/blocks.py); inv the scale's inverse where the cast
    computed it (torch._scaled_mm takes inverses), in any strides."""

    data: torch.Tensor
    scale: torch.Tensor | None = None
    inv: torch.Tensor | None = None


def _triton_runs_on(device_type: str) -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    if device_type == "cuda":
        # Triton converts to float8 on compute capability 8.9+ only (emulate=True runs elsewhere).
        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def eager_backend(device_type: str, mode: str) -> str:
    """The backend that runs casts outside torch.compile for `Float8Config.eager_casts` = mode."""
    if mode == "auto":
        if device_type == "cuda":
            return "triton" if _triton_runs_on("cuda") else "compiled"
        return "plain"
    if mode == "triton" and not _triton_runs_on(device_type):
        raise ValueError(
            f"eager_casts='triton' needs Triton and a CUDA device of compute capability 8.9+ (or TRITON_INTERPRET=1), "
            f"got {device_type}"
        )
    return mode


@torch.compiler.assume_constant_result
def graph_backend(device_type: str, mode: str) -> str:
    """The backend of casts inside torch.compile for `Float8Config.eager_casts` = mode: "graph" where
    the kernels run, else "plain". Decided once per trace, not in the graph."""
    return "graph" if eager_backend(device_type, mode) == "triton" else "plain"


def _kernels():
    from float8.kernels import cast

    return cast


def _block_kernels():
    from float8.kernels import blocks

    return blocks


def _uses_kernels(t: torch.Tensor, backend: str, spec: Cast | None = None, transposed: bool = False) -> bool:
    """Whether the kernels cast `t` (into a layout that includes the transposed one if `transposed`)."""
    blocks = spec is not None and spec.block is not None
    columns = transposed and spec is not None and spec.amax_over is not None
    # Empty tensors (an FSDP shard with no rows) take the reference path: no zero-size grids.
    return ((backend == "triton" or (backend == "graph" and (blocks or columns))) and t.ndim == 2 and t.is_contiguous()
            and t.numel() > 0 and (not blocks or kernel_block(spec.block)))


def _kernel_operands(t: torch.Tensor, spec: Cast, rowmajor: bool, transposed: bool, bf16_first: bool = False,
                     amax: torch.Tensor | None = None) -> tuple[Operand | None, Operand | None]:
    """`t` cast by the kernels as `spec` says, row-major and/or transposed (None where not asked):
    per tensor one scale serves both; per row, the transposed layout takes per-column scales.
    `bf16_first` and `amax` (per row only): as `cast_rowwise_layouts` takes them."""
    kernels = _kernels()
    if spec.block is not None:
        data, data_t, scale, inv, scale_t, inv_t = _block_kernels().cast_blockwise_layouts(
            t, spec.block, spec.dtype, spec.pow2, rowmajor=rowmajor, transposed=transposed)
    elif spec.amax_over is None:
        data, data_t, scale, inv = kernels.cast_tensorwise_layouts(
            t, spec.dtype, spec.pow2, rowmajor=rowmajor, transposed=transposed)
        scale_t, inv_t = scale, inv
    else:
        data, data_t, scale, inv, scale_t, inv_t = kernels.cast_rowwise_layouts(
            t, spec.dtype, spec.pow2, rowmajor=rowmajor, transposed=transposed, bf16_first=bf16_first, amax=amax)
    return (Operand(data, scale, inv) if rowmajor else None), (Operand(data_t, scale_t, inv_t) if transposed else None)


def _rounds_in_kernel(t: torch.Tensor, spec: Cast, backend: str, rounded_to: torch.dtype | None, transposed: bool) -> bool:
    """Whether the per-row kernels cast `t.to(rounded_to)` reading `t` itself: fp32 standing for bf16."""
    return (rounded_to == torch.bfloat16 and t.dtype == torch.float32 and spec.dtype is not None and spec.block is None
            and spec.amax_over is not None and _uses_kernels(t, backend, spec, transposed=transposed))


def rounded(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t`'s values rounded to `dtype`: fp32 to bf16 in fp32 (exact in a compiled graph too), else `t.to(dtype)`."""
    if dtype == torch.bfloat16 and t.dtype == torch.float32:
        return round_to_bf16(t)
    return t if dtype is None else t.to(dtype)


def _rounded_amax(amax: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """Amaxes of values as stored, for those values rounded to `dtype`: the amaxes rounded (rounding
    to nearest keeps the order of magnitudes), in fp32 as the casts read them."""
    return None if amax is None else rounded(amax, dtype).float()


def amax_rows_and_columns(t: torch.Tensor, backend: str) -> torch.Tensor:
    """(M + K,) fp32: the max |value| of each row of a 2-D (M, K) `t`, then of each column, from one read
    where the kernels run: what `operand` and `operand_t` take as a per-row cast's `amax`."""
    if _uses_kernels(t, backend):
        return _kernels().amax_rows_and_columns(t)
    if not t.numel():
        return torch.zeros(sum(t.shape), dtype=torch.float32, device=t.device)
    magnitude = t.abs()
    return torch.cat([magnitude.amax(1), magnitude.amax(0)]).float()


def operand(t: torch.Tensor, spec: Cast, backend: str, rounded_to: torch.dtype | None = None,
            amax: torch.Tensor | None = None) -> Operand:
    """A 2-D `t` whose last dim the GEMM sums over, cast for it. With `rounded_to`, the cast of
    `t.to(rounded_to)`: a weight read as stored (fp32) standing for the bf16 copy FSDP would have
    made; the per-row kernels round as they read, and traced the rounding fuses into the cast (`round_to_bf16`).
    `amax` (per row only): `t`'s `amax_rows_and_columns`, known already (the same amaxes rounded, since
    rounding to nearest keeps the order): the cast reads `t` once."""
    if _rounds_in_kernel(t, spec, backend, rounded_to, transposed=False):
        return _kernel_operands(t, spec, rowmajor=True, transposed=False, bf16_first=True, amax=amax)[0]
    t, amax = rounded(t, rounded_to), _rounded_amax(amax, rounded_to)
    if spec.dtype is None:
        return Operand(t)
    if _uses_kernels(t, backend, spec):
        return _kernel_operands(t, spec, rowmajor=True, transposed=False, amax=amax)[0]
    fused = backend == "compiled"
    if spec.block is not None:
        return Operand(*cast_blockwise(t, spec.block, spec.dtype, spec.pow2, fused=fused))
    if spec.amax_over is None:
        return Operand(*cast_tensorwise(t, spec.dtype, spec.pow2, fused=fused))
    if amax is not None:
        return Operand(*cast_rows_with_amax(t, amax[:t.shape[0]], spec.dtype, spec.pow2, fused=fused))
    return Operand(*cast_rowwise(t, -1, spec.dtype, spec.pow2, fused=fused))


def operand_t(t: torch.Tensor, spec: Cast, backend: str, rounded_to: torch.dtype | None = None,
              amax: torch.Tensor | None = None) -> Operand:
    """`t.T` cast for a GEMM that sums over `t`'s dim 0, written in that layout; `rounded_to` and `amax` as in
    `operand`."""
    if _rounds_in_kernel(t, spec, backend, rounded_to, transposed=True):
        return _kernel_operands(t, spec, rowmajor=False, transposed=True, bf16_first=True, amax=amax)[1]
    t, amax = rounded(t, rounded_to), _rounded_amax(amax, rounded_to)
    if spec.dtype is None:
        return Operand(t.t())
    if _uses_kernels(t, backend, spec, transposed=True):
        return _kernel_operands(t, spec, rowmajor=False, transposed=True, amax=amax)[1]
    fused = backend == "compiled"
    if spec.block is not None:
        return Operand(*cast_blockwise_t(t, spec.block, spec.dtype, spec.pow2, fused=fused))
    if spec.amax_over is None:
        data, scale = cast_tensorwise(t, spec.dtype, spec.pow2, fused=fused)
        return Operand(data.t().contiguous(), scale)
    if amax is not None:
        return Operand(*cast_colwise_t_with_amax(t, amax[t.shape[0]:], spec.dtype, spec.pow2, fused=fused))
    return Operand(*cast_colwise_t(t, spec.dtype, spec.pow2, fused=fused))


def stored_weight_operands(t: torch.Tensor, amax: torch.Tensor, row_cast: Cast, t_cast: Cast, backend: str,
                           rounded_to: torch.dtype | None) -> tuple[Operand, Operand]:
    """A weight read as stored (`t`, standing for `t.to(rounded_to)`) with its `amax_rows_and_columns`, cast for
    both its GEMMs, per row (`row_cast`) and per column transposed (`t_cast`): where the kernels run, from one
    read of `t` writing both layouts."""
    if _rounds_in_kernel(t, row_cast, backend, rounded_to, transposed=True) and _one_kernel_pass(row_cast, t_cast):
        return _kernel_operands(t, row_cast, rowmajor=True, transposed=True, bf16_first=True, amax=amax)
    return operand(t, row_cast, backend, rounded_to, amax), operand_t(t, t_cast, backend, rounded_to, amax)


def shared(spec: Cast, other: Cast) -> bool:
    """Whether a tensor is cast the same for both of its GEMMs, per tensor or in the same square
    blocks: one cast (one scale, or one per block) then serves both layouts."""
    if spec.dtype is None:
        return False
    if spec.square_blocks:
        return spec == dataclasses.replace(other, amax_over=spec.amax_over)
    return spec == other and spec.amax_over is None


def _one_kernel_pass(row_cast: Cast, t_cast: Cast) -> bool:
    """Whether the kernels cast for both GEMMs from one read: both float8 of one dtype and scale
    rounding, and both per tensor (then one scale) or both per row (along each GEMM's summed dim)."""
    return (row_cast.dtype is not None and (row_cast.dtype, row_cast.pow2, row_cast.block) == (t_cast.dtype, t_cast.pow2, t_cast.block)
            and (row_cast.amax_over is None) == (t_cast.amax_over is None))


def operands_both(t: torch.Tensor, row_cast: Cast, t_cast: Cast, backend: str) -> tuple[Operand, Operand, bool]:
    """`t` cast for a GEMM summing its last dim and `t.T` for one summing its first: (operand,
    operand of the transpose, whether the latter is still to be `transposed`).

    The kernels write both layouts from one read when both casts are float8 of one kind.
    Otherwise one per-tensor cast serves both and the transposed copy waits for the caller
    (a backward, when it needs it); else each is cast on its own.
    """
    if _uses_kernels(t, backend, row_cast, transposed=True) and _one_kernel_pass(row_cast, t_cast):
        rows, cols = _kernel_operands(t, row_cast, rowmajor=True, transposed=True)
        return rows, cols, False
    rows = operand(t, row_cast, backend)
    if t_cast.dtype is None:
        return rows, Operand(t), True
    if shared(t_cast, row_cast):
        return rows, rows, True
    return rows, operand_t(t, t_cast, backend), False


def one_buffer(t: torch.Tensor) -> torch.Tensor:
    """`t`, which inductor writes to one buffer for all the GEMMs that read it.

    Inductor inlines a traced cast into each extern kernel reading it (its own copy per GEMM) unless the
    cast reads more than `realize_reads_threshold` tensors: the transposed float8 copy of the attention
    norm's output that wq, wk and wv's weight gradients read was written three times, by a backward kernel
    whose column-major stores do not coalesce. Forcing its strides makes inductor realize it once; the bytes
    are a copy's, so no value changes. Outside torch.compile, or where torch lacks the op, `t`.
    """
    if not torch.compiler.is_compiling() or not _stride_forcing_registered():
        return t
    return torch.ops.prims.inductor_force_stride_order(t, t.stride())


@torch.compiler.assume_constant_result
def _stride_forcing_registered() -> bool:
    """Whether torch.ops.prims.inductor_force_stride_order exists: a private op, registered by importing its module
    here, in the trace that needs it (run, not traced), rather than at `import float8` (about a second)."""
    try:
        importlib.import_module("torch._inductor.inductor_prims")
    except ImportError:
        return False
    return hasattr(torch.ops.prims, "inductor_force_stride_order")


def transposed(op: Operand, backend: str) -> Operand:
    """One GEMM's operand reused by another that sums over its other dim: a per-tensor scale
    (or none) serves both, and square blocks' scales transpose with the data."""
    data, scale, inv = op
    if scale is None:
        return Operand(data.t())
    if scale.ndim == 2:
        scale, inv = scale.t(), None if inv is None else inv.t()
    if _uses_kernels(data, backend):
        return Operand(_kernels().transpose(data), scale, inv)
    return Operand(data.t().contiguous(), scale, inv)


def cast_t_with_scale(t: torch.Tensor, scale: torch.Tensor, spec: Cast, backend: str) -> torch.Tensor:
    """`t.T`, row-major, cast with a known per-tensor scale, or known scales of `spec`'s square blocks."""
    if spec.block is not None:
        if _uses_kernels(t, backend, spec):
            return _block_kernels().cast_blockwise_layouts(t, spec.block, spec.dtype, scale=scale, rowmajor=False, transposed=True)[1]
        return cast_blocks_with_scale(t, scale, spec.block, spec.dtype, fused=backend == "compiled").t().contiguous()
    if _uses_kernels(t, backend):
        return _kernels().cast_tensorwise_layouts(t, spec.dtype, scale=scale, rowmajor=False, transposed=True)[1]
    return cast_tensorwise_t(t, scale, spec.dtype, fused=backend == "compiled")


def cast_weight_with_scale(
    t: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A weight (shard) cast with its known scale, outside any compile (FSDP's pre-all-gather):
    one kernel on CUDA where Triton imports, eager ops elsewhere; written into `out` if given."""
    if _uses_kernels(t, eager_backend(t.device.type, "auto")):
        return _kernels().cast_tensorwise_layouts(t, float8_dtype, scale=scale, out=out)[0]
    data = cast_with_scale(t, scale, float8_dtype)
    return data if out is None else out.copy_(data)
