"""Weight import/export: Meta layout, args conversion and error reporting (no transformers)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from models.llama import LLAMA2_FLAVORS, LlamaArgs, Transformer
from models.llama.weight_conversion import (
    WeightsError,
    args_from_hf_config,
    args_from_meta_params,
    hf_config_from_args,
    hf_to_llama,
    llama_to_hf,
    llama_to_meta,
    meta_params_from_args,
    meta_to_llama,
)
from models.llama.weight_files import read_weights, write_weights

TINY = LlamaArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=64
)


def random_state_dict(args: LlamaArgs = TINY) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: torch.randn_like(v) for k, v in Transformer(args).state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_meta_two_shard_split_follows_model_parallel_dims() -> None:
    sd = random_state_dict()
    shards = llama_to_meta(sd, TINY, num_shards=2)
    half = TINY.dim // 2
    # Column-parallel: rows split; row-parallel and embeddings: columns split; norms replicated.
    assert torch.equal(
        shards[1]["layers.0.attention.wq.weight"], sd["layers.0.attention.wq.weight"][half:]
    )
    assert torch.equal(
        shards[1]["layers.1.feed_forward.w1.weight"],
        sd["layers.1.feed_forward.w1.weight"][TINY.hidden_dim // 2 :],
    )
    assert torch.equal(shards[1]["output.weight"], sd["output.weight"][TINY.vocab_size // 2 :])
    assert torch.equal(
        shards[1]["layers.0.attention.wo.weight"], sd["layers.0.attention.wo.weight"][:, half:]
    )
    assert torch.equal(
        shards[0]["layers.0.feed_forward.w2.weight"],
        sd["layers.0.feed_forward.w2.weight"][:, : TINY.hidden_dim // 2],
    )
    assert torch.equal(shards[1]["tok_embeddings.weight"], sd["tok_embeddings.weight"][:, half:])
    assert torch.equal(shards[1]["layers.0.ffn_norm.weight"], sd["layers.0.ffn_norm.weight"])
    # Shards own compact storage, so saving one does not write the whole tensor.
    wq = shards[0]["layers.0.attention.wq.weight"]
    assert wq.untyped_storage().nbytes() == wq.numel() * wq.element_size()

    for shard in shards:
        shard["rope.freqs"] = torch.randn(TINY.head_dim // 2)
    assert_same(meta_to_llama(shards, TINY), sd)


def test_meta_directory_round_trip(tmp_path: Path) -> None:
    sd = random_state_dict()
    write_weights("meta", sd, TINY, tmp_path / "meta", num_shards=2)
    assert sorted(p.name for p in (tmp_path / "meta").iterdir()) == [
        "consolidated.00.pth",
        "consolidated.01.pth",
        "params.json",
    ]
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    assert params["n_kv_heads"] == 2 and "rope_theta" not in params
    args, loaded = read_weights("meta", tmp_path / "meta", TINY)
    assert args.hidden_dim == TINY.hidden_dim and args.n_kv_heads == TINY.n_kv_heads
    assert_same(loaded, sd)


def test_torch_file_round_trip(tmp_path: Path) -> None:
    sd = random_state_dict()
    for name in ("model.pt", "model.safetensors"):
        write_weights("torch", sd, TINY, tmp_path / name)
        _, loaded = read_weights("torch", tmp_path / name, TINY)
        assert_same(loaded, sd)


@pytest.mark.parametrize("flavor", ["7B", "13B", "70B"])
def test_meta_params_json_of_llama2(flavor: str) -> None:
    # What Meta ships: vocab_size -1 (taken from the weights), no rope_theta, no max_seq_len.
    shipped = {
        "7B": {
            "dim": 4096,
            "multiple_of": 256,
            "n_heads": 32,
            "n_layers": 32,
            "norm_eps": 1e-05,
            "vocab_size": -1,
        },
        "13B": {
            "dim": 5120,
            "multiple_of": 256,
            "n_heads": 40,
            "n_layers": 40,
            "norm_eps": 1e-05,
            "vocab_size": -1,
        },
        "70B": {
            "dim": 8192,
            "multiple_of": 4096,
            "ffn_dim_multiplier": 1.3,
            "n_heads": 64,
            "n_kv_heads": 8,
            "n_layers": 80,
            "norm_eps": 1e-05,
            "vocab_size": -1,
        },
    }[flavor]
    args = args_from_meta_params(shipped, vocab_size=32000)
    assert args == LLAMA2_FLAVORS[flavor]
    assert meta_params_from_args(args) == {**shipped, "vocab_size": 32000}
    with pytest.raises(WeightsError, match="vocab_size"):
        args_from_meta_params(shipped)


@pytest.mark.parametrize("flavor", ["7B", "70B", "debug"])
def test_hf_config_round_trip(flavor: str) -> None:
    args = LLAMA2_FLAVORS[flavor]
    assert args_from_hf_config(hf_config_from_args(args)) == args


@pytest.mark.parametrize(
    ("flavor", "shape"),
    [("7B", (4096, 11008, 32, 32, 32)), ("70B", (8192, 28672, 64, 8, 80))],
)
def test_shipped_llama2_hf_config(flavor: str, shape: tuple[int, ...]) -> None:
    hidden, intermediate, heads, kv_heads, layers = shape
    # meta-llama/Llama-2-*-hf config.json as published (transformers 4.31).
    config = {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "use_cache": True,
        "vocab_size": 32000,
    }
    assert args_from_hf_config(config) == LLAMA2_FLAVORS[flavor]


def test_unsupported_hf_config_is_named() -> None:
    config = hf_config_from_args(TINY)
    with pytest.raises(WeightsError, match="rope scaling"):
        args_from_hf_config({**config, "rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(WeightsError, match="missing 'num_hidden_layers'"):
        args_from_hf_config({k: v for k, v in config.items() if k != "num_hidden_layers"})
    with pytest.raises(WeightsError, match="n_heads 4 is not divisible by n_kv_heads 3"):
        args_from_hf_config({**config, "num_key_value_heads": 3})


def test_hf_config_with_unusual_ffn_width_keeps_the_width() -> None:
    config = {**hf_config_from_args(TINY), "intermediate_size": 100}
    args = args_from_hf_config(config)
    assert args.hidden_dim == 100
    assert args_from_meta_params(meta_params_from_args(args)).hidden_dim == 100


def test_hf_permutation_round_trip_changes_q_and_k_only() -> None:
    sd = random_state_dict()
    hf = llama_to_hf(sd, TINY)
    assert not torch.equal(
        hf["model.layers.0.self_attn.q_proj.weight"], sd["layers.0.attention.wq.weight"]
    )
    assert not torch.equal(
        hf["model.layers.0.self_attn.k_proj.weight"], sd["layers.0.attention.wk.weight"]
    )
    assert torch.equal(
        hf["model.layers.0.self_attn.v_proj.weight"], sd["layers.0.attention.wv.weight"]
    )
    assert torch.equal(
        hf["model.layers.1.mlp.gate_proj.weight"], sd["layers.1.feed_forward.w1.weight"]
    )
    assert torch.equal(
        hf["model.layers.1.mlp.up_proj.weight"], sd["layers.1.feed_forward.w3.weight"]
    )
    assert torch.equal(hf["lm_head.weight"], sd["output.weight"])
    assert_same(hf_to_llama(hf, TINY), sd)


def test_missing_hf_key_is_named() -> None:
    hf = llama_to_hf(random_state_dict(), TINY)
    del hf["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(
        WeightsError, match=r"missing key 'model\.layers\.1\.mlp\.down_proj\.weight'"
    ):
        hf_to_llama(hf, TINY)


def test_wrong_shape_is_named() -> None:
    hf = llama_to_hf(random_state_dict(), TINY)
    bigger = dataclasses.replace(TINY, vocab_size=256)
    with pytest.raises(WeightsError, match=r"'model\.embed_tokens\.weight' has shape \(128, 64\)"):
        hf_to_llama(hf, bigger)


def test_unexpected_key_is_named() -> None:
    sd = random_state_dict()
    sd["layers.0.attention.bias"] = torch.zeros(3)
    with pytest.raises(WeightsError, match=r"unexpected key 'layers\.0\.attention\.bias'"):
        llama_to_hf(sd, TINY)


def test_missing_files_and_dirs(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="directory not found"):
        read_weights("hf", tmp_path / "nope")
    with pytest.raises(WeightsError, match=r"config\.json: file not found"):
        read_weights("hf", tmp_path)
    (tmp_path / "params.json").write_text(json.dumps(meta_params_from_args(TINY)))
    with pytest.raises(WeightsError, match=r"no consolidated\.\*\.pth"):
        read_weights("meta", tmp_path)
    with pytest.raises(WeightsError, match="file not found"):
        read_weights("torch", tmp_path / "model.pt", TINY)


def test_heads_mismatch_with_target_model(tmp_path: Path) -> None:
    write_weights("meta", random_state_dict(), TINY, tmp_path)
    other = dataclasses.replace(TINY, n_heads=8, n_kv_heads=4)
    with pytest.raises(WeightsError, match="n_heads is 4 in the checkpoint, 8 in the model"):
        read_weights("meta", tmp_path, other)


@pytest.mark.parametrize("fmt", ["hf", "meta"])
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dim": 128}, "dim is 128 in the checkpoint, 64 in the model"),
        ({"n_layers": 3}, "n_layers is 3 in the checkpoint, 2 in the model"),
        ({"n_kv_heads": 4}, "n_kv_heads is 4 in the checkpoint, 2 in the model"),
        ({"vocab_size": 256}, "vocab_size is 256 in the checkpoint, 128 in the model"),
        ({"ffn_dim_multiplier": 1.5}, "hidden_dim is 256 in the checkpoint, 192 in the model"),
        ({"norm_eps": 1e-6}, "norm_eps is 1e-06 in the checkpoint, 1e-05 in the model"),
        ({"rope_theta": 500000.0}, "rope_theta is 500000.0 in the checkpoint, 10000.0 in the model"),
    ],
)
def test_config_mismatch_with_target_model_is_named(
    tmp_path: Path, fmt: str, change: dict[str, float], message: str
) -> None:
    # Same-shaped weights under another norm_eps or rope_theta are still another model.
    theirs = dataclasses.replace(TINY, **change)
    write_weights(fmt, random_state_dict(theirs), theirs, tmp_path)
    with pytest.raises(WeightsError, match=rf"^{tmp_path}: {message}$"):
        read_weights(fmt, tmp_path, TINY)


def test_config_eps_rounded_through_float32_still_matches(tmp_path: Path) -> None:
    write_weights("hf", random_state_dict(), TINY, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 9.999999747378752e-06}))
    read_weights("hf", tmp_path, TINY)


class NotATensor:
    pass


def test_pickled_objects_are_refused(tmp_path: Path) -> None:
    torch.save({"tok_embeddings.weight": NotATensor()}, tmp_path / "evil.pt")
    with pytest.raises(WeightsError, match="refusing to unpickle"):
        read_weights("torch", tmp_path / "evil.pt", TINY)


@pytest.mark.parametrize("name", ["model.pt", "model.safetensors"])
def test_corrupt_file_is_named(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_bytes(b"not a checkpoint" * 10)
    with pytest.raises(WeightsError, match=rf"{name}: cannot read weights \(.+\)$"):
        read_weights("torch", tmp_path / name, TINY)


def test_weights_of_an_integer_dtype_are_refused_naming_tensor_and_file(tmp_path: Path) -> None:
    sd = random_state_dict()
    sd["layers.1.attention.wk.weight"] = sd["layers.1.attention.wk.weight"].to(torch.int8)
    write_weights("hf", sd, TINY, tmp_path / "hf")
    with pytest.raises(WeightsError) as error:
        read_weights("hf", tmp_path / "hf", TINY)
    assert str(error.value) == (f"{tmp_path / 'hf' / 'model.safetensors'}: 'model.layers.1.self_attn.k_proj.weight' "
                                "is int8, not a weight dtype (float32, bfloat16, float16, float64)")
    write_weights("torch", {k: v.to(torch.bool) for k, v in random_state_dict().items()}, TINY, tmp_path / "w.pt")
    with pytest.raises(WeightsError, match=r"w\.pt: 'tok_embeddings\.weight' is bool, not a weight dtype"):
        read_weights("torch", tmp_path / "w.pt", TINY)


def test_a_tensor_in_two_hf_files_is_refused_naming_both(tmp_path: Path) -> None:
    """A stray *.safetensors beside the model (no index) would otherwise replace its tensors by name order."""
    from safetensors.torch import load_file, save_file

    write_weights("hf", random_state_dict(), TINY, tmp_path)
    layer = {k: v for k, v in load_file(tmp_path / "model.safetensors").items() if ".layers.1." in k}
    save_file({k: torch.zeros_like(v) for k, v in layer.items()}, tmp_path / "zz-old.safetensors")
    with pytest.raises(WeightsError) as error:
        read_weights("hf", tmp_path, TINY)
    first = sorted(layer)[0]
    assert str(error.value) == (f"{tmp_path}: {first!r} is in both model.safetensors and zz-old.safetensors; "
                                "remove the file that does not belong to the model")
