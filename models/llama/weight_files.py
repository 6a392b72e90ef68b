"""Read and write LLaMA-2 weights as Hugging Face, Meta or plain state-dict files.

Formats:
  hf     directory: config.json + *.safetensors (or pytorch_model*.bin), with an index if sharded
  meta   directory: params.json + consolidated.NN.pth (one per model-parallel shard)
  torch  one file of our own state dict: .safetensors, or .pt/.pth of plain tensors
Pickles are only ever read with ``weights_only=True``.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .args import LlamaArgs
from .weight_conversion import (
    StateDict,
    WeightsError,
    args_from_hf_config,
    args_from_meta_params,
    check_args_match,
    check_state_dict,
    hf_config_from_args,
    hf_to_llama,
    llama_to_hf,
    llama_to_meta,
    meta_params_from_args,
    meta_to_llama,
)

FORMATS = ("hf", "meta", "torch")
_HF_SHARD_BYTES = 5 * 2**30


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise WeightsError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a JSON object")
    return data


def _as_state_dict(obj: object, path: Path) -> StateDict:
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise WeightsError(f"{path}: expected a flat dict of name -> tensor")
    return obj


# What model weights are stored in: any other dtype (integers, booleans, float8 without its scales)
# would be converted to the parameters' dtype silently and train a model of zeros or garbage.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_weight_dtypes(state_dict: StateDict, path: Path) -> StateDict:
    for key, t in state_dict.items():
        if t.dtype not in WEIGHT_DTYPES:
            kinds = ", ".join(str(d).removeprefix("torch.") for d in WEIGHT_DTYPES)
            raise WeightsError(f"{path}: {key!r} is {str(t.dtype).removeprefix('torch.')}, not a weight dtype ({kinds})")
    return state_dict


def load_tensor_file(path: Path) -> StateDict:
    """A dict of weights from .safetensors, or from a torch.save file without unpickling objects.

    Tensors of any dtype but WEIGHT_DTYPES are refused.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: file not found")
    try:
        if path.suffix == ".safetensors":
            return _check_weight_dtypes(load_file(path), path)
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise WeightsError(
            f"{path}: holds Python objects besides tensors; refusing to unpickle"
        ) from None
    except (SafetensorError, RuntimeError, OSError, EOFError) as e:
        # Corrupt archives come back as multi-line RuntimeErrors; one line is enough to name it.
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WeightsError(f"{path}: cannot read weights ({first_line})") from None
    return _check_weight_dtypes(_as_state_dict(obj, path), path)


def _require_dir(path: Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise WeightsError(f"{path}: directory not found")
    return path


def _read_hf_tensors(path: Path) -> StateDict:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index_name).exists():
            weight_map = _read_json(path / index_name).get("weight_map")
            if not isinstance(weight_map, dict):
                raise WeightsError(f"{path / index_name}: no weight_map")
            files = sorted(set(weight_map.values()))
            break
    else:
        files = [p.name for p in sorted(path.glob("*.safetensors"))] or [
            p.name for p in sorted(path.glob("pytorch_model*.bin"))
        ]
    if not files:
        raise WeightsError(f"{path}: no *.safetensors or pytorch_model*.bin files")
    tensors: StateDict = {}
    found_in: dict[str, str] = {}
    for name in files:
        for key, t in load_tensor_file(path / name).items():
            if key in found_in:
                # Merging would let one file (a stray copy, an older shard) override the other's tensor.
                raise WeightsError(f"{path}: {key!r} is in both {found_in[key]} and {name}; remove the file "
                                   "that does not belong to the model")
            found_in[key] = name
            tensors[key] = t
    return tensors


def read_hf(path: str | Path) -> tuple[LlamaArgs, StateDict]:
    """Args and our state dict from a Hugging Face LlamaForCausalLM directory."""
    path = _require_dir(path)
    args = args_from_hf_config(_read_json(path / "config.json"))
    return args, hf_to_llama(_read_hf_tensors(path), args)


def read_meta(path: str | Path) -> tuple[LlamaArgs, StateDict]:
    """Args and our state dict from a Meta directory, merging model-parallel shards."""
    path = _require_dir(path)
    params = _read_json(path / "params.json")
    files = sorted(path.glob("consolidated.*.pth"))
    if not files:
        raise WeightsError(f"{path}: no consolidated.*.pth files")
    shards = [load_tensor_file(f) for f in files]
    embeddings = shards[0].get("tok_embeddings.weight")
    vocab_size = None if embeddings is None else embeddings.shape[0]
    args = args_from_meta_params(params, vocab_size=vocab_size)
    return args, meta_to_llama(shards, args)


def check_finite(state_dict: StateDict, where: str = "weights") -> None:
    """Raise WeightsError when any weight is NaN or infinite: such weights are damaged or diverged."""
    bad = {key: int((~torch.isfinite(t)).sum()) for key, t in state_dict.items() if t.is_floating_point()}
    total = sum(bad.values())
    if total:
        first = next(key for key, n in bad.items() if n)
        raise WeightsError(f"{where} holds {total} NaN or infinite weights (the first in {first!r}): these "
                           "weights are damaged or diverged; use healthy weights")


def _tensor_file_shapes(path: Path) -> dict[str, torch.Size]:
    """Shapes of the tensors of a .safetensors (its header only) or torch.save file (memory-mapped)."""
    if not path.is_file():
        raise WeightsError(f"{path}: file not found")
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                return {key: torch.Size(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise WeightsError(f"{path}: holds Python objects besides tensors; refusing to unpickle") from None
    except (SafetensorError, RuntimeError, OSError, EOFError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WeightsError(f"{path}: cannot read weights ({first_line})") from None
    return {key: t.shape for key, t in _as_state_dict(obj, path).items()}


def check_weights_fit(fmt: str, path: str | Path, args: LlamaArgs) -> None:
    """Raise WeightsError unless the weights at `path` fit the model of `args`, reading only what
    describes them (a config file, a safetensors header): no model and no weights are allocated."""
    path = Path(path)
    if fmt == "torch":
        shapes = _tensor_file_shapes(path)
        check_state_dict({key: torch.empty(shape, device="meta") for key, shape in shapes.items()}, args,
                         str(path))
    elif fmt == "hf":
        check_args_match(args_from_hf_config(_read_json(_require_dir(path) / "config.json")), args, str(path))
    elif fmt == "meta":
        params = _read_json(_require_dir(path) / "params.json")
        check_args_match(args_from_meta_params(params, vocab_size=args.vocab_size), args, str(path))


def read_weights(
    fmt: str, path: str | Path, args: LlamaArgs | None = None
) -> tuple[LlamaArgs, StateDict]:
    """Our state dict from any format, checked against ``args`` (the model it will load into).

    ``args`` is required for ``torch`` files, which carry no config. For ``hf``/``meta`` the
    returned args are the checkpoint's; ``args`` adds the checks that its config (shapes,
    norm_eps, rope_theta) and its weights fit the model.
    """
    if fmt == "torch":
        if args is None:
            raise WeightsError("reading a torch state dict needs the model args (flavour)")
        state_dict = load_tensor_file(Path(path))
        check_state_dict(state_dict, args, str(path))
        return args, state_dict
    if fmt == "hf":
        file_args, state_dict = read_hf(path)
    elif fmt == "meta":
        file_args, state_dict = read_meta(path)
    else:
        raise WeightsError(f"unknown weights format {fmt!r} (expected one of {', '.join(FORMATS)})")
    if args is not None:
        check_args_match(file_args, args, str(path))
        check_state_dict(state_dict, args, str(path))
    return file_args, state_dict


def _contiguous(state_dict: StateDict) -> StateDict:
    return {key: t.contiguous() for key, t in state_dict.items()}


def write_hf(
    state_dict: StateDict, args: LlamaArgs, path: str | Path, max_shard_bytes: int = _HF_SHARD_BYTES
) -> None:
    """A directory that ``LlamaForCausalLM.from_pretrained`` loads."""
    path = Path(path)
    hf = _contiguous(llama_to_hf(state_dict, args))
    shards: list[StateDict] = [{}]
    shard_bytes = 0
    for key, t in hf.items():
        size = t.numel() * t.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][key] = t
        shard_bytes += size
    path.mkdir(parents=True, exist_ok=True)
    config = hf_config_from_args(args)
    config["torch_dtype"] = str(hf["lm_head.weight"].dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # "format": "pt" is what transformers checks before trusting a safetensors file.
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / name, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in hf.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_meta(
    state_dict: StateDict, args: LlamaArgs, path: str | Path, num_shards: int = 1
) -> None:
    """params.json + consolidated.NN.pth, split for ``num_shards`` model-parallel ranks."""
    path = Path(path)
    params = meta_params_from_args(args)
    shards = llama_to_meta(state_dict, args, num_shards)
    path.mkdir(parents=True, exist_ok=True)
    (path / "params.json").write_text(json.dumps(params, indent=2) + "\n")
    for i, shard in enumerate(shards):
        torch.save(shard, path / f"consolidated.{i:02d}.pth")


def write_torch(state_dict: StateDict, path: str | Path) -> None:
    """One file of our state dict: safetensors if the name ends in .safetensors, else torch.save."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        save_file(_contiguous(state_dict), path)
    else:
        torch.save(dict(state_dict), path)


def write_weights(
    fmt: str, state_dict: StateDict, args: LlamaArgs, path: str | Path, num_shards: int = 1
) -> None:
    """Write our state dict in ``fmt``; ``num_shards`` applies to ``meta`` only."""
    if fmt == "hf":
        write_hf(state_dict, args, path)
    elif fmt == "meta":
        write_meta(state_dict, args, path, num_shards)
    elif fmt == "torch":
        check_state_dict(state_dict, args)
        write_torch(state_dict, path)
    else:
        raise WeightsError(f"unknown weights format {fmt!r} (expected one of {', '.join(FORMATS)})")
