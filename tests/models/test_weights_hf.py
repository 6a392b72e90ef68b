"""Hugging Face interop against transformers' own LlamaForCausalLM (same logits both ways)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.llama import LlamaArgs, Transformer
from models.llama.weight_conversion import hf_config_from_args
from models.llama.weight_files import load_tensor_file, read_weights, write_hf
from scripts.convert_weights import main as convert_weights

transformers = pytest.importorskip("transformers")

TINY = LlamaArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=64
)


def randomize_(model: torch.nn.Module) -> None:
    # Default inits give near-zero logits; large random weights make every mapping error visible.
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 1.0 if "embed" in name else 0.1)


def hf_logits(model: torch.nn.Module, tokens: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False, **kwargs).logits


@pytest.mark.slow
def test_import_from_transformers_gives_same_logits(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**hf_config_from_args(TINY))
    hf = transformers.LlamaForCausalLM(config).float().eval()
    randomize_(hf)
    # What a user does: transformers writes the folder, the script converts it.
    hf.save_pretrained(tmp_path / "hf")
    argv = ["--from", "hf", "--to", "torch", str(tmp_path / "hf"), str(tmp_path / "ours.safetensors")]
    assert convert_weights(argv) == 0
    ours = Transformer(TINY).eval()
    ours.load_state_dict(load_tensor_file(tmp_path / "ours.safetensors"))

    tokens = torch.randint(0, TINY.vocab_size, (2, 20))
    # Offsets only: transformers 5 reads any other jump in position_ids as a new packed document.
    position_ids = torch.stack([torch.arange(20) + 7, torch.arange(20) + 30])
    with torch.no_grad():
        ref = hf_logits(hf, tokens)
        torch.testing.assert_close(ours(tokens), ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            ours(tokens, position_ids=position_ids),
            hf_logits(hf, tokens, position_ids=position_ids),
            atol=1e-4,
            rtol=1e-4,
        )
    assert ref.std() > 0.3


@pytest.mark.parametrize("max_shard_bytes", [2**30, 100_000])
def test_export_loads_in_transformers(tmp_path: Path, max_shard_bytes: int) -> None:
    ours = Transformer(TINY).eval()
    randomize_(ours)
    write_hf(ours.state_dict(), TINY, tmp_path, max_shard_bytes=max_shard_bytes)
    sharded = (tmp_path / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_bytes < 2**30)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float32"

    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).float().eval()
    tokens = torch.randint(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(hf, tokens), ours(tokens), atol=1e-4, rtol=1e-4)

    args, loaded = read_weights("hf", tmp_path, TINY)
    assert args.hidden_dim == TINY.hidden_dim and args.n_kv_heads == TINY.n_kv_heads
    for key, value in ours.state_dict().items():
        assert torch.equal(loaded[key], value), key
