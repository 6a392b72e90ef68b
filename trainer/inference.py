"""A trained model for generation, as scripts/generate.py and scripts/eval_sft.py load and run it.

Weights, first that applies: ``--weights`` (a DCP checkpoint folder ``step-N``, a
``model.safetensors`` or its export folder, a Hugging Face or Meta folder); the latest
checkpoint under the config's dump folder (when ``checkpoint.enable``); the config's
``checkpoint.initial_load_path``; else the untrained initialisation, with a warning.

One process, no float8: DCP checkpoints (also of sharded or float8 runs, whose linears keep
ordinary weights) load into a plain model in eval mode. The model flags the two commands share
(``add_model_flags``) pick the weights, the device, the dtype and how decoding runs
(models/llama/generation.py: a static KV cache, on CUDA replayed as a CUDA graph).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from models.llama import Transformer, seeded_init
from models.llama.generation import generate, generate_without_cache
from models.llama.weight_conversion import WeightsError
from models.llama.weight_files import check_finite, read_weights
from trainer.checkpoint.dcp_reader import load_dcp_model
from trainer.checkpoint.folder import step_folders
from trainer.checkpoint.identity import check_tokenizer
from trainer.checkpoint.initial_weights import check_weights_fit
from trainer.config import Config, build_config
from trainer.data.sft import turn_strings
from trainer.data.tokenizer import Tokenizer
from trainer.errors import UserError
from trainer.log import warn
from trainer.model_setup import model_args_for
from trainer.precision import TORCH_DTYPES


def checkpoint_folder(cfg: Config) -> Path:
    folder = Path(cfg.checkpoint.folder)
    return folder if folder.is_absolute() else Path(cfg.job.dump_folder) / folder


def _weights_format(path: Path) -> str:
    if path.is_file():
        return "torch"
    if (path / ".metadata").is_file():
        return "dcp"
    if (path / "model.safetensors").is_file() and (path / "params.json").is_file():
        return "export"
    if (path / "config.json").is_file():
        return "hf"
    if (path / "params.json").is_file():
        return "meta"
    raise UserError(
        f"--weights {path}: not a DCP checkpoint (.metadata), an export (model.safetensors), "
        "a Hugging Face (config.json) or a Meta (params.json) folder"
    )


def default_weights(cfg: Config) -> tuple[str | None, str]:
    """(path, format) the trainer would resume or start from; (None, "init") for none."""
    if cfg.checkpoint.enable:
        found = step_folders(checkpoint_folder(cfg))
        if found:
            return str(found[max(found)]), "dcp"
    if cfg.checkpoint.initial_load_path:
        return cfg.checkpoint.initial_load_path, cfg.checkpoint.initial_load_format
    return None, "init"


def load_model(
    cfg: Config, weights: str | None, device: torch.device, dtype: torch.dtype
) -> tuple[Transformer, Tokenizer, str]:
    """A plain (unsharded, no float8) model in eval mode, its tokenizer, and where its weights came from."""
    tokenizer = Tokenizer(cfg.model.tokenizer_path)
    # Generation needs no training kernel: the cache attends through SDPA, and the
    # recompute path's padding mask is small. flex_attention would only add a compilation.
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="sdpa"))
    args = model_args_for(cfg, tokenizer.n_words, device.type)
    if weights is not None:
        path = Path(weights)
        if not path.exists():
            raise UserError(f"--weights not found: {weights}")
        fmt = _weights_format(path)
    else:
        path_str, fmt = default_weights(cfg)
        path = Path(path_str) if path_str else None
    if path is not None:
        check_tokenizer(path, tokenizer)
        # From the weights' metadata, before the model is built: a larger flavour than the weights'
        # would otherwise be allocated whole (a 7B in fp32 is 27 GB) before they are refused.
        check_weights_fit(path / "model.safetensors" if fmt == "export" else path,
                          "torch" if fmt == "export" else fmt, args, "--weights" if weights else "weights")
    # Built on meta and materialised on the target device: a 7B model never needs a CPU copy.
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    # Seeded: without weights this is a reproducible untrained model (and the rope table is set).
    seeded_init(model, cfg.training.seed, device)
    if path is None:
        source = "no checkpoint: the untrained initialisation"
        warn("no weights (no --weights, no checkpoint of the config, no checkpoint.initial_load_path): "
             "generating with the untrained initialisation, whose output is noise")
    elif fmt == "dcp":
        load_dcp_model(model, path, what="checkpoint")
        source = str(path)
    else:
        if fmt == "export":
            path = path / "model.safetensors"
        try:
            _, state_dict = read_weights("torch" if fmt == "export" else fmt, path, args)
        except WeightsError as e:
            raise UserError(str(e)) from None
        model.load_state_dict(state_dict)
        source = str(path)
    try:
        check_finite(model.state_dict(), f"weights {source}")
    except WeightsError as e:
        raise UserError(str(e)) from None
    with torch.no_grad():
        # Parameters only: the rope table stays fp32.
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return model.eval(), tokenizer, source


def chat_prompt(tokenizer: Tokenizer, user: str, system: str | None = None) -> list[int]:
    """LLaMA-2 chat tokens of one user message, up to and including ``[/INST]``."""
    prompt, _ = turn_strings((system, [(user, "")]))[0]
    return tokenizer.encode(prompt, bos=True, eos=False)


def check_prompt_lengths(prompts: list[list[int]], max_seq_len: int) -> None:
    """Refuse a prompt that leaves no room for a new token: generation would end before it began."""
    for k, prompt in enumerate(prompts):
        if len(prompt) >= max_seq_len:
            raise UserError(f"prompt {k + 1} is {len(prompt)} tokens, but the model attends to at most max_seq_len = "
                            f"{max_seq_len}, so nothing could be generated; shorten it or raise --model.max_seq_len")


class Progress:
    """A stderr line, rewritten in place: prompts done, new tokens, tokens per second."""

    def __init__(self, total: int) -> None:
        self.total, self.start = total, time.perf_counter()

    def __call__(self, rows: int, tokens: int) -> None:
        rate = tokens / max(time.perf_counter() - self.start, 1e-9)
        end = "\n" if rows == self.total else ""
        print(f"\r{rows}/{self.total} prompts, {tokens} new tokens, {rate:,.1f} tokens/s", end=end,
              file=sys.stderr, flush=True)


def generate_with(
    opts: argparse.Namespace,
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    batch_size: int | None = None,
) -> list[list[int]]:
    """Generate as the flags ask: --no_kv_cache, --eager, --compile, or the device's default.

    On CUDA the step replays as a CUDA graph by default; --compile also compiles the blocks,
    which pays for its compilation only over thousands of decode steps (docs/benchmarks.md).
    """
    progress = Progress(len(prompts))
    if opts.no_kv_cache:
        outputs = generate_without_cache(model, prompts, max_new_tokens, eos_id, temperature, top_p, generator)
        progress(len(prompts), sum(map(len, outputs)))
        return outputs
    return generate(
        model, prompts, max_new_tokens, eos_id, temperature, top_p, generator, compile_decode=opts.compile,
        cuda_graph=model.output.weight.device.type == "cuda" and not opts.eager, batch_size=batch_size,
        progress=progress,
    )


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is available")
    return torch.device(name)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The flags generate.py and eval_sft.py share: the weights, the device, the dtype, how decoding runs."""
    parser.add_argument("--weights", help="checkpoint/export/HF/Meta path (default: latest checkpoint of the config)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--max_new_tokens", type=int, help="tokens to generate at most")
    parser.add_argument(
        "--compile", action="store_true", help="compile the blocks (the first call compiles; see docs/benchmarks.md)"
    )
    parser.add_argument("--eager", action="store_true", help="no CUDA graph, no compilation (on CPU the default)")
    parser.add_argument(
        "--no_kv_cache", action="store_true", help="run the whole sequence for every token (the slow reference)"
    )


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    """Script flags via argparse; everything else (--config, --section.key value) via train.py's parser."""
    opts, rest = parser.parse_known_args(argv)
    cfg = build_config(rest)
    if opts.max_new_tokens is not None and opts.max_new_tokens <= 0:
        raise UserError(f"--max_new_tokens must be positive, got {opts.max_new_tokens}")
    if opts.compile and opts.no_kv_cache:
        raise UserError("--compile compiles the KV-cache decode step, so it does not go with --no_kv_cache")
    if opts.compile and opts.eager:
        raise UserError("--eager and --compile contradict each other: pick one")
    return opts, cfg


def model_from_opts(opts: argparse.Namespace, cfg: Config) -> tuple[Transformer, Tokenizer, str]:
    device = pick_device(opts.device)
    dtype = TORCH_DTYPES[opts.dtype] if opts.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return load_model(cfg, opts.weights, device, dtype)
