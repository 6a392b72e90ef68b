"""Parallelism and compile, applied from outside the model by module names.

Order (docs/parallelism.md, "The mesh and the build order"): float8 conversion (done by the
caller, on meta) -> tensor parallel -> activation checkpointing -> torch.compile -> FSDP2. Compile comes
before FSDP so each compiled block is one graph with FSDP's hooks around it, and
TP comes first so compile traces the DTensor-sharded block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainer.config import ActivationCheckpointConfig, CompileConfig
from trainer.config.schema import GradientPacking
from trainer.distributed.activation_checkpoint import apply_ac
from trainer.distributed.gradient_packing import use_gradient_packing
from trainer.distributed.process_group import fsdp_mesh
from trainer.distributed.single_rank_fast_path import apply_fast_path
from trainer.errors import UserError


@dataclass(frozen=True)
class TPStyles:
    """The styles `apply_tp` builds each block's plan from (the caller chooses them).

    local_inputs: the module-input style hands local tensors to the colwise linears (the
    float8 gathers do, float8/tp.py), so the module inputs use `use_local_output=True`.
    float8_gathers: the activation all-gathers move float8 (the communication plan counts 1 byte).
    """

    colwise: type[ColwiseParallel]
    rowwise: type[RowwiseParallel]
    prepare_input: type[PrepareModuleInput]
    local_inputs: bool = False
    float8_gathers: bool = False


PLAIN_TP_STYLES = TPStyles(ColwiseParallel, RowwiseParallel, PrepareModuleInput)


def parallelize_llama(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    tp_styles: TPStyles,
    vocab_sharded_logits: bool,
    activation_checkpoint: ActivationCheckpointConfig,
    compile_config: CompileConfig,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    single_rank_fast_path: bool,
    gradient_packing: GradientPacking,
) -> nn.Module:
    """Apply TP, AC, compile and FSDP2 to a (meta) LLaMA in the fixed order.

    vocab_sharded_logits: TP with loss parallel, the output logits stay sharded on the vocab.
    single_rank_fast_path: FSDP2 with the one-rank patches (trainer/distributed/single_rank_fast_path.py,
    whose `choose_fast_path` decides it); False is plain FSDP2.
    gradient_packing: how every FSDP2 reduction packs its gradients (trainer/distributed/gradient_packing.py).
    """
    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"], tp_styles, loss_parallel=vocab_sharded_logits)
    if activation_checkpoint.mode != "none":
        apply_ac(model, activation_checkpoint.mode, activation_checkpoint.selective_option)
    if compile_config.mode != "none":
        apply_compile(model, compile_config.mode, compile_config.backend)
    apply_fsdp(model, fsdp_mesh(mesh), param_dtype, reduce_dtype, reshard_after_forward)
    use_gradient_packing(gradient_packing)
    if single_rank_fast_path:
        apply_fast_path(model)
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
    """fully_shard each block, then the root (embedding, final norm and output), over `dp_mesh`: the
    shard dim, or (replicate, shard) for HSDP."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # The shard dim is the last either way; a weight is split over it alone.
    place = _shard_placement(dp_mesh.size(dp_mesh.ndim - 1))
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's weights are needed again at once by backward: keep them gathered.
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1,
                    shard_placement_fn=place)
    # So are the root's (the output layer's backward runs first, the embedding's last): FSDP2's own choice for
    # a root, which an explicit True would override with a second all-gather of them a step.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, shard_placement_fn=place)


def _shard_placement(ranks: int):
    """FSDP2's `shard_placement_fn`: a parameter whose tensor names its own shard dim over `ranks`
    (`fsdp_shard_dim`: block-scaled float8 weights, whose shards must hold whole blocks) gets it,
    the rest FSDP's default (dim 0). A parameter that no dim can shard so is the layout's fault: one line."""

    def placement(param: nn.Parameter) -> Shard | None:
        choose = getattr(param._local_tensor if isinstance(param, DTensor) else param, "fsdp_shard_dim", None)
        if choose is None:
            return None
        try:
            return Shard(choose(ranks))
        except ValueError as e:
            raise UserError(str(e)) from None

    return placement

