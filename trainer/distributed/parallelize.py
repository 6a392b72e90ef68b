"""Parallelism and compile, applied from outside the model by module names.

Order (README, "Parallelism"): float8 conversion (done by the caller, on meta) -> tensor
parallel -> activation checkpointing -> torch.compile -> FSDP2. Compile comes
before FSDP so each compiled block is one graph with FSDP's hooks around it, and
TP comes first so compile traces the DTensor-sharded block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainer.config import Config

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class TPStyles:
    """The styles `apply_tp` builds each block's plan from (float8 ones: trainer/float8_training.py).

    local_inputs: the module-input style hands local tensors to the colwise linears (the
    float8 gathers do, float8/tp.py), so the module inputs use `use_local_output=True`.
    """

    colwise: type[ColwiseParallel]
    rowwise: type[RowwiseParallel]
    prepare_input: type[PrepareModuleInput]
    local_inputs: bool = False


PLAIN_TP_STYLES = TPStyles(ColwiseParallel, RowwiseParallel, PrepareModuleInput)


def parallelize_llama(model: nn.Module, mesh: DeviceMesh, cfg: Config, tp_styles: TPStyles) -> nn.Module:
    """Apply TP, AC, compile and FSDP2 to a (meta) LLaMA in the fixed order."""
    tp = mesh["tp"].size()
    if tp > 1:
        apply_tp(model, mesh["tp"], tp_styles, loss_parallel=cfg.parallelism.loss_parallel)
    if cfg.activation_checkpoint.mode != "none":
        apply_ac(model, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_option)
    if cfg.compile.mode != "none":
        apply_compile(model, cfg.compile.mode, cfg.compile.backend)
    apply_fsdp(
        model,
        mesh["dp"],
        param_dtype=_DTYPES[cfg.training.mixed_precision_param],
        reduce_dtype=_DTYPES[cfg.training.mixed_precision_reduce],
        reshard_after_forward=cfg.parallelism.reshard_after_forward,
    )
    return model


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, styles: TPStyles, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallel: activations between blocks are sharded on the sequence dim.

    With the float8-aware `styles` (tensorwise float8) activations are cast before the
    all-gather, so the activation all-gathers move 1-byte data. The residual stream stays a
    Shard(1) DTensor (`use_local_output=False` where it is produced): under torch 2.13 a compiled block
    whose input is the embedding's local reduce-scatter output (an AsyncCollectiveTensor)
    drops that input's gradient, which zeroed the embedding gradient.

    With `loss_parallel` the logits stay a DTensor sharded on the vocab dim, for the
    cross-entropy under `torch.distributed.tensor.parallel.loss_parallel` (trainer/loss.py):
    each rank holds 1/tp of the full-vocab logits and their fp32 upcast instead of all of them.
    """
    colwise, rowwise, prepare_input = styles.colwise, styles.rowwise, styles.prepare_input

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            "norm": SequenceParallel(),
            # The output layer stays high precision (filtered from float8), so plain TP.
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": prepare_input(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None),
                use_local_output=styles.local_inputs,
            ),
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.wo": rowwise(output_layouts=Shard(1), use_local_output=False),
            "ffn_norm": SequenceParallel(),
            "feed_forward": prepare_input(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=styles.local_inputs
            ),
            "feed_forward.w1": colwise(),
            "feed_forward.w2": rowwise(output_layouts=Shard(1), use_local_output=False),
            "feed_forward.w3": colwise(),
        }
        parallelize_module(block, tp_mesh, plan)


def _selective_policy():
    """Save GEMM, attention and reduce-scatter outputs and amaxes; recompute everything else.

    No GEMM is ever recomputed; float8 casts are (from their saved amax). docs/float8.md
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
_full_ac_context.cache_hash = "trainer.distributed.parallelize._full_ac_context: recompute every op"


def apply_ac(model: nn.Module, mode: str, selective_option: str) -> None:
    """Wrap blocks in non-reentrant checkpointing: every block (`full`), every N-th
    (`selective` with an integer option), or every block with the op policy (`op`).

    The wrappers work eager and compiled (`apply_compile` compiles the wrapper, so
    dynamo traces the checkpoint region and the partitioner recomputes it in the
    compiled backward).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    every_nth = int(selective_option) if mode == "selective" and selective_option.isdigit() else 0
    for i, (name, block) in enumerate(list(model.layers.named_children())):
        if mode == "full" or (every_nth and i % every_nth == 0):
            wrapped = checkpoint_wrapper(block, context_fn=_full_ac_context, preserve_rng_state=False)
        elif every_nth:
            continue
        else:
            policy = _selective_policy()
            wrapped = checkpoint_wrapper(
                block,
                context_fn=lambda p=policy: create_selective_checkpoint_contexts(p),
                preserve_rng_state=False,
            )
        model.layers.register_module(name, wrapped)


def apply_compile(model: nn.Module, mode: str, backend: str) -> None:
    """`block`: each block compiled in place (identical blocks share code); `model`: the whole module.

    `nn.Module.compile` keeps parameter names unchanged (no `_orig_mod.` prefix), so
    checkpoints and weight loading do not care about the compile mode.
    """
    if mode == "block":
        for block in model.layers.values():
            block.compile(backend=backend, fullgraph=True)
    else:
        # FSDP's hooks sit between blocks, so the whole-model graph cannot be a single graph.
        model.compile(backend=backend)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
) -> None:
    """fully_shard each block, then the root (embedding, final norm and output)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's weights are needed again at once by backward: keep them gathered.
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)

