"""FSDP2 float8 all-gather of block-scaled weights: where to shard, and the shards' scales.

A weight scaled per (br x bc) block (the blockwise recipe's 128x128) needs no amax all-reduce:
each FSDP shard casts its own blocks where it lives, provided every shard holds whole blocks.
FSDP2 shards dim 0 in chunks of ceil(rows / ranks) rows; where those do not fall on block edges
(LLaMA-2-7B's w1/w3, 11008 rows over 8 ranks: 1,376 is not a multiple of 128), the weight is
sharded on dim 1 instead (FSDP2's `shard_placement_fn`, which needs equal shards), and a layout
where neither dim fits is refused in one line.

The gathered float8 bytes go through FSDP's own all-gather; the block scales, 1/16384 of them,
are all-gathered beside it: once per step for every weight of a mesh (after the optimizer step,
`precompute_float8_scales_for_fsdp`), or per weight at its all-gather without that call. They
travel as the all-gather's metadata, so FSDP's copy-out (whose dim-1 chunk-cat takes only
outputs of the parameter's shape) sees the bytes alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from float8.recipe import Cast


@dataclass(frozen=True)
class BlockSharding:
    """A block-scaled weight under FSDP2: its cast, the dim FSDP shards and over how many ranks,
    and the (TP-local) shape before sharding."""

    cast: Cast
    dim: int
    ranks: int
    shape: tuple[int, int]

    @property
    def chunk(self) -> int:
        """Rows (dim 0) or columns (dim 1) per rank, the last rank's padded as FSDP pads it."""
        return -(-self.shape[self.dim] // self.ranks)

    def local_scale_shape(self) -> tuple[int, int]:
        """Every rank's scales, padded to the same shape (a short last shard's with ones)."""
        br, bc = self.cast.block
        blocks = [-(-self.shape[0] // br), -(-self.shape[1] // bc)]
        blocks[self.dim] = -(-self.chunk // (br, bc)[self.dim])
        return blocks[0], blocks[1]


def block_shard_dim(shape: Sequence[int], block: tuple[int, int], ranks: int) -> int:
    """0 when FSDP2's dim-0 chunks of `shape` over `ranks` hold whole blocks, else 1 when dim 1
    splits evenly into whole blocks; raises a one-line ValueError when neither does."""
    rows, cols = shape
    chunk = -(-rows // ranks)
    if ranks == 1 or chunk % block[0] == 0:
        return 0
    if cols % (ranks * block[1]) == 0:
        return 1
    raise ValueError(
        f"float8 blockwise FSDP all-gather: a {rows}x{cols} weight over {ranks} ranks splits into whole "
        f"{block[0]}x{block[1]} blocks on neither dim ({chunk} rows or {cols / ranks:g} columns per rank); "
        "keep it in high precision (filter_fqns), turn fsdp_float8_all_gather off, or use another number of ranks"
    )


def fsdp_shard_placement(ranks: int) -> Callable[[torch.nn.Parameter], Shard | None]:
    """FSDP2's `shard_placement_fn` over `ranks` data-parallel ranks: block-scaled float8 weights
    sharded where every shard holds whole blocks (`block_shard_dim`), FSDP's default for the rest.
    The trainer's FSDP asks each parameter's tensor for `fsdp_shard_dim(ranks)` itself."""

    def placement(param: torch.nn.Parameter) -> Shard | None:
        inner = param._local_tensor if isinstance(param, DTensor) else param
        choose = getattr(inner, "fsdp_shard_dim", None)
        return None if choose is None else Shard(choose(ranks))

    return placement


def _padded(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    pad_rows, pad_cols = shape[0] - scale.shape[0], shape[1] - scale.shape[1]
    return F.pad(scale, (0, pad_cols, 0, pad_rows), value=1.0) if pad_rows or pad_cols else scale


@torch.no_grad()
def gather_block_scales(
    scales: Sequence[torch.Tensor], shardings: Sequence[BlockSharding], group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """Each weight's whole block scales from every rank's `scales` of its own shard, in one
    all-gather over `group` for all of them (every rank passes the same weights in one order)."""
    shapes = [s.local_scale_shape() for s in shardings]
    local = torch.cat([_padded(t, shape).reshape(-1) for t, shape in zip(scales, shapes)])
    ranks = shardings[0].ranks if shardings else 1
    if ranks > 1:
        everyone = local.new_empty(ranks * local.numel())
        dist.all_gather_into_tensor(everyone, local, group=group)
        local = everyone
    rows = local.view(ranks, -1).split([a * b for a, b in shapes], dim=1)
    whole = []
    for part, shape, sharding in zip(rows, shapes, shardings):
        full = torch.cat(part.reshape(ranks, *shape).unbind(), dim=sharding.dim)
        br, bc = sharding.cast.block
        whole.append(full[: -(-sharding.shape[0] // br), : -(-sharding.shape[1] // bc)].contiguous())
    return whole
