"""The communication plan: per step and per GPU, the bytes each kind of collective moves, over which mesh dim,
and whether its groups span nodes. Computed from the model, the layout and the precision; nothing is measured.

Bytes are bus bytes, what each GPU sends (and receives) in a ring, as NCCL's busbw counts them: an all-gather
or reduce-scatter of a full tensor of B bytes over n ranks moves B (n - 1) / n per GPU, an all-reduce twice that.
What a step does (trainer/step.py, trainer/distributed/parallelize.py):

- FSDP2 all-gathers every weight in forward, and in backward again every block's but the last's when
  parallelism.reshard_after_forward (the root module's weights stay gathered), once per micro-batch; float8
  linears whose weights FSDP gathers in float8 move 1 byte per parameter, the rest the parameter dtype.
- It reduce-scatters the gradients in training.mixed_precision_reduce once per step (the last micro-batch's
  backward), and under HSDP all-reduces the reduced shard across the replicas.
- With float8 weights gathered in float8, one all-reduce per step agrees their scales in the shard group
  (one fp32 per weight; block-scaled weights all-gather their per-128 x 128-block scales instead, 1/16384 of
  the weight's elements, not counted).
- TP (sequence parallel), per micro-batch and block: the attention and FFN inputs are all-gathered, the wo and
  w2 outputs reduce-scattered, in the activation dtype; backward mirrors each (an all-gather's gradient is
  reduce-scattered and the other way round); the float8 TP styles move the all-gathers (forward and backward)
  in float8, each with a 4-byte amax all-reduce. The norms' weights are replicated over TP and see a
  sequence shard each: their gradients are all-reduced per micro-batch. The embedding's output is reduce-scattered and the output
  layer's input all-gathered (mirrored in backward); with loss parallel the cross-entropy all-reduces three
  fp32 values per token, without it the full logits are all-gathered. Activation checkpointing repeats a
  recomputed block's forward collectives in backward: for `full` and every N-th block of `selective` N both
  all-gathers and the attention's reduce-scatter (the recompute stops once it has what backward saved, before
  the FFN output's reduce-scatter: torch.utils.checkpoint's early stop), for `op` the all-gathers alone (it
  saves reduce-scatter outputs). tests/trainer/distributed/test_mirror_world.py checks these bytes against
  what a step's collectives move.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from trainer.config import Layout
from trainer.distributed.activation_checkpoint import block_checkpointing
from trainer.distributed.process_group import MESH_DIMS

GB = 1e9


@dataclass(frozen=True)
class Collective:
    what: str
    dim: str  # the mesh dim whose groups it runs in
    ranks: int  # ranks per group
    bytes: float  # per GPU per step
    crosses_nodes: bool


@dataclass(frozen=True)
class StepShape:
    """What the plan needs of the run besides the model and the layout."""

    tokens: int  # per micro-batch and data-parallel rank: batch_size x seq_len
    grad_accum: int
    param_bytes: int  # the parameter (and activation) dtype's
    reduce_bytes: int
    reshard_after_forward: bool
    tp_float8: bool  # the TP styles move float8 all-gathers
    loss_parallel: bool
    ac_mode: str
    ac_option: str


def group_spans_nodes(layout: Layout, dim: str, nproc_per_node: int) -> bool:
    """Whether any group of mesh dim `dim` holds ranks of two nodes (ranks numbered replicate, shard, tp
    outermost first, consecutive ranks on one node)."""
    index = MESH_DIMS.index(dim)  # the layout's degrees are in the mesh's order
    size, stride = layout[index], 1
    for inner in layout[index + 1:]:
        stride *= inner
    for first in range(layout.world_size):
        if (first // stride) % size == 0:  # the group's lowest rank
            nodes = {(first + i * stride) // nproc_per_node for i in range(size)}
            if len(nodes) > 1:
                return True
    return False


def _ring(n: int) -> float:
    return (n - 1) / n


def _weights(model: nn.Module, layout: Layout, float8_gathered: set[str], param_bytes: int) -> tuple[float, float, int]:
    """(bytes one all-gather of every weight gathers, of the blocks' but the last, elements per TP rank):
    TP splits every weight but the norms'."""
    last_block = f"layers.{len(model.layers) - 1}."
    every = reshardable = 0.0
    elements = 0
    for name, p in model.named_parameters():
        local = p.numel() if name.endswith("norm.weight") else p.numel() // layout.tp
        width = 1 if name.removesuffix(".weight") in float8_gathered else param_bytes
        every += local * width
        if name.startswith("layers.") and not name.startswith(last_block):
            reshardable += local * width
        elements += local
    return every, reshardable, elements


def _recomputed_blocks(shape: StepShape, n_layers: int) -> tuple[int, int]:
    """(blocks whose forward all-gathers recompute, blocks whose forward reduce-scatters do): all of a
    fully checkpointed block's; the op policy saves reduce-scatter outputs."""
    blocks = block_checkpointing(shape.ac_mode, shape.ac_option, n_layers)
    return sum(how is not None for how in blocks), blocks.count("full")


def comm_plan(model: nn.Module, layout: Layout, shape: StepShape, float8_gathered: set[str],
              nproc_per_node: int) -> list[Collective]:
    """The collectives of one step of `model` (unparallelised, on meta, float8-converted) in `layout`;
    `float8_gathered`: the linears whose weights FSDP gathers in float8."""
    replicate, shard, tp = layout
    every, reshardable, elements = _weights(model, layout, float8_gathered, shape.param_bytes)
    gathered = every + (reshardable if shape.reshard_after_forward else 0)
    plan = [
        ("FSDP all-gather, weights (forward + backward)", "dp_shard", shard, gathered * shape.grad_accum * _ring(shard)),
        ("FSDP reduce-scatter, gradients", "dp_shard", shard, elements * shape.reduce_bytes * _ring(shard)),
        ("HSDP all-reduce, gradient shards", "dp_replicate", replicate,
         elements / shard * shape.reduce_bytes * 2 * _ring(replicate)),
    ]
    if float8_gathered:
        plan.append(("float8 weight scales, all-reduce", "dp_shard", shard, len(float8_gathered) * 4 * 2 * _ring(shard)))
    if tp > 1:
        plan += _tp_collectives(shape, len(model.layers), model.output.in_features, model.output.out_features, tp)
    return [Collective(what, dim, ranks, size, group_spans_nodes(layout, dim, nproc_per_node))
            for what, dim, ranks, size in plan if ranks > 1]


def _tp_collectives(shape: StepShape, n_layers: int, dim: int, vocab: int, tp: int) -> list[tuple[str, str, int, float]]:
    """TP's collectives per step, per GPU, of activations of `shape.tokens` x `dim` per micro-batch."""
    act = shape.param_bytes
    gather = 1 if shape.tp_float8 else act
    gathers_recomputed, scatters_recomputed = _recomputed_blocks(shape, n_layers)
    # Per block: 2 forward all-gathers (backward: reduce-scatters of their gradients), 2 forward
    # reduce-scatters (backward: all-gathers); the root: one of each way, in the activation dtype. A recompute
    # repeats both all-gathers and, for a fully checkpointed block, the first reduce-scatter only.
    all_gathers = (2 * n_layers + 2 * gathers_recomputed) * gather + 2 * n_layers * gather + 2 * act
    reduce_scatters = (2 * n_layers + scatters_recomputed) * act + 2 * n_layers * act + 2 * act
    tokens = shape.tokens * shape.grad_accum
    rows = [
        ("TP all-gather, activations", "tp", tp, all_gathers * tokens * dim * _ring(tp)),
        ("TP reduce-scatter, activations", "tp", tp, reduce_scatters * tokens * dim * _ring(tp)),
    ]
    norm_weights = (2 * n_layers + 1) * dim  # every block's two and the final one
    rows.append(("TP all-reduce, norm weight gradients", "tp", tp, norm_weights * act * 2 * _ring(tp) * shape.grad_accum))
    if shape.tp_float8:
        amaxes = 2 * n_layers + 2 * gathers_recomputed + 2 * n_layers
        rows.append(("TP float8 amax, all-reduce", "tp", tp, amaxes * 4 * 2 * _ring(tp) * shape.grad_accum))
    if shape.loss_parallel:
        rows.append(("TP loss parallel, all-reduce", "tp", tp, tokens * 3 * 4 * 2 * _ring(tp)))
    else:
        rows.append(("TP all-gather, logits", "tp", tp, tokens * vocab * act * _ring(tp)))
    return rows
