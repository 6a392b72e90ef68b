"""What FSDP2 unshards for a Float8Linear (float8/fsdp.py), as it reads it: a weight all-gathered in float8
(Float8GatheredWeight), or one handed as stored (StoredWeight)."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from float8.blocks import expand_blocks

# Views of gathered float8 data (FSDP's as_strided, Parameter's detach, compile's aliases).
_GATHERED_VIEWS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.t.default,
    torch.ops.aten.slice.Tensor,
}


def _wrapper_of(cls: type, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A `cls` wrapper with `data`'s shape, strides and device, claiming `dtype`, without autograd."""
    return torch.Tensor._make_wrapper_subclass(
        cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=dtype,
        device=data.device, requires_grad=False,
    )


class Float8GatheredWeight(torch.Tensor):
    """An all-gathered float8 weight: e4m3 data, its fp32 scale (per `block` when given), and the
    dtype it stands for.

    Float8Linear reads `_data` and `_scale` directly. Any other op sees the
    dequantized values, so the tensor still behaves like the weight it replaces.
    """

    _data: torch.Tensor
    _scale: torch.Tensor
    _block: tuple[int, int] | None

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: tuple[int, int] | None = None):
        return _wrapper_of(cls, data, dtype)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: tuple[int, int] | None = None):
        self._data = data
        self._scale = scale
        self._block = block

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        if func in _GATHERED_VIEWS:
            w = args[0]
            if w._block is not None and func is torch.ops.aten.t.default:
                return cls(w._data.t(), w._scale.t(), w.dtype, w._block)
            return cls(func(w._data, *args[1:], **kwargs), w._scale, w.dtype, w._block)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantized(), (args, kwargs))
        return func(*args, **kwargs)

    def dequantized(self) -> torch.Tensor:
        scale = self._scale if self._block is None else expand_blocks(self._scale, self._block, self._data.shape)
        return (self._data.float() / scale).to(self.dtype)

    def __tensor_flatten__(self):
        return ["_data", "_scale"], (self.dtype, self._block)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return Float8GatheredWeight(inner_tensors["_data"], inner_tensors["_scale"], *ctx)

    def __repr__(self) -> str:
        return f"Float8GatheredWeight(dtype={self.dtype}, shape={tuple(self.shape)}, scale={self._scale})"


class StoredWeight(torch.Tensor):
    """A weight as its shard is stored (fp32), standing for the `dtype` (bf16) copy FSDP2 would unshard:
    at one rank, for recipes that cast the weight in the step (rowwise), the unshard hands this instead
    of copying (float8/fsdp.py, `as_stored`), with the amax of each of its rows and columns (as stored,
    `float8.operands.amax_rows_and_columns`).

    Float8Linear casts `_data` rounded to `dtype` as it reads it, with scales from `_amax`: the bytes of
    the copy's cast, from one read each. Any other op sees `_data.to(dtype)`, and gradients flow in
    `dtype`, as for the copy.
    """

    _data: torch.Tensor
    _amax: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor):
        return _wrapper_of(cls, data, dtype)

    def __init__(self, data: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor):
        self._data = data
        self._amax = amax

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        if func in _GATHERED_VIEWS:
            w = args[0]
            view = func(w._data, *args[1:], **kwargs)
            # The amaxes hold for views of the same shape (FSDP's, compile's aliases) only.
            if view.shape == w.shape:
                return cls(view, w.dtype, w._amax)
            return view.to(w.dtype)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._data.to(t.dtype), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_amax"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return StoredWeight(inner_tensors["_data"], ctx, inner_tensors["_amax"])

    def __repr__(self) -> str:
        return f"StoredWeight(dtype={self.dtype}, stored as {self._data.dtype}, shape={tuple(self.shape)})"
