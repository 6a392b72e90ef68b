"""KV-cache generation: token for token what recomputing the whole sequence gives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.llama import LLAMA2_FLAVORS, Transformer
from models.llama.generation import generate, generate_without_cache
from scripts import generate as generate_script

# Left padding of up to 30 slots, an empty prompt (no output) and a one-token prompt.
PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 3, 3, 3, 3, 3, 8], [], [1], [1, *range(10, 40)]]


def debug_model(n_layers: int = 2, max_seq_len: int = 2048) -> Transformer:
    torch.manual_seed(0)
    args = dataclasses.replace(LLAMA2_FLAVORS["debug"], n_layers=n_layers, max_seq_len=max_seq_len)
    model = Transformer(args).eval()
    with torch.no_grad():
        model.init_weights()
        # Sharper attention than the init's: a wrong cache slot or mask changes the tokens.
        model.tok_embeddings.weight.mul_(20)
    return model


def test_greedy_with_cache_equals_recompute_batched_and_alone() -> None:
    model = debug_model()
    reference = generate_without_cache(model, PROMPTS, max_new_tokens=24, eos_id=2)
    assert [len(o) for o in reference] == [24, 24, 24, 0, 24, 24]
    assert generate(model, PROMPTS, max_new_tokens=24, eos_id=2) == reference
    assert [generate(model, [p], max_new_tokens=24, eos_id=2)[0] for p in PROMPTS] == reference


def test_eos_and_max_seq_len_stop_rows_as_without_cache() -> None:
    model = debug_model(max_seq_len=24)
    # Pick as EOS a token the first prompt generates at its 3rd step: that row stops early
    # while the others go on until max_seq_len (24 - 7 = 17 new tokens for the 7-token prompt).
    eos = generate_without_cache(model, PROMPTS[:1], max_new_tokens=3, eos_id=-1)[0][2]
    reference = generate_without_cache(model, PROMPTS, max_new_tokens=40, eos_id=eos)
    assert len(reference[0]) == 2 and len(reference[2]) <= 17 and reference[5] == []
    assert generate(model, PROMPTS, max_new_tokens=40, eos_id=eos) == reference


def test_sampling_draws_the_same_tokens_with_and_without_cache() -> None:
    model = debug_model()

    def sampled(fn) -> list[list[int]]:
        gen = torch.Generator().manual_seed(3)
        return fn(model, PROMPTS, max_new_tokens=12, eos_id=2, temperature=0.8, top_p=0.9, generator=gen)

    assert sampled(generate) == sampled(generate_without_cache)


def test_compiled_decode_step_equals_eager() -> None:
    torch._dynamo.reset()
    model = debug_model()
    eager = generate(model, PROMPTS, max_new_tokens=16, eos_id=2)
    assert generate(model, PROMPTS, max_new_tokens=16, eos_id=2, compile_decode=True) == eager


@pytest.mark.parametrize(("argv", "message"), [
    (["--compile", "--no_kv_cache"], "--compile compiles the KV-cache decode step"),
    (["--max_new_tokens", "0"], "--max_new_tokens must be positive"),
])
def test_generate_flags_bad_input_is_one_line(capsys, argv: list[str], message: str) -> None:
    assert generate_script.main(["--config", "configs/debug.toml", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
