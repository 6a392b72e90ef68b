"""Float8Linear: nn.Linear whose three GEMMs run in float8 via torch._scaled_mm."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from float8 import scaling as _scaling
from float8.config import Float8Config
from float8.fsdp import Float8GatheredWeight, Float8TrainingWeight, plain_weight
from float8.scaling import (
    E4M3,
    E5M2,
    cast_colwise_t,
    cast_rowwise,
    cast_tensorwise,
    cast_tensorwise_t,
)


def _scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    rowwise: bool,
    emulate: bool,
    fast_accum: bool = False,
) -> torch.Tensor:
    """a @ b for float8 `a` (row-major) and `b` (column-major), undoing their scales.

    Scales are the multipliers the casts applied; `_scaled_mm` wants their inverses.
    """
    a_inv, b_inv = a_scale.reciprocal(), b_scale.reciprocal()
    # cuBLAS rowwise-scaled float8 GEMMs only write bf16.
    gemm_dtype = torch.bfloat16 if rowwise else out_dtype
    if emulate:
        out = torch.mm(a.to(torch.float32), b.to(torch.float32)) * a_inv * b_inv
    else:
        out = torch._scaled_mm(
            a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=gemm_dtype, use_fast_accum=fast_accum
        )
    return out.to(gemm_dtype).to(out_dtype)


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


def _pad_inner(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad the contraction dim (tokens, for the weight gradient) to a multiple of 16.

    cuBLAS float8 GEMMs need it; zero rows add nothing to the product.
    """
    pad = -a.shape[1] % 16
    if pad == 0:
        return a, b
    # float8 has no pad kernel on every backend; the same zero bytes as uint8 do.
    a = F.pad(a.view(torch.uint8), (0, pad)).view(a.dtype)
    b = F.pad(b.t().view(torch.uint8), (0, pad)).view(b.dtype).t()
    return a, b


class _Float8Matmul(torch.autograd.Function):
    """out = x @ w.T with x (M, K), w (N, K); backward grad_x = g @ w, grad_w = g.T @ x.

    Every GEMM gets its first operand row-major and its second column-major, as
    cuBLAS float8 GEMMs require. Saved for backward: float8 copies of x (1 byte per
    element instead of 2) where the scaling allows, and w itself, which is a
    parameter (kept anyway, and freed/re-gathered by FSDP) rather than a float8
    copy that would hold 1 byte per parameter of every layer until backward.

    Under activation checkpointing the casts are recomputed with the rest of the block
    (selective AC keeps the GEMM outputs and amaxes); compiled under torch 2.11, only a
    checkpoint with a `context_fn` tags this function's ops for recompute (see
    trainer/parallelize.py `_full_ac_context` and docs/float8.md).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, scaling: str, emulate: bool) -> torch.Tensor:
        ctx.scaling, ctx.emulate = scaling, emulate
        ctx.fused = fused = _scaling.compile_casts_in_eager(x) and not torch.compiler.is_compiling()
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        ctx.x_shape = x_shape = x.shape
        x = x.reshape(-1, x_shape[-1])
        # Casts keep their input's strides; the GEMM needs x row-major with no row gaps.
        x = x.contiguous()
        if scaling == "tensorwise":
            x_f8, x_s = cast_tensorwise(x, E4M3, fused=fused)
            if isinstance(w, Float8GatheredWeight):
                # FSDP already all-gathered the weight in float8 with its scale.
                w_f8, w_s = w._data, w._scale
                ctx.gathered = True
                ctx.save_for_backward(x_f8, x_s, w_f8, w_s)
            else:
                w_f8, w_s = cast_tensorwise(w, E4M3, fused=fused)
                ctx.gathered = False
                ctx.save_for_backward(x_f8, x_s, w, w_s)
            out = _scaled_mm(x_f8, w_f8.t(), x_s, w_s, x.dtype, False, emulate, fast_accum=True)
            return out.reshape(*x_shape[:-1], out.shape[-1])

        x_f8, x_s = cast_rowwise(x, -1, E4M3, fused=fused)
        w_f8, w_s = cast_rowwise(w, -1, E4M3, fused=fused)
        out = _scaled_mm(x_f8, w_f8.t(), x_s, w_s.t(), x.dtype, True, emulate, fast_accum=True)
        if scaling == "rowwise":
            # Keep x already cast for the weight gradient (scales along tokens), 1 byte
            # per element, instead of the 2-byte x and a second cast in backward.
            xt_f8, xt_s = cast_colwise_t(x, E4M3, fused=fused)
            ctx.save_for_backward(xt_f8, xt_s, w)
        else:
            ctx.save_for_backward(x, w)
        return out.reshape(*x_shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        # Both gradients always, never ctx.needs_input_grad: torch 2.11's dynamo traces it
        # as all False inside compiled regions (zero gradients), and autograd drops a
        # gradient nobody asked for anyway.
        scaling, emulate = ctx.scaling, ctx.emulate
        g = g.reshape(-1, g.shape[-1]).contiguous()
        if scaling == "tensorwise":
            x_f8, x_s, w_saved, w_s = ctx.saved_tensors
            g_f8, g_s = cast_tensorwise(g, E5M2, fused=ctx.fused)
            if ctx.gathered:
                w_t = w_saved.t().contiguous()
            else:
                w_t = cast_tensorwise_t(w_saved, w_s, E4M3, fused=ctx.fused)
            grad_x = _scaled_mm(g_f8, w_t.t(), g_s, w_s, ctx.x_dtype, False, emulate)
            a, b = _pad_inner(g_f8.t().contiguous(), x_f8.t().contiguous().t())
            grad_w = _scaled_mm(a, b, g_s, x_s, ctx.w_dtype, False, emulate)
            return grad_x.reshape(ctx.x_shape), grad_w, None, None

        g_f8, g_s = cast_rowwise(g, -1, E4M3, fused=ctx.fused)
        wt_f8, wt_s = cast_colwise_t(ctx.saved_tensors[-1], E4M3, fused=ctx.fused)
        grad_x = _scaled_mm(g_f8, wt_f8.t(), g_s, wt_s.t(), ctx.x_dtype, True, emulate)
        if scaling == "rowwise":
            xt_f8, xt_s, _ = ctx.saved_tensors
            gt_f8, gt_s = cast_colwise_t(g, E4M3, fused=ctx.fused)
            a, b = _pad_inner(gt_f8, xt_f8.t())
            grad_w = _scaled_mm(a, b, gt_s, xt_s.t(), ctx.w_dtype, True, emulate)
        else:
            x, _ = ctx.saved_tensors
            grad_w = torch.mm(g.t(), x.to(g.dtype)).to(ctx.w_dtype)
        return grad_x.reshape(ctx.x_shape), grad_w, None, None


def float8_mm(x: torch.Tensor, w: torch.Tensor, config: Float8Config) -> torch.Tensor:
    """x (..., K) @ w.T for local (non-DTensor) tensors, in float8; output dtype = x dtype.

    Under autocast, x is cast to the autocast dtype and w goes straight from its
    stored precision to float8 (no intermediate bf16 rounding).
    """
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        x = x.to(torch.get_autocast_dtype(device_type))
    # No autocast context and no reshapes around apply(): under torch 2.11's dynamo
    # either made the compiled backward return zero gradients.
    return _Float8Matmul.apply(x, w, config.scaling, config.emulate)


def _plain_weight_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
    # Checkpoints hold ordinary tensors/DTensors, loadable without this package.
    key = prefix + "weight"
    state_dict[key] = plain_weight(state_dict[key])


def _norm_dim(p, ndim: int) -> int | None:
    return p.dim % ndim if isinstance(p, Shard) else None


class Float8Linear(nn.Linear):
    """A drop-in nn.Linear (same parameters and state dict) whose GEMMs run in float8.

    DTensor (tensor-parallel) weights are handled here, at the module boundary: the
    float8 math runs on local shards with local scales, which is exact for the
    shardings TP uses because every rank's GEMM is self-contained. A plain-tensor input
    to a column-sharded weight is taken as this rank's copy of a replicated input, and
    its gradient is returned as this rank's partial sum for the caller to reduce (the
    float8 TP styles in float8/tp.py do, with a reduce-scatter).
    """

    def __init__(self, *args, config: Float8Config | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.config = config or Float8Config()

    @classmethod
    def from_float(cls, linear: nn.Linear, config: Float8Config | None = None) -> Float8Linear:
        """Wrap `linear`'s own parameters (no copy, works on meta) in a Float8Linear."""
        config = config or Float8Config()
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        if config.fsdp_float8_all_gather:
            new.weight = nn.Parameter(
                Float8TrainingWeight(linear.weight.data), requires_grad=linear.weight.requires_grad
            )
            new._register_state_dict_hook(_plain_weight_in_state_dict)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor) or isinstance(x, DTensor):
            return self._forward_dtensor(x)
        out = float8_mm(x, self.weight, self.config)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def _forward_dtensor(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not isinstance(w, DTensor):
            raise NotImplementedError("Float8Linear: DTensor input needs a DTensor weight")
        mesh = w.device_mesh
        if mesh.ndim != 1:
            raise NotImplementedError(f"Float8Linear: weight on a {mesh.ndim}-D mesh (only 1-D TP)")
        wp, ndim = w.placements[0], x.ndim
        if _norm_dim(wp, 2) == 0 and not isinstance(x, DTensor):
            # This rank's copy of a replicated input (a float8 TP gather): its gradient
            # leaves as this rank's partial sum, which the caller reduces.
            return self._finish_dtensor(float8_mm(x, w.to_local(), self.config), mesh, Shard(ndim - 1), None)
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        xp = x.placements[0]
        if _norm_dim(wp, 2) == 0:
            # Colwise: replicated input, output sharded on features; grad_x is a partial sum.
            if not xp.is_replicate():
                x = x.redistribute(placements=(Replicate(),))
            x_local = x.to_local(grad_placements=(Partial(),))
            out_p = Shard(ndim - 1)
        elif _norm_dim(wp, 2) == 1:
            # Rowwise: input sharded on features, output a partial sum.
            if _norm_dim(xp, ndim) != ndim - 1:
                x = x.redistribute(placements=(Shard(ndim - 1),))
            x_local = x.to_local()
            out_p = Partial()
        elif wp.is_replicate():
            if xp.is_partial() or _norm_dim(xp, ndim) == ndim - 1:
                x = x.redistribute(placements=(Replicate(),))
                xp = x.placements[0]
            x_local = x.to_local()
            out_p = xp
        else:
            raise NotImplementedError(f"Float8Linear: weight placement {wp}")
        # A replicated weight (or bias) used with a sharded input gets partial-sum grads.
        grad_p = (Partial(),) if wp.is_replicate() and not xp.is_replicate() else None
        out = float8_mm(x_local, w.to_local(grad_placements=grad_p), self.config)
        return self._finish_dtensor(out, mesh, out_p, grad_p)

    def _finish_dtensor(self, out: torch.Tensor, mesh, out_p, grad_p) -> DTensor:
        """The local GEMM output as a DTensor, with the bias added in the matching layout."""
        bias = self.bias
        if bias is not None and not out_p.is_partial():
            b = bias.to_local(grad_placements=grad_p) if isinstance(bias, DTensor) else bias
            out = out + b.to(out.dtype)
        out = DTensor.from_local(out, mesh, (out_p,), run_check=False)
        if bias is not None and out_p.is_partial():
            out = out + bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scaling={self.config.scaling}" + (
            ", emulate=True" if self.config.emulate else ""
        )
