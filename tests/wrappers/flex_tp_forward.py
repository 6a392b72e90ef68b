"""torchrun --nproc_per_node=2 tests/wrappers/flex_tp_forward.py: packed logits of flex_attention and of
SDPA's dense mask under TP=2, full activation checkpointing and FSDP wrapping, from the same
weights. Prints "flex == sdpa under TP=2" on success (tests/models/test_attention.py).

Forward only, since torch has no flex_attention backward on CPU; and eager blocks (flex compiled
on its own), since a TP model compiled per block fails in forward without grad on CPU
(torch 2.13: "'Tensor' object has no attribute 'elem'" in AOT autograd, with SDPA too).
"""

from __future__ import annotations

import dataclasses

import torch

from trainer.config import Layout, build_config
from trainer.distributed import process_group
from trainer.distributed.parallelize import PLAIN_TP_STYLES, parallelize_llama
from trainer.model_setup import build_meta_model, init_weights, model_args_for


def main() -> None:
    cfg = build_config([
        "--config", "configs/debug_sft.toml", "--model.n_layers", "2", "--training.seq_len", "256",
        "--parallelism.tensor_parallel_degree", "2",
        "--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "float32",
    ])
    info = process_group.init_distributed("cpu")
    mesh = process_group.build_mesh("cpu", Layout(1, 1, 2)).world
    torch.manual_seed(0)
    tokens = torch.randint(0, 2048, (2, 256))
    lengths = ([50, 130, 76], [128, 100, 28])
    document_ids = torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in lengths])
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    logits = {}
    for attention in ("sdpa", "flex"):
        args = dataclasses.replace(model_args_for(cfg, None, "cpu"), attention=attention)
        model = parallelize_llama(
            build_meta_model(args), mesh, tp_styles=PLAIN_TP_STYLES, vocab_sharded_logits=cfg.parallelism.loss_parallel,
            activation_checkpoint=cfg.activation_checkpoint, compile_config=cfg.compile,
            param_dtype=torch.float32, reduce_dtype=torch.float32,
            reshard_after_forward=cfg.parallelism.reshard_after_forward, single_rank_fast_path=False,
            gradient_packing=cfg.parallelism.gradient_packing,
        )
        init_weights(model, args, cfg.training.seed, info.device)
        with torch.no_grad():
            out = model(tokens, position_ids, document_ids)
        logits[attention] = out.full_tensor() if hasattr(out, "full_tensor") else out
    torch.testing.assert_close(logits["flex"], logits["sdpa"], atol=1e-4, rtol=1e-4)
    if info.is_main:
        print("flex == sdpa under TP=2", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
