"""KV-cache generation: token for token what recomputing the whole sequence gives, in fixed
batches, across prompt buckets, eager and compiled; the stop check and the compile counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from models.llama import LLAMA2_FLAVORS, Transformer, static_decoder
from models.llama.generation import STOP_CHECK_EVERY, generate, generate_without_cache
from scripts import generate as generate_script

# Left padding of up to 30 slots, an empty prompt (no output), a one-token prompt, and a
# 40-token prompt: prefill widths 32 and 64 when decoded 4 at a time.
PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 3, 3, 3, 3, 3, 8], [], [1], [1, *range(10, 40)], [1, *range(100, 139)]]


def debug_model(n_layers: int = 2, max_seq_len: int = 2048) -> Transformer:
    torch.manual_seed(0)
    args = dataclasses.replace(LLAMA2_FLAVORS["debug"], n_layers=n_layers, max_seq_len=max_seq_len)
    model = Transformer(args).eval()
    with torch.no_grad():
        model.init_weights()
        # Sharper attention than the init's: a wrong cache slot or mask changes the tokens.
        model.tok_embeddings.weight.mul_(20)
    return model


def eos_mid_way(model: Transformer, row: int, at: int) -> int:
    """A token that PROMPTS[row] generates greedily at step ``at`` (and not before)."""
    tokens = generate_without_cache(model, PROMPTS[row : row + 1], max_new_tokens=at + 1, eos_id=-1)[0]
    assert tokens[at] not in tokens[:at], tokens
    return tokens[at]


@pytest.mark.slow
def test_greedy_with_cache_equals_recompute_batched_and_alone() -> None:
    model = debug_model()
    reference = generate_without_cache(model, PROMPTS, max_new_tokens=24, eos_id=2)
    assert [len(o) for o in reference] == [24, 24, 24, 0, 24, 24, 24]
    assert generate(model, PROMPTS, max_new_tokens=24, eos_id=2) == reference
    assert generate(model, PROMPTS, max_new_tokens=24, eos_id=2, batch_size=4) == reference
    assert [generate(model, [p], max_new_tokens=24, eos_id=2)[0] for p in PROMPTS] == reference


def test_eos_and_max_seq_len_stop_rows_as_without_cache() -> None:
    model = debug_model(max_seq_len=24)
    # Pick as EOS a token the first prompt generates at its 3rd step: that row stops early
    # while the others go on until max_seq_len (24 - 7 = 17 new tokens for the 7-token prompt).
    eos = eos_mid_way(model, 0, 2)
    reference = generate_without_cache(model, PROMPTS, max_new_tokens=40, eos_id=eos)
    assert len(reference[0]) == 2 and len(reference[2]) <= 17 and reference[5] == reference[6] == []
    assert generate(model, PROMPTS, max_new_tokens=40, eos_id=eos) == reference
    assert generate(model, PROMPTS, max_new_tokens=40, eos_id=eos, batch_size=2) == reference


@pytest.mark.slow
def test_eos_mid_way_in_fixed_batches_keeps_the_other_rows_going() -> None:
    model = debug_model()
    # Row 0 ends at its 11th token, between two stop checks; the rows beside it continue.
    eos = eos_mid_way(model, 0, 10)
    reference = generate_without_cache(model, PROMPTS, max_new_tokens=20, eos_id=eos)
    assert len(reference[0]) == 10 and max(len(o) for o in reference) == 20, [len(o) for o in reference]
    assert generate(model, PROMPTS, max_new_tokens=20, eos_id=eos, batch_size=4) == reference
    assert generate(model, PROMPTS, max_new_tokens=20, eos_id=eos, batch_size=3) == reference


def test_decoding_stops_at_the_first_stop_check_after_every_row_ended(monkeypatch) -> None:
    model = debug_model()
    eos = eos_mid_way(model, 0, 2)
    reference = generate_without_cache(model, PROMPTS[:1], max_new_tokens=100, eos_id=eos)
    steps = []
    decode = static_decoder.StaticDecoder.decode
    monkeypatch.setattr(static_decoder.StaticDecoder, "decode", lambda self, *a: steps.append(1) or decode(self, *a))
    assert generate(model, PROMPTS[:1], max_new_tokens=100, eos_id=eos) == reference and len(reference[0]) == 2
    # Token 0 comes from the prefill; the host looks after STOP_CHECK_EVERY tokens, not 100.
    assert len(steps) == STOP_CHECK_EVERY - 1


@pytest.mark.slow
def test_sampling_draws_the_same_tokens_with_and_without_cache() -> None:
    model = debug_model()

    def sampled(fn, **kwargs) -> list[list[int]]:
        gen = torch.Generator().manual_seed(3)
        return fn(model, PROMPTS, max_new_tokens=12, eos_id=2, temperature=0.8, top_p=0.9, generator=gen, **kwargs)

    reference = sampled(generate_without_cache)
    greedy = generate_without_cache(model, PROMPTS, max_new_tokens=12, eos_id=2)
    assert reference != greedy and all(len(o) == 12 for o in reference if o)
    assert sampled(generate) == reference
    assert sampled(generate, batch_size=4) == reference


@pytest.mark.slow
def test_compiled_decode_step_equals_recompute() -> None:
    torch._dynamo.reset()
    model = debug_model()
    # Two inductor graphs (the decode step and one prefill bucket): compiling is the slow part.
    reference = generate_without_cache(model, PROMPTS[:6], max_new_tokens=20, eos_id=2)
    assert generate(model, PROMPTS[:6], max_new_tokens=20, eos_id=2, compile_decode=True) == reference


@pytest.mark.slow
def test_decode_compiles_once_and_prefill_once_per_bucket() -> None:
    torch._dynamo.reset()
    model = debug_model()
    eos = eos_mid_way(model, 0, 10)
    reference = generate_without_cache(model, PROMPTS, max_new_tokens=20, eos_id=eos)
    # dynamo's graphs are what counts here; the eager backend skips inductor's code generation.
    for prompts in (PROMPTS, PROMPTS[::-1]):
        expected = reference if prompts is PROMPTS else reference[::-1]
        assert generate(model, prompts, max_new_tokens=20, eos_id=eos, compile_decode="eager", batch_size=4) == expected
    # One decode graph for all layers and all tokens of both calls; one prefill graph per
    # prompt bucket (32 and 64).
    assert len(_debug_get_cache_entry_list(static_decoder._decode_block.__code__)) == 1
    assert len(_debug_get_cache_entry_list(static_decoder._prefill_block.__code__)) == 2


def test_prompt_buckets() -> None:
    assert [static_decoder.prompt_bucket(n) for n in (1, 31, 32, 33, 64, 65, 1000)] == [32, 32, 32, 64, 64, 128, 1024]


@pytest.mark.parametrize(("argv", "message"), [
    (["--compile", "--no_kv_cache"], "--compile compiles the KV-cache decode step"),
    (["--compile", "--eager"], "--eager and --compile"),
    (["--max_new_tokens", "0"], "--max_new_tokens must be positive"),
])
def test_generate_flags_bad_input_is_one_line(capsys, argv: list[str], message: str) -> None:
    assert generate_script.main(["--config", "configs/debug.toml", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
