"""FSDP2's gradient reduction at a data-parallel degree of 1, without the work it does not need.

With one rank FSDP2 skips the collective but still (1) packs the gradients, cast to the
reduce dtype, into a flat buffer with `torch._chunk_cat`, whose CUDA version builds its
per-block metadata on the host: about 2.8 ms of CPU per LLaMA-2-7B block in backward,
where the host already paces the GPU, and a kernel well below memory bandwidth; then (2)
copies that buffer into a second one of the same size and hands out views of the copy as
the sharded gradients (8 more bytes moved per parameter). At one rank chunk_cat is a flat
concatenation, so (1) becomes one `_foreach_copy_` into views of the buffer (the same
values: a cast is a cast), and the output of a reduce-scatter of one rank *is* its input,
so (2) gets the input's buffer as its output; FSDP's copy is then `x.copy_(x)`, which
does nothing, and the gradients are views of the input.

(1) replaces FSDP2's module-level `foreach_reduce_scatter_copy_in` (the function has no
per-module hook); the replacement copies in only into a buffer a `SingleRankReduceScatter`
allocated, so every other FSDP module in the process (of more ranks, or plain FSDP2 with the
fast path off) keeps FSDP's. tests/trainer/distributed/test_single_rank_reduce.py checks the gradients bitwise
against FSDP's own reduction on every supported torch.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_collectives
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

_FSDP_COPY_IN = _fsdp_collectives.foreach_reduce_scatter_copy_in
# The reduction inputs SingleRankReduceScatter allocated, by id (a WeakSet would compare tensors with ==).
_OWN_INPUTS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def _copy_in(unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor, world_size: int) -> None:
    if world_size != 1 or _OWN_INPUTS.get(id(reduce_scatter_input)) is not reduce_scatter_input:
        return _FSDP_COPY_IN(unsharded_grads, reduce_scatter_input, world_size)
    views = torch.split(reduce_scatter_input, [g.numel() for g in unsharded_grads])
    torch._foreach_copy_([v.view(g.shape) for v, g in zip(views, unsharded_grads)], unsharded_grads)
    return None


class SingleRankReduceScatter(ReduceScatter):
    """A reduce-scatter for a group of one: the output shares the input's memory."""

    def __init__(self) -> None:
        self._input: torch.Tensor | None = None

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(int(s) for s in size)
        pending = self._input
        if pending is not None and pending.numel() == numel and pending.dtype == dtype and pending.device == device:
            # FSDP's second allocation of a reduction: the output, the same size as the input.
            self._input = None
            return pending.view(*size)
        self._input = torch.empty(*size, dtype=dtype, device=device)
        _OWN_INPUTS[id(self._input)] = self._input
        return self._input

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        # FSDP2 does not call the collective for a group of one; a larger group would need it.
        raise RuntimeError(f"SingleRankReduceScatter used on a group of {group.size()} ranks")


def use_single_rank_reduction(model: nn.Module) -> None:
    """Give every FSDP module of `model` (data-parallel degree 1) the single-rank reduction."""
    _fsdp_collectives.foreach_reduce_scatter_copy_in = _copy_in
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(SingleRankReduceScatter())
