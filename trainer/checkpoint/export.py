"""The model-only export at the end of a run: ``<checkpoint folder>/final/``, for inference and SFT."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from models.llama import LlamaArgs
from models.llama.weight_conversion import meta_params_from_args
from trainer.checkpoint.identity import EXPORT_TOKENIZER_FILE
from trainer.log import info
from trainer.precision import TORCH_DTYPES


def export_model(
    state_dict: dict[str, torch.Tensor], args: LlamaArgs, out: Path, dtype: torch.dtype,
    tokenizer: dict[str, Any] | None = None,
) -> None:
    """`out/model.safetensors` (our names, `dtype`), `out/params.json` (Meta's params) and, given the
    tokenizer's identity, `out/tokenizer_identity.json` (checked by trainer.checkpoint.identity.check_tokenizer).

    Written next to `out` and renamed into place, so `out` is either the old or the new export.
    """
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "params.json").write_text(json.dumps(meta_params_from_args(args), indent=2) + "\n")
    if tokenizer is not None:
        (tmp / EXPORT_TOKENIZER_FILE).write_text(json.dumps(tokenizer, indent=2) + "\n")
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        shutil.rmtree(old)
    os.replace(tmp, out)


def export_final(
    model: nn.Module, args: LlamaArgs, out: Path, dtype: str, rank: int, tokenizer: dict[str, Any] | None = None
) -> None:
    """Gather the (sharded) `model` and let rank 0 write it to `out`; a collective of every rank."""
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        export_model(state_dict, args, out, TORCH_DTYPES[dtype], tokenizer)
        info(f"exported model weights: {out / 'model.safetensors'}")
    dist.barrier()
