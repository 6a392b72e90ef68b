"""Map LLaMA-2 state dicts and configs between Hugging Face, Meta and this model.

Pure functions on dicts of tensors, no file access (see ``weight_files``), so any container
format (safetensors, torch.save, DCP) can sit in front of them. Our keys are Meta's keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .args import LlamaArgs, meta_ffn_hidden_dim
from .model import Transformer

StateDict = dict[str, torch.Tensor]


class WeightsError(ValueError):
    """Weights or their config do not fit the model. The message is one line naming the key/file."""


_HF_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Old transformers versions saved the rope table; like Meta's rope.freqs it is derived data.
_HF_IGNORED_SUFFIX = "rotary_emb.inv_freq"
_META_IGNORED = "rope.freqs"
_DEFAULT_ROPE_THETA = 10000.0
# Meta's FFN width rules of LLaMA-2 (7B/13B, then 70B), preferred when they fit a config.
_LLAMA2_FFN_RULES: tuple[tuple[int, float | None], ...] = ((256, None), (4096, 1.3))


def expected_shapes(args: LlamaArgs) -> dict[str, torch.Size]:
    """Our state dict's keys and shapes for ``args``, computed without allocating."""
    with torch.device("meta"):
        model = Transformer(args)
    return {key: tensor.shape for key, tensor in model.state_dict().items()}


def _check(
    state_dict: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size], where: str
) -> None:
    missing = [key for key in expected if key not in state_dict]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"{where}: missing key {missing[0]!r}{more}")
    unexpected = [key for key in state_dict if key not in expected]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise WeightsError(f"{where}: unexpected key {unexpected[0]!r}{more}")
    for key, shape in expected.items():
        actual = state_dict[key].shape
        if actual != shape:
            raise WeightsError(
                f"{where}: {key!r} has shape {tuple(actual)}, the model expects {tuple(shape)}"
            )


def check_state_dict(
    state_dict: Mapping[str, torch.Tensor], args: LlamaArgs, where: str = "weights"
) -> None:
    """Raise WeightsError unless ``state_dict`` has exactly our keys with the shapes of ``args``."""
    _check(state_dict, expected_shapes(args), where)


# What a config file fixes about the model, in the order a mismatch is reported.
# max_seq_len is left out: the rope table is recomputed for any length.
_CONFIG_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "norm_eps", "rope_theta")


def check_args_match(file_args: LlamaArgs, args: LlamaArgs, where: str) -> None:
    """Raise WeightsError naming the first hyperparameter where the weights' config and the model differ.

    Weights of the right shapes still make a different model under another rope_theta or
    norm_eps, so shapes alone are not enough.
    """
    for field in _CONFIG_FIELDS:
        ours, theirs = getattr(args, field), getattr(file_args, field)
        # Configs written through float32 carry eps like 9.999999747378752e-06 for 1e-5.
        if not math.isclose(theirs, ours, rel_tol=1e-6):
            raise WeightsError(
                f"{where}: {field} is {theirs} in the checkpoint, {ours} in the model"
            )


def hf_key(key: str) -> str:
    """Hugging Face name of one of our keys."""
    if key in _HF_TOP:
        return _HF_TOP[key]
    _, layer, module = key.removesuffix(".weight").split(".", 2)
    return f"model.layers.{layer}.{_HF_LAYER[module]}.weight"


def _hf_rotate_half_layout(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # Per head, rows (0, 1), (2, 3), ... are RoPE pairs in Meta's layout; HF's rotate_half pairs
    # row i with row i + head_dim/2. This is transformers' convert_llama_weights_to_hf.permute.
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _meta_pairwise_layout(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_to_llama(state_dict: Mapping[str, torch.Tensor], args: LlamaArgs) -> StateDict:
    """Hugging Face LlamaForCausalLM state dict -> ours (q/k rows back to Meta's pair layout)."""
    hf = {k: v for k, v in state_dict.items() if not k.endswith(_HF_IGNORED_SUFFIX)}
    shapes = expected_shapes(args)
    _check(hf, {hf_key(key): shape for key, shape in shapes.items()}, "Hugging Face weights")
    out = {}
    for key in shapes:
        w = hf[hf_key(key)]
        if key.endswith("attention.wq.weight"):
            w = _meta_pairwise_layout(w, args.n_heads)
        elif key.endswith("attention.wk.weight"):
            w = _meta_pairwise_layout(w, args.n_kv_heads)
        out[key] = w
    return out


def llama_to_hf(state_dict: Mapping[str, torch.Tensor], args: LlamaArgs) -> StateDict:
    """Our state dict -> Hugging Face LlamaForCausalLM (q/k rows in rotate-half layout)."""
    check_state_dict(state_dict, args)
    out = {}
    for key, w in state_dict.items():
        if key.endswith("attention.wq.weight"):
            w = _hf_rotate_half_layout(w, args.n_heads)
        elif key.endswith("attention.wk.weight"):
            w = _hf_rotate_half_layout(w, args.n_kv_heads)
        out[hf_key(key)] = w
    return out


def _meta_shard_dim(key: str) -> int | None:
    """Dim along which Meta's model-parallel shards split a tensor; None if replicated."""
    if key.endswith("norm.weight"):
        return None
    if key == "tok_embeddings.weight" or key.endswith(
        ("attention.wo.weight", "feed_forward.w2.weight")
    ):
        return 1
    return 0


def meta_to_llama(shards: Sequence[Mapping[str, torch.Tensor]], args: LlamaArgs) -> StateDict:
    """Meta ``consolidated.NN.pth`` contents (in shard order) -> one full state dict of ours."""
    if not shards:
        raise WeightsError("no consolidated.*.pth shards given")
    keys = [key for key in shards[0] if key != _META_IGNORED]
    out = {}
    for key in keys:
        parts = [shard.get(key) for shard in shards]
        if any(part is None for part in parts):
            raise WeightsError(f"Meta weights: key {key!r} is missing from some shards")
        dim = _meta_shard_dim(key)
        if dim is None or len(parts) == 1:
            out[key] = parts[0]
            continue
        if any(part.shape != parts[0].shape for part in parts):
            raise WeightsError(f"Meta weights: shards of {key!r} differ in shape")
        out[key] = torch.cat(parts, dim=dim)
    check_state_dict(out, args, "Meta weights")
    return out


def llama_to_meta(
    state_dict: Mapping[str, torch.Tensor], args: LlamaArgs, num_shards: int = 1
) -> list[StateDict]:
    """Our state dict -> ``num_shards`` Meta consolidated shards (model-parallel split)."""
    check_state_dict(state_dict, args)
    shards: list[StateDict] = [{} for _ in range(num_shards)]
    for key, w in state_dict.items():
        dim = _meta_shard_dim(key)
        if dim is None or num_shards == 1:
            parts = [w] * num_shards
        elif w.shape[dim] % num_shards:
            raise WeightsError(
                f"{key!r}: dim {dim} of size {w.shape[dim]} does not split into {num_shards} shards"
            )
        else:
            # clone: torch.save of a view would write the whole underlying tensor into every shard.
            parts = [part.clone() for part in w.chunk(num_shards, dim=dim)]
        for shard, part in zip(shards, parts):
            shard[key] = part
    return shards


def _require_ints(config: Mapping[str, Any], keys: Sequence[str], where: str) -> None:
    for key in keys:
        if key not in config:
            raise WeightsError(f"{where}: missing {key!r}")
        if not isinstance(config[key], int) or config[key] <= 0:
            raise WeightsError(f"{where}: {key!r} must be a positive integer, got {config[key]!r}")


def _make_args(where: str, **kwargs: Any) -> LlamaArgs:
    try:
        return LlamaArgs(**kwargs)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise WeightsError(f"{where}: {e}") from None


def args_from_meta_params(params: Mapping[str, Any], vocab_size: int | None = None) -> LlamaArgs:
    """LlamaArgs from Meta's params.json. ``vocab_size`` fills in params' -1 (take it from the weights)."""
    if params.get("use_scaled_rope"):
        raise WeightsError("params.json: use_scaled_rope (LLaMA-3.1 rope scaling) is not supported")
    _require_ints(params, ("dim", "n_layers", "n_heads"), "params.json")
    vocab = params.get("vocab_size", -1)
    if vocab == -1:
        if vocab_size is None:
            raise WeightsError("params.json: vocab_size is -1 and no weights to take it from")
        vocab = vocab_size
    return _make_args(
        "params.json",
        dim=params["dim"],
        n_layers=params["n_layers"],
        n_heads=params["n_heads"],
        n_kv_heads=params.get("n_kv_heads"),
        vocab_size=vocab,
        multiple_of=params.get("multiple_of", 256),
        ffn_dim_multiplier=params.get("ffn_dim_multiplier"),
        norm_eps=params.get("norm_eps", 1e-5),
        rope_theta=params.get("rope_theta", _DEFAULT_ROPE_THETA),
    )


def meta_params_from_args(args: LlamaArgs) -> dict[str, Any]:
    """Meta params.json for ``args`` (keys Meta's LLaMA-2 ModelArgs accepts)."""
    params: dict[str, Any] = {
        "dim": args.dim,
        "multiple_of": args.multiple_of,
        "n_heads": args.n_heads,
        "n_layers": args.n_layers,
        "norm_eps": args.norm_eps,
        "vocab_size": args.vocab_size,
    }
    if args.n_kv_heads != args.n_heads:
        params["n_kv_heads"] = args.n_kv_heads
    if args.ffn_dim_multiplier is not None:
        params["ffn_dim_multiplier"] = args.ffn_dim_multiplier
    # LLaMA-2's ModelArgs has no rope_theta field; only write it where it matters (Code Llama).
    if args.rope_theta != _DEFAULT_ROPE_THETA:
        params["rope_theta"] = args.rope_theta
    return params


def _hf_rope_theta(config: Mapping[str, Any]) -> float:
    # transformers < 5 writes rope_theta (+ rope_scaling); >= 5 writes rope_parameters.
    rope_parameters = config.get("rope_parameters") or {}
    if config.get("rope_scaling") or rope_parameters.get("rope_type", "default") != "default":
        raise WeightsError("config.json: rope scaling is not supported")
    return float(config.get("rope_theta", rope_parameters.get("rope_theta", _DEFAULT_ROPE_THETA)))


def _ffn_rule_for(dim: int, hidden_dim: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) for which Meta's rule gives ``hidden_dim``."""
    for multiple_of, multiplier in _LLAMA2_FFN_RULES:
        if meta_ffn_hidden_dim(dim, multiple_of, multiplier) == hidden_dim:
            return multiple_of, multiplier
    # Any width is reached by rounding up to itself, after scaling down if narrower than 8/3 dim.
    base = int(2 * 4 * dim / 3)
    return hidden_dim, None if base <= hidden_dim else hidden_dim / base


def args_from_hf_config(config: Mapping[str, Any]) -> LlamaArgs:
    """LlamaArgs from a Hugging Face LlamaForCausalLM config.json."""
    if config.get("model_type", "llama") != "llama":
        raise WeightsError(f"config.json: model_type {config['model_type']!r} is not 'llama'")
    if config.get("hidden_act", "silu") != "silu":
        raise WeightsError(f"config.json: hidden_act {config['hidden_act']!r} is not supported")
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if config.get(key):
            raise WeightsError(f"config.json: {key}=true is not supported")
    _require_ints(
        config,
        (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
            "intermediate_size",
        ),
        "config.json",
    )
    dim = config["hidden_size"]
    multiple_of, ffn_dim_multiplier = _ffn_rule_for(dim, config["intermediate_size"])
    args = _make_args(
        "config.json",
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads"),
        vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=_hf_rope_theta(config),
        max_seq_len=config.get("max_position_embeddings", 4096),
        multiple_of=multiple_of,
        ffn_dim_multiplier=ffn_dim_multiplier,
    )
    if config.get("head_dim") not in (None, args.head_dim):
        raise WeightsError(
            f"config.json: head_dim {config['head_dim']} is not hidden_size / num_attention_heads"
        )
    return args


def hf_config_from_args(args: LlamaArgs) -> dict[str, Any]:
    """config.json for LlamaForCausalLM (readable by transformers 4.x and 5.x)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
    }
