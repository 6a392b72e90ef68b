"""FSDP2's gradient reduction at a data-parallel degree of 1, without the copy it does not need.

With one rank FSDP2 skips the collective but still copies the packed gradients (its reduce-scatter
input) into a second buffer of the same size and hands out views of the copy as the sharded
gradients: 8 more bytes moved per parameter. The output of a reduce-scatter of one rank *is* its
input, so `SingleRankReduceScatter` gives FSDP the input's buffer as its output; FSDP's copy is
then `x.copy_(x)`, which does nothing, and the gradients are views of the input. (The packing
itself, a flat concatenation at one rank, is trainer/distributed/gradient_packing.py's, as at
any rank count.) tests/trainer/distributed/test_single_rank_reduce.py checks the gradients
bitwise against FSDP's own reduction on every supported torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter


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
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(SingleRankReduceScatter())
