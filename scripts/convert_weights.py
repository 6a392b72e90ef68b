"""Convert LLaMA-2 weights between Hugging Face, Meta and this trainer's state dict.

    python scripts/convert_weights.py --from hf --to torch Llama-2-7b-hf llama2_7b.safetensors
    python scripts/convert_weights.py --from meta --to hf llama-2-13b/ llama-2-13b-hf/ --dtype bf16
    python scripts/convert_weights.py --from torch --to hf --flavor 7B model.pt out-hf/

hf and meta are directories; torch is one file (.safetensors, or .pt of plain tensors), which
carries no config: give its --flavor (vocab_size is taken from the weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.llama import LLAMA2_FLAVORS, LlamaArgs
from models.llama.weights import StateDict, WeightsError, check_state_dict
from models.llama.weights_io import FORMATS, load_tensor_file, read_weights, write_weights

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--from", dest="src_format", choices=FORMATS, required=True)
    parser.add_argument("--to", dest="dst_format", choices=FORMATS, required=True)
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast all weights (default: keep)")
    parser.add_argument(
        "--flavor", choices=sorted(LLAMA2_FLAVORS), help="model shape of a torch SRC"
    )
    parser.add_argument(
        "--num-shards", type=int, default=1, help="model-parallel shards for --to meta"
    )
    return parser.parse_args(argv)


def _torch_source_args(state_dict: StateDict, flavor: str | None) -> LlamaArgs:
    if flavor is None:
        raise WeightsError("--from torch needs --flavor (a torch state dict carries no config)")
    # The trainer sizes the vocabulary from its tokenizer, so trust the weights over the flavour.
    embeddings = state_dict.get("tok_embeddings.weight")
    args = LLAMA2_FLAVORS[flavor]
    return args if embeddings is None else dataclasses.replace(args, vocab_size=embeddings.shape[0])


def convert(opts: argparse.Namespace) -> None:
    if opts.dst.exists() and (opts.dst.is_file() or any(opts.dst.iterdir())):
        raise WeightsError(f"{opts.dst}: already exists; choose a new destination")
    if opts.num_shards < 1 or (opts.num_shards > 1 and opts.dst_format != "meta"):
        raise WeightsError("--num-shards must be >= 1 and only applies to --to meta")
    if opts.src_format == "torch":
        state_dict = load_tensor_file(opts.src)
        args = _torch_source_args(state_dict, opts.flavor)
        check_state_dict(state_dict, args, str(opts.src))
    else:
        args, state_dict = read_weights(opts.src_format, opts.src)
    if opts.dtype is not None:
        state_dict = {key: t.to(DTYPES[opts.dtype]) for key, t in state_dict.items()}
    write_weights(opts.dst_format, state_dict, args, opts.dst, num_shards=opts.num_shards)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        convert(opts)
    except (WeightsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {opts.dst_format} weights to {opts.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
