"""FSDP2 float8 all-gather of Float8Linear weights (tensorwise scaling; blockwise: float8/fsdp_blocks.py).

Lifecycle of a weight with `fsdp_float8_all_gather=True`::

    Float8Linear.weight = Parameter(Float8TrainingWeight(hp))        # convert
    fully_shard -> DTensor(local=Float8TrainingWeight(hp shard))     # what the optimizer steps
    after each optimizer step (precompute_float8_scales_for_fsdp):
                              every scale from one amax all-reduce; with cast_weights=True
                              also each shard cast to e4m3 with it, kept on the weight
                              (written in place from the second step on)
    every all-gather (forward, and backward's re-gather):
        fsdp_pre_all_gather   the kept e4m3 shard, else the shard cast here with the
                              precomputed scale (else one amax all-reduce here), handed
                              to FSDP as uint8 (gloo has no float8)
        fsdp_post_all_gather  wrap the gathered bytes and the scale in a Float8GatheredWeight
                              (at one rank the trainer may make the kept shard itself
                              those bytes, read through `fsdp_all_gather_input_is_kept`:
                              no copy)
    Float8Linear forward uses that data and scale directly: no cast of the weight.

A weight scaled per block (`Float8TrainingWeight(hp, cast=...)`) skips the amax all-reduce: each
shard casts its own blocks, FSDP gathers the bytes, and the blocks' scales are all-gathered
beside them (float8/fsdp_blocks.py says where such a weight is sharded and how).

A weight of a recipe that casts it per row in the step (rowwise), at one FSDP rank
(`Float8TrainingWeight(hp, as_stored=True)`, `Float8Config.fsdp_unshard_as_stored`): the unshard
hands the shard itself, fp32, as a `StoredWeight` standing for its bf16 copy, and Float8Linear's
casts round it to bf16 as they read it (the copy's bytes). With an unshard that keeps its input (the
trainer's one-GPU fast path) no copy is made at all: 12 bytes a parameter a step that rowwise
spent building bf16 weights from the fp32 shards. The unshard also hands the amaxes of the weight's
rows and columns (read once after the optimizer step by `precompute_float8_scales_for_fsdp`, else at
the unshard), so each of its two casts reads it once.

The two subclasses unwrap to plain tensors for every other op, so optimizers,
initialisation, `to_empty` and state dicts see ordinary high-precision values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from float8.fsdp_blocks import BlockSharding, block_shard_dim, gather_block_scales
from float8.gathered import Float8GatheredWeight, StoredWeight
from float8.operands import amax_rows_and_columns, cast_weight_with_scale, eager_backend, operand
from float8.recipe import Cast
from float8.scaling import E4M3, amax_to_scale

# Ops that must keep the wrapper so FSDP's sharding, padding, copies and
# `to_empty` produce Float8TrainingWeight shards; all other ops return plain tensors.
_PRESERVE = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.alias.default,
}


def _amax(t: torch.Tensor) -> torch.Tensor:
    # An FSDP shard can be empty (more ranks than rows); max() of nothing is an error.
    return t.abs().max().float() if t.numel() else torch.zeros((), device=t.device)


class Float8TrainingWeight(torch.Tensor):
    """A high-precision weight (or shard) that FSDP2 all-gathers as float8."""

    _tensor: torch.Tensor
    _precomputed_scale: torch.Tensor | None
    # The shard cast with `_precomputed_scale`, set with it (cast_weights=True) after the
    # optimizer step, so the all-gathers of a step share one cast. Rewritten in place each
    # step: a single-rank unshard keeps its storage as the unsharded weight's bytes.
    _float8_shard: torch.Tensor | None
    # A block-scaled weight's cast (None: one scale per tensor), and once FSDP asked
    # `fsdp_shard_dim`, where it is sharded; both carried to every shard and view.
    _cast: Cast | None
    _sharding: BlockSharding | None
    # Unsharded as stored, no float8 all-gather (one rank only; the module docstring says why).
    _as_stored: bool
    # Such a weight's `amax_rows_and_columns`, set with the weight (after the optimizer step) for its
    # unshards until the next: None, each unshard reads the weight for them.
    _amax: torch.Tensor | None

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, precomputed_scale: torch.Tensor | None = None, cast: Cast | None = None,
                sharding: BlockSharding | None = None, as_stored: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, precomputed_scale: torch.Tensor | None = None, cast: Cast | None = None,
                 sharding: BlockSharding | None = None, as_stored: bool = False):
        self._tensor = tensor
        self._precomputed_scale = precomputed_scale
        self._float8_shard = None
        self._cast, self._sharding, self._as_stored = cast, sharding, as_stored
        self._amax = None

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func is torch.ops.aten.detach.default:
            w = args[0]
            return cls(w._tensor, w._precomputed_scale, w._cast, w._sharding, w._as_stored)
        # The block layout goes to every shard and view FSDP makes (looked up for those ops only:
        # the optimizer's ops on lists of weights pass through here too).
        first = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls)) if func in _PRESERVE else None
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if first is None:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, None, first._cast, first._sharding, first._as_stored), out)

    def __tensor_flatten__(self):
        return ["_tensor"], (self._cast, self._sharding, self._as_stored)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return Float8TrainingWeight(inner_tensors["_tensor"], None, *ctx)

    def fsdp_shard_dim(self, ranks: int) -> int:
        """The dim FSDP2 shards this (unsharded) weight on over `ranks` ranks, remembered for its
        all-gathers: 0, or for a block-scaled one the dim whose shards hold whole blocks
        (`block_shard_dim`: one-line ValueError where none does). `fsdp_shard_placement` asks it."""
        if self._cast is None:
            return 0
        dim = block_shard_dim(self.shape, self._cast.block, ranks)
        self._sharding = BlockSharding(self._cast, dim, ranks, tuple(self.shape))
        return dim

    def block_sharding(self, ranks: int, unsharded: torch.Size | None) -> BlockSharding:
        """Where this block-scaled shard sits: as `fsdp_shard_dim` chose, else FSDP's default dim 0
        of `unsharded` (None: not known, on a 2-D mesh), which must then hold whole blocks."""
        if self._sharding is not None:
            return self._sharding
        if unsharded is None or block_shard_dim(unsharded, self._cast.block, ranks) != 0:
            raise ValueError(f"float8 blockwise: a {tuple(unsharded)} weight over {ranks} ranks needs another shard dim than 0: "
                             "pass fully_shard(..., shard_placement_fn=float8.fsdp_shard_placement(ranks))")
        return BlockSharding(self._cast, 0, ranks, tuple(unsharded))

    def __repr__(self) -> str:
        return f"Float8TrainingWeight({self._tensor})"

    @property
    def wants_row_and_column_amaxes(self) -> bool:
        """Whether an optimizer that finds its weights' amaxes as it writes them (the trainer's Triton AdamW)
        should find this one's per row and per column, for `precompute_float8_scales_for_fsdp`: a weight
        unsharded as stored, whose two casts (per row, per column) read it once each with them."""
        return self._as_stored

    def read_rows_and_columns_amax(self) -> torch.Tensor:
        """The stored shard's `amax_rows_and_columns`, from one read of it."""
        return amax_rows_and_columns(self._tensor, eager_backend(self.device.type, "auto"))

    @property
    def fsdp_all_gather_input_is_kept(self) -> bool:
        """Whether `fsdp_pre_all_gather` hands on the kept float8 shard, or the shard itself (`as_stored`):
        bytes that stay valid, in the same storage, until the next optimizer step rewrites them in place."""
        return self._float8_shard is not None or self._as_stored

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size | None = None,
        outer_stride: tuple[int, ...] | None = None,
        module: nn.Module | None = None,
        mp_policy: Any = None,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        # Defaults make both FSDP call conventions work: (mesh) and
        # (mesh, outer_size, outer_stride, module, mp_policy).
        if self._as_stored:
            if mesh.size() > 1:
                raise ValueError(f"float8: weights unsharded as stored (fsdp_unshard_as_stored) need FSDP over one rank, "
                                 f"got {mesh.size()}: they would all-gather fp32")
            return (self._tensor,), (self._amax if self._amax is not None else self.read_rows_and_columns_amax(),)
        scale, data = self._precomputed_scale, self._float8_shard
        if self._cast is not None and data is None:
            sharding = self.block_sharding(mesh.size(), outer_size if mesh.ndim == 1 else None)
            data, local_scale, _ = operand(self._tensor, self._cast, eager_backend(self.device.type, "auto"))
            if scale is None:
                scale = gather_block_scales([local_scale], [sharding], mesh.get_group())[0]
        if scale is None:
            amax = _amax(self._tensor)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
            scale = amax_to_scale(amax, E4M3)
        if data is None:
            data = cast_weight_with_scale(self._tensor, scale, E4M3)
        if outer_size is not None and mesh.ndim == 1:
            # Uneven sharding: FSDP wants every rank's input at the padded shard size.
            pad_rows = -(-outer_size[0] // mesh.size()) - data.shape[0]
            if pad_rows > 0:
                data = torch.cat([data.view(torch.uint8), data.new_zeros(pad_rows, *data.shape[1:], dtype=torch.uint8)]).view(E4M3)
        # uint8: same bytes, and every backend (gloo included) can all-gather it.
        return (data.view(torch.uint8),), (scale,)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ):
        (data,) = all_gather_outputs
        if self._as_stored:
            (amax,) = metadata
            if out is None:
                return StoredWeight(data, param_dtype, amax), (data,)
            inner = out._local_tensor if isinstance(out, DTensor) else out
            inner._data, inner._amax = data, amax
            return None
        (scale,) = metadata
        if out is not None:
            # Later all-gathers refill the same storage in place; only the scale is new. A
            # single-rank unshard that switches between copying the bytes and using the kept
            # shard itself hands over other storage: the weight then reads that.
            inner = out._local_tensor if isinstance(out, DTensor) else out
            inner._scale = scale
            if data.data_ptr() != inner._data.data_ptr():
                inner._data = data.view(E4M3).view(inner._data.shape)
            return None
        data = data.view(E4M3)
        return Float8GatheredWeight(data, scale, param_dtype, None if self._cast is None else self._cast.block), (data,)


def plain_weight(t: torch.Tensor) -> torch.Tensor:
    """`t` with any Float8TrainingWeight wrapper removed (inside DTensors too)."""
    if isinstance(t, DTensor) and isinstance(t._local_tensor, Float8TrainingWeight):
        return DTensor.from_local(
            t._local_tensor._tensor, t.device_mesh, t.placements, run_check=False,
            shape=t.shape, stride=t.stride(),
        )
    if isinstance(t, Float8TrainingWeight):
        return t._tensor
    return t


@torch.no_grad()
def precompute_float8_scales_for_fsdp(model: nn.Module, cast_weights: bool = False,
                                      amaxes: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Compute the float8 scales of all FSDP-sharded float8 weights with one all-reduce.

    Call after every `optimizer.step()` when `fsdp_float8_all_gather` is on; the next
    all-gathers then skip their per-weight amax all-reduce. With `cast_weights`, each
    shard is also cast to float8 with its new scale here, and every all-gather until the
    next call (forward, and backward's re-gather) hands FSDP those bytes: one cast per
    step instead of one per all-gather, for 1 byte per sharded parameter kept meanwhile.
    The weights must not change between this call and those all-gathers. `amaxes`: shards' max |value|
    already known, by parameter (0-dim fp32; from the optimizer step that wrote them): no amax pass.

    Weights unsharded as stored (`fsdp_unshard_as_stored`) get the amaxes of their rows and columns,
    which each cast of them until the next call takes instead of reading the weight for them (without
    this call every unshard reads it once more for them): from `amaxes` where it has them ((rows +
    columns,) fp32, `amax_rows_and_columns`'s layout), else from one read here.
    """
    weights = [p for p in model.parameters() if isinstance(p, DTensor) and isinstance(p._local_tensor, Float8TrainingWeight)]
    for w in weights:
        local = w._local_tensor
        if local._as_stored:
            given = (amaxes or {}).get(w)
            local._amax = given if given is not None and given.shape == (sum(local.shape),) else \
                local.read_rows_and_columns_amax()
    weights = [w for w in weights if not w._local_tensor._as_stored]
    if not weights:
        return
    by_mesh: dict[Any, list[DTensor]] = {}
    for w in weights:
        by_mesh.setdefault((w.device_mesh, _fsdp_shard_dim(w), w._local_tensor._cast is not None), []).append(w)
    for (mesh, shard_dim, blocked), group in by_mesh.items():
        if blocked:
            _precompute_block_scales(mesh, shard_dim, group, cast_weights)
            continue
        shards = [w._local_tensor._tensor for w in group]
        known = amaxes or {}
        unknown = [s for w, s in zip(group, shards) if s.numel() and w not in known]
        norms = iter(torch._foreach_norm(unknown, ord=math.inf)) if unknown else iter(())
        amax = torch.stack([known[w].float() if w in known else next(norms).float() if s.numel()
                            else torch.zeros((), device=s.device) for w, s in zip(group, shards)])
        # The ranks that all-gather a weight together must share its scale: the FSDP shard dim, the
        # same group as the per-weight fallback in fsdp_pre_all_gather, so both give the same scales.
        # HSDP's replicas hold the same weights, so they compute the same scales without exchanging them.
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group(shard_dim))
        for w, shard, scale in zip(group, shards, amax_to_scale(amax, E4M3).unbind()):
            local = w._local_tensor
            local._precomputed_scale = scale
            kept = local._float8_shard if cast_weights else None
            local._float8_shard = cast_weight_with_scale(shard, scale, E4M3, out=kept) if cast_weights else None


def _fsdp_shard_dim(w: DTensor) -> int:
    """The mesh dim FSDP2 shards `w` over. fully_shard puts its dims first: (shard, *tp), or for HSDP
    (a 2-D data-parallel mesh) (replicate, shard, *tp), whose first placement is Replicate()."""
    return 1 if isinstance(w.placements[0], Replicate) else 0


def _precompute_block_scales(mesh: Any, shard_dim: int, weights: list[DTensor], cast_weights: bool) -> None:
    """Block-scaled weights: each shard casts its own blocks, one all-gather of every weight's
    scales over the FSDP dim `shard_dim` of `mesh`; with `cast_weights` the bytes are kept."""
    locals_ = [w._local_tensor for w in weights]
    backend = eager_backend(locals_[0].device.type, "auto")
    casts = [operand(local._tensor, local._cast, backend) for local in locals_]
    # Without TP (no mesh dim after the shard dim) the DTensor's shape is the unsharded weight's.
    unsharded = [w.shape if mesh.ndim == shard_dim + 1 else None for w in weights]
    shardings = [local.block_sharding(mesh.size(shard_dim), shape) for local, shape in zip(locals_, unsharded)]
    scales = gather_block_scales([c.scale for c in casts], shardings, mesh.get_group(shard_dim))
    for local, cast, scale in zip(locals_, casts, scales):
        local._precomputed_scale = scale
        kept = local._float8_shard if cast_weights else None
        # In place from the second step on: a single-rank unshard keeps this storage as the weight's bytes.
        local._float8_shard = (cast.data if kept is None else kept.copy_(cast.data)) if cast_weights else None
