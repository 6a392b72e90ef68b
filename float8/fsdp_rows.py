"""FSDP2 float8 all-gather of row-scaled weights (the rowwise recipes): each shard's two casts and their scales.

Rowwise reads the weight in two GEMMs, each with one power-of-two scale per slice along the dim
it sums over: per row in the output GEMM (over "in"), per column in grad_input's (over "out").
FSDP2 shards dim 0, so a shard holds whole rows: their amaxes are its own, while a column's spans
every shard, one all-reduce (max) of K values. Each shard then casts itself both ways, the
column-scaled copy straight into the transposed layout grad_input reads, into one buffer that FSDP
all-gathers (2 bytes a parameter, as many as a bf16 all-gather, and no cast of the weight in the
step; one all-gather input, as FSDP2's own one-rank path takes no more). The
whole weight's row scales are all-gathered beside them and travel, with the column scales, as the
all-gather's metadata: once per step for every weight of a mesh (after the optimizer step, one
all-reduce and one all-gather for all of them), or per weight at its all-gather without that call.

Shards must be equal (rows a multiple of the ranks), as the gathered casts' unpacking and the row
amaxes' all-gather assume; a weight whose rows are not is refused in one line. At one rank the
casts are used where they lie; at several, each is copied out of the ranks' buffers once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from float8.operands import eager_backend, uses_kernels
from float8.recipe import Cast
from float8.scaling import amax_to_scale, cast_with_scale


class RowScales(NamedTuple):
    """A row-scaled weight shard's amaxes (its own rows', every shard's columns') and the scales its GEMMs take."""

    row_amax: torch.Tensor  # (n,) this shard's rows
    col_amax: torch.Tensor  # (K,) over every shard
    rows: torch.Tensor  # (N, 1): every row of the whole weight
    cols: torch.Tensor  # (K, 1)


def check_even_rows(rows: int, ranks: int) -> None:
    """One-line ValueError unless `rows` split into `ranks` equal shards."""
    if rows % ranks:
        raise ValueError(
            f"float8 rowwise FSDP all-gather: {rows} rows over {ranks} ranks are not equal shards; use a number of "
            "ranks that divides every float8 weight's rows, keep this one in high precision (filter_fqns), or turn "
            "fsdp_float8_all_gather off"
        )


def _kernels(shard: torch.Tensor) -> Any:
    """float8/kernels/cast.py where the eager casts of `shard`'s device run there, else None."""
    if not uses_kernels(shard, eager_backend(shard.device.type, "auto")):
        return None
    from float8.kernels import cast

    return cast


@torch.no_grad()
def row_scales(shards: Sequence[torch.Tensor], cast: Cast, group: dist.ProcessGroup | None, ranks: int) -> list[RowScales]:
    """Each shard's `RowScales`: one all-reduce of every shard's column amaxes and one all-gather of
    their row amaxes over `group` for all of them (every rank passes the same weights in one order).
    The amaxes share one buffer and each scale is computed once for all: a step's host time is
    one kernel launch per shard here."""
    rows_of, cols_of = [s.shape[0] for s in shards], [s.shape[1] for s in shards]
    rows, cols = torch.zeros(sum(rows_of) + sum(cols_of), device=shards[0].device).split([sum(rows_of), sum(cols_of)])
    row_amaxes, col_amaxes = rows.split(rows_of), cols.split(cols_of)
    for shard, row_amax, col_amax in zip(shards, row_amaxes, col_amaxes):
        kernels = _kernels(shard)
        if kernels is not None:
            kernels.rowwise_amaxes(shard, out=(row_amax, col_amax))
        else:
            magnitude = shard.abs().float()
            row_amax.copy_(magnitude.amax(dim=1))
            col_amax.copy_(magnitude.amax(dim=0))
    if ranks > 1:
        dist.all_reduce(cols, op=dist.ReduceOp.MAX, group=group)
        everyone = rows.new_empty(ranks * rows.numel())
        dist.all_gather_into_tensor(everyone, rows, group=group)
        rows = everyone
    row_scales_ = amax_to_scale(rows.view(ranks, -1), cast.dtype, cast.pow2).split(rows_of, dim=1)
    col_scales = amax_to_scale(cols, cast.dtype, cast.pow2)[:, None].split(cols_of)
    return [RowScales(row_amax, col_amax, row_scale.reshape(-1, 1), col_scale)
            for row_amax, col_amax, row_scale, col_scale in zip(row_amaxes, col_amaxes, row_scales_, col_scales)]


def _split(buffer: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols_t = buffer.view(2, n * k).unbind()
    return rows.view(n, k), cols_t.view(k, n)


def cast_shard(shard: torch.Tensor, scales: RowScales, cast: Cast, out: torch.Tensor | None = None) -> torch.Tensor:
    """One flat buffer holding the shard cast per row, (n, K), then per column into the transposed
    layout, (K, n), with the scales of `scales`' amaxes; `out` (such a buffer) is rewritten if given."""
    n, k = shard.shape
    buffer = torch.empty(2 * n * k, dtype=cast.dtype, device=shard.device) if out is None else out
    rows, cols_t = _split(buffer, n, k)
    kernels = _kernels(shard)
    if kernels is not None:
        kernels.cast_rowwise_with_amaxes(shard, cast.dtype, cast.pow2, scales.row_amax, scales.col_amax, (rows, cols_t))
        return buffer
    rows.copy_(cast_with_scale(shard, amax_to_scale(scales.row_amax, cast.dtype, cast.pow2)[:, None], cast.dtype))
    cols_t.copy_(cast_with_scale(shard, scales.cols.t(), cast.dtype).t())
    return buffer


def gathered_casts(gathered: torch.Tensor, ranks: int, n: int, k: int,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole weight's casts, per row (N, K) and per column transposed (K, N), from FSDP's all-gather
    of every rank's `cast_shard` buffer: views at one rank, else copies (into `out` if given)."""
    if ranks == 1:
        return _split(gathered, n, k)
    pieces = gathered.view(ranks, 2, n * k)
    rows = pieces[:, 0]
    cols = pieces[:, 1].view(ranks, k, n).permute(1, 0, 2)
    if out is None:
        return rows.reshape(ranks * n, k), cols.reshape(k, ranks * n)
    # The backward's re-gather refills what the forward saved, with the same bytes, as FSDP's copy-out does.
    with torch.autograd._unsafe_preserve_version_counter(out[0]), torch.autograd._unsafe_preserve_version_counter(out[1]):
        out[0].view(ranks, n * k).copy_(rows)
        out[1].view(k, ranks, n).copy_(cols)
    return out


def precompute_row_scales(mesh: Any, shard_dim: int, weights: list, cast_weights: bool) -> None:
    """Row-scaled weights of one mesh (DTensors over Float8TrainingWeight shards): their `RowScales`
    over the FSDP dim `shard_dim`, and with `cast_weights` both casts of each shard, kept (in place
    from the second step on: a single-rank unshard keeps that storage as the weight's bytes)."""
    ranks = mesh.size(shard_dim)
    locals_ = [w._local_tensor for w in weights]
    if mesh.ndim == shard_dim + 1:  # no TP dim after it: the DTensor's rows are the unsharded weight's
        for w in weights:
            check_even_rows(w.shape[0], ranks)
    scales = row_scales([local._tensor for local in locals_], locals_[0]._cast, mesh.get_group(shard_dim), ranks)
    for local, scale in zip(locals_, scales):
        local._precomputed_scale = scale
        kept = local._float8_shard if cast_weights else None
        local._float8_shard = cast_shard(local._tensor, scale, local._cast, out=kept) if cast_weights else None
