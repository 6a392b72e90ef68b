"""Activation checkpointing of the transformer blocks: full, every N-th block, or per op.

Applied after TP and before torch.compile (docs/design.md): the compiled block then
contains the checkpoint region and the partitioner recomputes it in the compiled backward.
"""

from __future__ import annotations

import torch
from torch import nn


def _selective_policy():
    """Save GEMM, attention and reduce-scatter outputs and amaxes; recompute everything else.

    No GEMM is ever recomputed; float8 casts are (from their saved amax). docs/float8/background.md
    lists what this keeps per block, eager and compiled.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    ops = [
        torch.ops.aten.mm.default,
        torch.ops.aten._scaled_mm.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        # amax of float8 casts: recomputing would need the high-precision tensor anyway
        torch.ops.aten.max.default,
        torch.ops.aten.amax.default,
    ]
    if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        ops.append(torch.ops.aten._scaled_dot_product_cudnn_attention.default)
    # model.attention = flex: the attention output is a higher-order op's, not an aten op's.
    ops.append(torch.ops.higher_order.flex_attention)
    save = set(ops)

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _recompute_everything(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


def _full_ac_context():
    """Full checkpointing: plain in eager; under torch.compile, the selective path with a
    policy that recomputes every op.

    Compiled, AC is a tag on each forward node telling the partitioner to recompute it.
    torch 2.11 tags plain (context-free) checkpoint regions on dynamo's graph only, and
    the ops that AOT autograd inlines from an autograd.Function (the float8 matmul) stay
    untagged: the partitioner then saves every float8 linear's inputs, and a "full" AC
    block keeps nearly all its activations. The selective path tags each op as it is
    dispatched, autograd.Function bodies included (torch 2.13 routes plain AC through it
    too). Eager runs keep torch's plain checkpoint: no per-op Python dispatch mode.
    """
    from torch._guards import TracingContext
    from torch.utils.checkpoint import create_selective_checkpoint_contexts, noop_context_fn

    if TracingContext.try_get() is None:
        return noop_context_fn()
    return create_selective_checkpoint_contexts(_recompute_everything)


# AOT autograd's cache skips graphs whose checkpoint context_fn has no stable hash.
_full_ac_context.cache_hash = "trainer.distributed.activation_checkpoint._full_ac_context: recompute every op"


def block_checkpointing(mode: str, selective_option: str, n_layers: int) -> list[str | None]:
    """How each block is checkpointed: "full" (every op recomputed), "op" (the op policy: GEMM,
    attention and reduce-scatter outputs saved) or None. `full` is every block, `selective` with an
    integer N every N-th block in full, `selective` otherwise every block with the op policy."""
    if mode == "none":
        return [None] * n_layers
    every_nth = int(selective_option) if mode == "selective" and selective_option.isdigit() else 0
    if mode == "full" or every_nth:
        return ["full" if mode == "full" or i % every_nth == 0 else None for i in range(n_layers)]
    return ["op"] * n_layers


def apply_ac(model: nn.Module, mode: str, selective_option: str) -> None:
    """Wrap blocks in non-reentrant checkpointing: every block (`full`), every N-th
    (`selective` with an integer option), or every block with the op policy (`op`).

    The wrappers work eager and compiled (`apply_compile` compiles the wrapper, so
    dynamo traces the checkpoint region and the partitioner recomputes it in the
    compiled backward).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    blocks = list(model.layers.named_children())
    for (name, block), how in zip(blocks, block_checkpointing(mode, selective_option, len(blocks))):
        if how == "full":
            wrapped = checkpoint_wrapper(block, context_fn=_full_ac_context, preserve_rng_state=False)
        elif how is None:
            continue
        else:
            policy = _selective_policy()
            wrapped = checkpoint_wrapper(
                block,
                context_fn=lambda p=policy: create_selective_checkpoint_contexts(p),
                preserve_rng_state=False,
            )
        model.layers.register_module(name, wrapped)
