"""Convert LLaMA-2 weights between Hugging Face, Meta, trainer checkpoints and state-dict files.

    python scripts/convert_weights.py --from hf --to torch Llama-2-7b-hf llama2_7b.safetensors
    python scripts/convert_weights.py --from meta --to hf llama-2-13b/ llama-2-13b-hf/ --dtype bf16
    python scripts/convert_weights.py --from torch --to hf --flavor 7B model.pt out-hf/
    python scripts/convert_weights.py --from dcp --to hf --flavor 7B outputs/sft/checkpoints/step-600 sft-hf/
    python scripts/convert_weights.py --from hf --to dcp Llama-2-7b-hf llama2-7b-dcp/
    python scripts/convert_weights.py --from random --to hf --flavor 7B --dtype bf16 random-7b-hf/

hf and meta are directories; torch is one file (.safetensors, or .pt of plain tensors); dcp is a
trainer checkpoint (checkpoints/step-N, of which only the model is read) or a model-only DCP
folder, which --to dcp writes for `train.py --checkpoint.initial_load_path DIR
--checkpoint.initial_load_format dcp`. torch and dcp weights carry no config: give their
--flavor (vocab_size and the number of layers are taken from the weights). random takes no
SRC: it writes the --flavor model (--n-layers overrides its depth) initialised as train.py
initialises it with training.seed = --seed: bitwise on CPU in fp32; with --dtype bf16 it is
allocated and initialised in bf16 directly (half the memory; values differ from a cast);
--device cuda draws on the GPU, as train.py does there (much faster for 7B and up).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from models.llama import LLAMA2_FLAVORS, LlamaArgs, Transformer, initialized_model
from models.llama.weight_conversion import StateDict, WeightsError, check_state_dict
from models.llama.weight_files import (
    FORMATS,
    check_finite,
    load_tensor_file,
    read_weights,
    write_weights,
)
from trainer.checkpoint.dcp_reader import (
    dcp_model_prefix,
    dcp_model_shapes,
    load_dcp_model,
    read_dcp_metadata,
)
from trainer.errors import UserError

ALL_FORMATS = (*FORMATS, "dcp")
SOURCES = (*ALL_FORMATS, "random")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--from", dest="src_format", choices=SOURCES, required=True)
    parser.add_argument("--to", dest="dst_format", choices=ALL_FORMATS, required=True)
    parser.add_argument("src", type=Path, help="source (none for --from random)")
    parser.add_argument("dst", type=Path, nargs="?")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast all weights (default: keep)")
    parser.add_argument(
        "--flavor", choices=sorted(LLAMA2_FLAVORS), help="model shape of a torch or dcp SRC"
    )
    parser.add_argument(
        "--num-shards", type=int, default=1, help="model-parallel shards for --to meta"
    )
    parser.add_argument("--n-layers", type=int, default=0, help="--from random: layers (0 = flavor's)")
    parser.add_argument("--seed", type=int, default=42, help="--from random: training.seed to mimic")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="--from random: "
                        "where to draw the weights (default cpu)")
    opts = parser.parse_args(argv)
    if opts.src_format == "random":
        if opts.dst is not None:
            parser.error("--from random takes no SRC, only DST")
        if opts.flavor is None:
            parser.error("--from random needs --flavor")
        opts.src, opts.dst = None, opts.src
    elif opts.dst is None:
        parser.error("the following arguments are required: dst")
    return opts


def random_weights(
    flavor: str, n_layers: int, seed: int, dtype: torch.dtype, device: str = "cpu"
) -> tuple[LlamaArgs, StateDict]:
    """The flavour's model (vocab from the flavour, as in train.py) initialised like train.py.

    models.llama.initialized_model is train.py's recipe: in float32 on CPU its weights are
    train.py's bitwise. On CUDA it draws from the CUDA generator (not checked bitwise against
    train.py, whose parameters are DTensors there). `dtype` is the default dtype while the
    model is built, so a bf16 model never has an fp32 copy.
    """
    args = LLAMA2_FLAVORS[flavor]
    if n_layers:
        args = dataclasses.replace(args, n_layers=n_layers)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = initialized_model(args, seed, device)
    finally:
        torch.set_default_dtype(default)
    return args, {key: t.cpu() for key, t in model.state_dict().items()}


def _flavor_args(shapes: Mapping[str, Sequence[int]], flavor: str | None, fmt: str) -> LlamaArgs:
    """Args of config-less weights: the flavour's, with vocab_size and n_layers from ``shapes``."""
    if flavor is None:
        raise WeightsError(f"--from {fmt} needs --flavor (its weights carry no config)")
    # The trainer sizes the vocabulary from its tokenizer and may cut layers (model.n_layers),
    # so trust the weights over the flavour for both.
    changes = {}
    if "tok_embeddings.weight" in shapes:
        changes["vocab_size"] = shapes["tok_embeddings.weight"][0]
    layers = [int(m.group(1)) for key in shapes if (m := _LAYER_KEY.match(key))]
    if layers:
        changes["n_layers"] = max(layers) + 1
    return dataclasses.replace(LLAMA2_FLAVORS[flavor], **changes)


def read_dcp(path: Path, flavor: str | None) -> tuple[LlamaArgs, StateDict]:
    """The model of a DCP checkpoint, read with the trainer's reader (nothing is unpickled)."""
    if not path.is_dir():
        raise WeightsError(f"{path}: directory not found")
    metadata = read_dcp_metadata(path, "--from dcp")
    prefix = dcp_model_prefix(metadata, ["tok_embeddings.weight"])
    if prefix + "tok_embeddings.weight" not in metadata.state_dict_metadata:
        raise WeightsError(f"{path}: no model weights (no tok_embeddings.weight) in this checkpoint")
    shapes = dcp_model_shapes(metadata, prefix)
    args = _flavor_args(shapes, flavor, "dcp")
    check_state_dict(
        {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}, args, str(path)
    )
    # Keep the stored dtype (the trainer stores fp32 master weights); --dtype casts later.
    dtype = metadata.state_dict_metadata[prefix + "tok_embeddings.weight"].properties.dtype
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
    model.to_empty(device="cpu")
    load_dcp_model(model, path, what="--from dcp")
    return args, model.state_dict()


def write_dcp(state_dict: StateDict, args: LlamaArgs, path: Path) -> None:
    """A model-only DCP folder (bare keys, like torchtitan's seed checkpoints)."""
    check_state_dict(state_dict, args)
    with warnings.catch_warnings():
        # DCP warns that it "assumes" a single process; here that is the point.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            {key: t.contiguous() for key, t in state_dict.items()},
            checkpoint_id=str(path),
            no_dist=True,
        )


def convert(opts: argparse.Namespace) -> None:
    # A link (even one to nowhere) is refused too: writing through it would land elsewhere.
    if opts.dst.is_symlink() or (opts.dst.exists() and (opts.dst.is_file() or any(opts.dst.iterdir()))):
        raise WeightsError(f"{opts.dst}: already exists; choose a new destination")
    if (opts.n_layers or opts.device != "cpu") and opts.src_format != "random":
        raise WeightsError("--n-layers and --device only apply to --from random")
    if opts.num_shards < 1 or (opts.num_shards > 1 and opts.dst_format != "meta"):
        raise WeightsError("--num-shards must be >= 1 and only applies to --to meta")
    if opts.src_format == "random":
        dtype = DTYPES[opts.dtype] if opts.dtype else torch.float32
        args, state_dict = random_weights(opts.flavor, opts.n_layers, opts.seed, dtype, opts.device)
    elif opts.src_format == "torch":
        state_dict = load_tensor_file(opts.src)
        args = _flavor_args({k: t.shape for k, t in state_dict.items()}, opts.flavor, "torch")
        check_state_dict(state_dict, args, str(opts.src))
    elif opts.src_format == "dcp":
        args, state_dict = read_dcp(opts.src, opts.flavor)
    else:
        args, state_dict = read_weights(opts.src_format, opts.src)
    # Before anything is written: a converted copy of damaged weights would pass for healthy ones.
    check_finite(state_dict, str(opts.src))
    if opts.dtype is not None:
        state_dict = {key: t.to(DTYPES[opts.dtype]) for key, t in state_dict.items()}
    if opts.dst_format == "dcp":
        write_dcp(state_dict, args, opts.dst)
    else:
        write_weights(opts.dst_format, state_dict, args, opts.dst, num_shards=opts.num_shards)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        convert(opts)
    except (WeightsError, UserError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {opts.dst_format} weights to {opts.dst}")
    return 0


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
