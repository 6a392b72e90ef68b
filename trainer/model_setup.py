"""Model construction for the trainer: flavour -> meta model -> weights init (float8: trainer/float8_seam/)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from models.llama import LLAMA2_FLAVORS, LlamaArgs, Transformer, initialized_model, seeded_init
from models.llama.attention import resolve_attention
from trainer.config import Config
from trainer.errors import UserError


def model_args_for(cfg: Config, tokenizer_words: int | None, device_type: str) -> LlamaArgs:
    """The flavour's shape, with the config's overrides and attention kernel, checked against the tokenizer."""
    args = LLAMA2_FLAVORS[cfg.model.flavor]
    max_seq_len = cfg.model.max_seq_len or args.max_seq_len
    if cfg.training.seq_len > max_seq_len:
        where = f"model.max_seq_len = {max_seq_len}" if cfg.model.max_seq_len else (
            f"the max_seq_len {max_seq_len} of model.flavor '{cfg.model.flavor}'")
        raise UserError(
            f"training.seq_len = {cfg.training.seq_len} exceeds {where}; shorten it, or set model.max_seq_len "
            f">= {cfg.training.seq_len} to train on longer sequences than the flavour's"
        )
    attention = resolve_attention(cfg.model.attention, cfg.compile.mode != "none", device_type)
    if attention == "flex" and device_type != "cuda":
        raise UserError(
            f"model.attention = 'flex' needs CUDA (torch {torch.__version__} has no flex_attention backward "
            f"on {device_type}); use 'auto' or 'sdpa'"
        )
    changes: dict[str, Any] = {"max_seq_len": max_seq_len, "attention": attention}
    if cfg.model.n_layers:
        changes["n_layers"] = cfg.model.n_layers
    args = dataclasses.replace(args, **changes)
    if tokenizer_words is not None and tokenizer_words > args.vocab_size:
        raise UserError(
            f"model.tokenizer_path has {tokenizer_words} tokens but model.flavor '{cfg.model.flavor}' "
            f"has vocab_size {args.vocab_size}"
        )
    return args


def build_meta_model(args: LlamaArgs) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def init_weights(model: nn.Module, args: LlamaArgs, seed: int, device: torch.device) -> None:
    """Allocate the (sharded) parameters and initialise them.

    On CPU, DTensor has no layout-independent RNG, so rank 0 initialises a full copy and
    broadcasts it: 1 process, FSDP and TP then start from identical weights. On GPU,
    DTensor's offset-based RNG gives the same property without a full copy.
    """
    model.to_empty(device=device)
    seeded_init(model, seed, device)
    if device.type != "cpu":
        return
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full_sd = initialized_model(args, seed).state_dict() if dist.get_rank() == 0 else {}
    set_model_state_dict(
        model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
