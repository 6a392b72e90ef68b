"""FSDP2's gradient packing before each reduce-scatter, as one foreach copy of its chunks (`parallelism.gradient_packing`).

Before a reduce-scatter over N ranks FSDP2 packs a group's gradients, cast to the reduce dtype, into one
buffer of N rows: row r holds every gradient's r-th dim-0 chunk (ceil(dim0 / N) rows of it, the last
chunks zero-padded). It does that with `torch._chunk_cat`, whose CUDA version builds per-chunk metadata
on the host at every call and runs below memory bandwidth: 11.5 ms of a 16-layer LLaMA-2-7B float8 step
as rank 0 of 8 (1.7 TB/s; docs/benchmarks.md), and at one rank 11.4 ms of device time and 22.6 ms of
host time. `pack_gradients` writes the same bytes with one `_foreach_copy_` of every gradient's chunks
into their places in the buffer's rows (contiguous 1-D pairs, which the foreach kernel takes in a few fused launches) and one
`_foreach_zero_` for the padding, without host-side metadata. tests/trainer/distributed/
test_gradient_packing.py checks it byte for byte against chunk_cat over shapes, dtypes and rank counts.

FSDP2 calls its module-level `foreach_reduce_scatter_copy_in` by name, and has no per-module hook for
it, so `use_gradient_packing` replaces that function for the process; "chunk_cat" puts FSDP's back. The
name is private and changes between releases: "copies" is applied only on the torch versions it was
tested with (`choose_gradient_packing`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_collectives

from trainer.config.schema import GradientPacking
from trainer.distributed.single_rank_fast_path import TESTED_TORCH_TEXT, tested_torch

# FSDP2's own packing, as imported: what "chunk_cat" puts back.
_FSDP_PACKING = getattr(_fsdp_collectives, "foreach_reduce_scatter_copy_in", None)


def chunk_numel(shape: Sequence[int], world_size: int) -> int:
    """Elements of one rank's chunk of a gradient of `shape` in the packed buffer: ceil(dim0 / world_size)
    rows of it, padded; the buffer holds `world_size` times the sum over the group's gradients."""
    dim0 = shape[0] if shape else 1
    return -(-dim0 // world_size) * (math.prod(shape) // dim0) if dim0 else 0


def pack_gradients(unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor, world_size: int) -> None:
    """`torch._chunk_cat(unsharded_grads, 0, world_size, out=reduce_scatter_input.view(world_size, -1))`'s bytes.

    Each gradient's chunks go in as contiguous 1-D pairs (the chunk, its place in a row), so that one
    `_foreach_copy_` takes them all in its fused kernel: a copy into a strided 2-D view would fall back
    to one kernel per gradient, indexing every element through its strides.
    """
    rows = reduce_scatter_input.view(world_size, -1)
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    padding: list[torch.Tensor] = []
    offset = 0
    for grad in unsharded_grads:
        width = chunk_numel(grad.shape, world_size)
        if not width:
            continue
        block, flat = rows[:, offset:offset + width], grad.reshape(-1)
        offset += width
        whole = grad.numel() // width  # chunks filled by the gradient; the next one partly, the rest not at all
        targets += block[:whole].unbind(0)
        sources += flat[:whole * width].view(whole, width).unbind(0)
        part = grad.numel() - whole * width
        if part:
            targets.append(block[whole, :part])
            sources.append(flat[whole * width:])
            padding.append(block[whole, part:])
        padding += block[whole + (part > 0):].unbind(0)
    torch._foreach_copy_(targets, sources)
    if padding:
        torch._foreach_zero_(padding)


def choose_gradient_packing(choice: GradientPacking, torch_version: str = torch.__version__) -> tuple[GradientPacking, str | None]:
    """The packing a run uses for `choice`, and what the startup summary says when it is not the one asked for."""
    if choice == "copies" and not tested_torch(torch_version):
        return "chunk_cat", f"gradients packed by FSDP2's chunk_cat (the copies were tested on torch {TESTED_TORCH_TEXT}, not {torch_version})"
    return choice, None


def use_gradient_packing(packing: GradientPacking) -> None:
    """Make every FSDP2 reduction in this process pack its gradients with `packing`."""
    if _FSDP_PACKING is not None:  # a torch without the name packs its own way, untouched
        _fsdp_collectives.foreach_reduce_scatter_copy_in = pack_gradients if packing == "copies" else _FSDP_PACKING
