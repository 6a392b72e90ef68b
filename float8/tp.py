"""Float8-aware tensor-parallel styles: activation all-gathers move float8 bytes.

Drop-in replacements for torch's ColwiseParallel / RowwiseParallel /
PrepareModuleInput (same constructor arguments) for Megatron-style TP with
sequence parallelism:

* sequence-sharded activations entering a module (PrepareFloat8ModuleInput) or a
  colwise linear are cast to e4m3 with one global scale *before* the all-gather;
  their gradient goes back by a high-precision reduce-scatter;
* the output of a rowwise linear is reduce-scattered in high precision (it is a
  sum, which float8 cannot carry); its gradient is all-gathered as e5m2.

The gathered float8 values are dequantized to the activation dtype; the float8
linears that consume them re-cast them to exactly the same float8 values, and
under torch.compile the dequantize and re-cast fuse away.

A gathered activation is handed to the colwise float8 linears as a plain local
tensor, not a replicated DTensor: each linear returns its input gradient as this
rank's partial sum (see Float8Linear), and the gather's backward reduce-scatters the
sum of them. Wrapping it in a DTensor would need `DTensor.from_local(...,
grad_placements=...)`, which torch 2.11 lacks; without that argument the DTensor's
backward all-reduces the partial sums before the reduce-scatter adds them up again.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from float8.linear import Float8Linear
from float8.scaling import E4M3, E5M2, amax_to_scale, cast_with_scale, from_float8

# The *_single names replace the *_tensor ones in newer torch; both gather/scatter dim 0.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter_dim0 = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _float8_all_gather(x: torch.Tensor, mesh: DeviceMesh, dim: int, float8_dtype: torch.dtype) -> torch.Tensor:
    """All-gather `x` along `dim` as float8 with one scale shared by all ranks; returns x's dtype."""
    amax = funcol.all_reduce(x.abs().max().float(), "max", mesh)
    scale = amax_to_scale(amax, float8_dtype)
    # uint8 carries the same bytes through backends without float8 support (gloo).
    data = cast_with_scale(x, scale, float8_dtype).view(torch.uint8)
    gathered = funcol.wait_tensor(_all_gather(data, 0, mesh))
    if dim != 0:
        gathered = torch.cat(gathered.chunk(mesh.size(), dim=0), dim=dim)
    return from_float8(gathered.view(float8_dtype), scale, x.dtype)


def _reduce_scatter(g: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    if dim != 0:
        g = torch.cat(g.chunk(mesh.size(), dim=dim), dim=0)
    return funcol.wait_tensor(_reduce_scatter_dim0(g.contiguous(), "sum", 0, mesh))


class _AllGatherFloat8(torch.autograd.Function):
    """Forward: e4m3 all-gather of the local shard. Backward: reduce-scatter of the grad."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
        ctx.mesh, ctx.dim = mesh, dim
        return _float8_all_gather(x.contiguous(), mesh, dim, E4M3)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _reduce_scatter(g, ctx.mesh, ctx.dim), None, None


class _ReduceScatterFloat8GradAllGather(torch.autograd.Function):
    """Forward: reduce-scatter of partial sums. Backward: e5m2 all-gather of the grad."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
        ctx.mesh, ctx.dim = mesh, dim
        return _reduce_scatter(x, mesh, dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _float8_all_gather(g.contiguous(), ctx.mesh, ctx.dim, E5M2), None, None


def _shard_dim(p: Placement | None, ndim: int) -> int | None:
    return p.dim % ndim if isinstance(p, Shard) else None


def _gather_local(x: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> torch.Tensor:
    """Sequence-sharded activation (local tensor or DTensor) -> full local tensor, via float8."""
    local = x.to_local() if isinstance(x, DTensor) else x
    dim = _shard_dim(x.placements[0] if isinstance(x, DTensor) else layout, x.ndim)
    return _AllGatherFloat8.apply(local, mesh, dim)


def _needs_float8_gather(x: Any, layout: Placement | None, desired: Placement | None) -> bool:
    if not isinstance(x, torch.Tensor) or desired is None or not desired.is_replicate():
        return False
    current = x.placements[0] if isinstance(x, DTensor) else layout
    return isinstance(current, Shard)


class Float8ColwiseParallel(ColwiseParallel):
    """ColwiseParallel whose sharded input, if any, is all-gathered in float8.

    A replicated input given as a plain tensor must be a float8-gathered activation
    (from PrepareFloat8ModuleInput with `use_local_output=True`): the linear returns its
    gradient as this rank's partial sum, which that gather's backward reduce-scatters.
    """

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        if isinstance(mod, Float8Linear):
            if _needs_float8_gather(x, input_layouts[0], desired_input_layouts[0]):
                return _gather_local(x, device_mesh, input_layouts[0])
            if not isinstance(x, DTensor) and input_layouts[0].is_replicate():
                return x
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)


class Float8RowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose sequence-sharded output gets its gradient all-gathered in float8."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        dim = _shard_dim(output_layouts[0], outputs.ndim)
        if not (isinstance(mod, Float8Linear) and dim is not None and outputs.placements[0].is_partial()):
            return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        # The local output is this rank's partial sum; its gradient is the full (replicated) one.
        local = outputs.to_local(grad_placements=(Replicate(),))
        out = _ReduceScatterFloat8GradAllGather.apply(local, device_mesh, dim)
        if use_local_output:
            return out
        return DTensor.from_local(out, device_mesh, (Shard(dim),), run_check=False)


class PrepareFloat8ModuleInput(PrepareModuleInput):
    """PrepareModuleInput that all-gathers sharded-to-replicated tensor inputs in float8.

    The gathered inputs are local tensors meant for Float8ColwiseParallel linears, so
    `use_local_output` must be True. Non-tensor inputs (None layouts) pass through
    untouched, as with PrepareModuleInput.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.use_local_output:
            raise ValueError("PrepareFloat8ModuleInput hands its consumers local tensors: pass use_local_output=True")

    def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):
        if input_layout is not None and _needs_float8_gather(input, input_layout, desired_layout):
            return _gather_local(input, mesh, input_layout)
        return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)


__all__ = ["Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput"]
