"""Float8Linear: nn.Linear whose three GEMMs run in float8 via torch._scaled_mm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from float8.blocks import expand_blocks
from float8.config import Float8Config
from float8.fsdp import Float8TrainingWeight, plain_weight
from float8.gathered import Float8GatheredWeight, StoredWeight
from float8.gemm import blockwise_mm, scaled_mm
from float8.health import cast_stats, float8_bytes_stats, no_stats
from float8.operands import (
    Operand,
    cast_t_with_scale,
    eager_backend,
    graph_backend,
    one_buffer,
    operand,
    operand_t,
    operands_both,
    rounded,
    shared,
    stored_weight_operands,
    transposed,
)
from float8.recipe import Cast, Float8Recipe, Gemm


def _pad_summed_dim(a: Operand, b: Operand) -> tuple[Operand, Operand]:
    """Zero-pad the summed dim to a multiple of 16: cuBLAS float8 GEMMs need it, and zeros add
    nothing to the product. Only tokens need it (conversion checks the weight's dims), and
    only the backward pads: under torch 2.11 with dynamic shapes, a shape test in the forward
    broke dynamo's tracing of this function."""
    pad = -a.data.shape[1] % 16
    if pad == 0 or a.scale is None:  # high-precision GEMMs take any size
        return a, b
    # float8 has no pad kernel on every backend; the same zero bytes as uint8 do.
    a_data, b_data = (F.pad(t.view(torch.uint8), (0, pad)).view(t.dtype) for t in (a.data, b.data))
    return a._replace(data=a_data), b._replace(data=b_data)


def _gemm(gemm: Gemm, a: Operand, b: Operand, out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """a @ b.T as `gemm` says, both operands with the summed dim last."""
    if a.scale is None or b.scale is None:
        return torch.mm(a.data, b.data.t().to(a.data.dtype)).to(out_dtype)
    a_inv = a.scale.reciprocal() if a.inv is None else a.inv
    b_inv = b.scale.reciprocal() if b.inv is None else b.inv
    if gemm.blockwise:
        return blockwise_mm(a.data, b.data, a_inv, b_inv, gemm.lhs.block, gemm.rhs.block, out_dtype, emulate)
    if gemm.rowwise:
        # Row-wise kernels take per-row scales on both operands: repeat a per-tensor one.
        a_inv = a_inv.expand(a.data.shape[0], 1) if a_inv.ndim == 0 else a_inv
        b_inv = b_inv.expand(b.data.shape[0], 1) if b_inv.ndim == 0 else b_inv
    return scaled_mm(a.data, b.data.t(), a_inv, b_inv.t(), out_dtype, gemm.rowwise, emulate, gemm.fast_accum)


class _Float8Matmul(torch.autograd.Function):
    """out = x @ w.T with x (M, K), w (N, K); backward grad_x = g @ w, grad_w = g.T @ x.

    Interprets a `Float8Recipe` (float8/recipe.py): each GEMM casts its operands as the
    recipe says. Every float8 GEMM gets its first operand row-major and its second
    column-major, as cuBLAS float8 GEMMs require. A tensor cast once per tensor the same
    way for both of its GEMMs is cast once. Saved for backward: x as its weight-gradient
    GEMM wants it, so a float8 copy (1 byte per element instead of 2) unless that GEMM is
    in high precision; and w itself, which is a parameter (kept anyway, and freed/re-gathered
    by FSDP) rather than a float8 copy that would hold 1 byte per parameter of every layer
    until backward.

    Under activation checkpointing the casts are recomputed with the rest of the block
    (selective AC keeps the GEMM outputs and amaxes); compiled under torch 2.11, only a
    checkpoint with a `context_fn` tags this function's ops for recompute (docs/float8/background.md,
    "Interplay with activation checkpointing").
    """

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, w: torch.Tensor, recipe: Float8Recipe, emulate: bool, eager_casts: str,
        health_probe: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.recipe, ctx.emulate = recipe, emulate
        # An outer torch.compile traces the casts (float8/operands.py). The backward takes the
        # forward's choice: torch 2.11 does not report the compiled backward as compiling.
        ctx.backend = backend = graph_backend(x.device.type, eager_casts) if torch.compiler.is_compiling() \
            else eager_backend(x.device.type, eager_casts)
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        ctx.x_shape = x_shape = x.shape
        # Casts keep their input's strides; the GEMM needs x row-major with no row gaps.
        x = x.reshape(-1, x_shape[-1]).contiguous()
        # x for the weight gradient: its float8 copy (1 byte per element instead of x's 2), in
        # the layout that GEMM reads or (ctx.x_transposed_later) still to be transposed.
        x_op, x_gw, ctx.x_transposed_later = operands_both(x, recipe.output.lhs, recipe.grad_weight.rhs, backend)
        ctx.gathered = isinstance(w, Float8GatheredWeight)
        # A weight unsharded as stored (fp32, with its rows' and columns' amaxes) is cast as its bf16 copy
        # would be, for both its GEMMs from one read; grad_input's layout waits for the backward (1 byte a
        # parameter; the weight's own 4 stay FSDP's, which keeps them at one rank anyway).
        ctx.stored = isinstance(w, StoredWeight)
        rounded_to = w.dtype if ctx.stored else None
        if ctx.gathered:
            # FSDP all-gathered the weight in float8 already, with its scale.
            w_op = Operand(w._data, w._scale)
        elif ctx.stored:
            w_op, w_t_op = stored_weight_operands(w._data, w._amax, recipe.output.rhs, recipe.grad_input.rhs, backend,
                                                  rounded_to)
            w = w._data
        else:
            w_op = operand(w, recipe.output.rhs, backend)
        out = _gemm(recipe.output, x_op, w_op, x.dtype, emulate)
        ctx.w_shared = shared(recipe.grad_input.rhs, recipe.output.rhs)
        # Armed for float8 health (float8/health.py): the forward casts' stats wait for backward,
        # which hands them out with the gradient cast's as the probe's gradient.
        ctx.probed = health_probe is not None
        health = (torch.stack([_stats(x, x_op, recipe.output.lhs),
                               _stats(rounded(w, rounded_to), w_op, recipe.output.rhs)]),) if ctx.probed else ()
        w_kept = (w_op.data, w_op.scale, w_op.inv) if ctx.gathered else tuple(w_t_op) if ctx.stored else \
            (w, w_op.scale, w_op.inv) if ctx.w_shared else (w, None, None)
        ctx.save_for_backward(*x_gw, *w_kept, *health)
        return out.reshape(*x_shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        # Both gradients always, never ctx.needs_input_grad: torch 2.11's dynamo traces it
        # as all False inside compiled regions (zero gradients), and autograd drops a
        # gradient nobody asked for anyway.
        recipe, backend, emulate = ctx.recipe, ctx.backend, ctx.emulate
        x_gw_data, x_gw_scale, x_gw_inv, w, w_scale, w_inv, *health = ctx.saved_tensors
        g = g.reshape(-1, g.shape[-1]).contiguous()
        g_op, g_gw, g_transposed_later = operands_both(g, recipe.grad_input.lhs, recipe.grad_weight.lhs, backend)
        if ctx.gathered:
            w_op = transposed(Operand(w, w_scale, w_inv), backend)
        elif ctx.stored:
            w_op = Operand(w, w_scale, w_inv)
        elif ctx.w_shared:
            # The forward's scale (or square blocks' scales), cast straight into the transposed layout.
            w_op = Operand(cast_t_with_scale(w, w_scale, recipe.grad_input.rhs, backend), *map(_t, (w_scale, w_inv)))
        else:
            w_op = operand_t(w, recipe.grad_input.rhs, backend)
        grad_x = _gemm(recipe.grad_input, g_op, w_op, ctx.x_dtype, emulate)

        if g_transposed_later:
            g_gw = transposed(g_gw, backend)
        x_gw = Operand(x_gw_data, x_gw_scale, x_gw_inv)
        if ctx.x_transposed_later:
            # One copy for every GEMM reading it (wq, wk and wv read one norm's output); forcing the forward's
            # row-major copy too would stop the partitioner recomputing it, and keep three transposed copies.
            x_gw = transposed(x_gw, backend)
            x_gw = x_gw._replace(data=one_buffer(x_gw.data))
        grad_w = _gemm(recipe.grad_weight, *_pad_summed_dim(g_gw, x_gw), ctx.w_dtype, emulate)
        probe_grad = torch.cat([health[0], _stats(g, g_op, recipe.grad_input.lhs)[None]]) if ctx.probed else None
        return grad_x.reshape(ctx.x_shape), grad_w, None, None, None, probe_grad


def _t(scale: torch.Tensor | None) -> torch.Tensor | None:
    """A scale for the transposed operand: per-block scales transpose, a per-tensor one stays."""
    return scale.t() if scale is not None and scale.ndim == 2 else scale


def _stats(hp: torch.Tensor, op: Operand, cast: Cast) -> torch.Tensor:
    """float8/health.py's stats of one operand's cast, from its high-precision values when there are any."""
    if op.scale is None:
        return no_stats(op.data.device)
    scale = op.scale if cast.block is None else expand_blocks(op.scale, cast.block, op.data.shape)
    if isinstance(hp, Float8GatheredWeight):
        return float8_bytes_stats(op.data, scale)
    return cast_stats(hp, op.data, scale)


def float8_mm(
    x: torch.Tensor, w: torch.Tensor, config: Float8Config, health_probe: torch.Tensor | None = None
) -> torch.Tensor:
    """x (..., K) @ w.T for local (non-DTensor) tensors, in float8; output dtype = x dtype.

    Under autocast, x is cast to the autocast dtype and w goes straight from its
    stored precision to float8 (no intermediate bf16 rounding).
    """
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        x = x.to(torch.get_autocast_dtype(device_type))
    # No autocast context and no reshapes around apply(): under torch 2.11's dynamo
    # either made the compiled backward return zero gradients.
    return _Float8Matmul.apply(x, w, config.recipe, config.emulate, config.eager_casts, health_probe)


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
        # Set by float8.health.Float8HealthMonitor on the steps it reads the casts' stats.
        self.health_probe: torch.Tensor | None = None

    @classmethod
    def from_float(cls, linear: nn.Linear, config: Float8Config | None = None) -> Float8Linear:
        """Wrap `linear`'s own parameters (no copy, works on meta) in a Float8Linear."""
        config = config or Float8Config()
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        if config.fsdp_float8_all_gather or config.fsdp_unshard_as_stored:
            new.weight = nn.Parameter(
                # A block-scaled weight's shards cast their own blocks (float8/fsdp_blocks.py).
                Float8TrainingWeight(linear.weight.data, cast=config.recipe.output.rhs if config.recipe.weight_blocks else None,
                                     as_stored=config.fsdp_unshard_as_stored),
                requires_grad=linear.weight.requires_grad
            )
            new._register_state_dict_hook(_plain_weight_in_state_dict)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor) or isinstance(x, DTensor):
            return self._forward_dtensor(x)
        out = float8_mm(x, self.weight, self.config, self.health_probe)
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
            return self._finish_dtensor(float8_mm(x, w.to_local(), self.config, self.health_probe), mesh, Shard(ndim - 1), None)
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
        out = float8_mm(x_local, w.to_local(grad_placements=grad_p), self.config, self.health_probe)
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
        return f"{super().extra_repr()}, scaling={self.config.recipe.name}" + (
            ", emulate=True" if self.config.emulate else ""
        )
