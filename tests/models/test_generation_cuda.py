"""Generation on a GPU: the CUDA-graph decode step, eager and compiled, gives the recompute
reference's tokens in bf16, and replays without running the step's Python. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from models.llama import static_decoder
from models.llama.generation import generate, generate_without_cache
from tests.models.test_generation import PROMPTS, debug_model, eos_mid_way

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def cuda_model(dtype: torch.dtype) -> torch.nn.Module:
    model = debug_model(n_layers=4).to("cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return model


def count_step_runs(monkeypatch) -> list[int]:
    """Appends to the returned list whenever the decode step's Python runs (not on replays)."""
    runs: list[int] = []
    step = static_decoder.StaticDecoder._decode_step
    monkeypatch.setattr(static_decoder.StaticDecoder, "_decode_step", lambda self, *a: runs.append(1) or step(self, *a))
    return runs


@pytest.mark.parametrize("compile_decode", [False, True])
def test_cuda_graph_greedy_equals_recompute_float32(monkeypatch, compile_decode: bool) -> None:
    model = cuda_model(torch.float32)
    eos = eos_mid_way(model, 0, 10)
    reference = generate_without_cache(model, PROMPTS, max_new_tokens=40, eos_id=eos)
    assert len(reference[0]) == 10 and max(len(o) for o in reference) == 40
    runs = count_step_runs(monkeypatch)
    kwargs = {"compile_decode": compile_decode, "cuda_graph": True, "batch_size": 4}
    assert generate(model, PROMPTS, max_new_tokens=40, eos_id=eos, **kwargs) == reference
    assert generate(model, PROMPTS[::-1], max_new_tokens=40, eos_id=eos, **kwargs) == reference[::-1]
    # The step's Python ran for the warm-up and the capture only: 4 batches of up to 40 tokens replayed.
    assert len(runs) == static_decoder.WARMUP_STEPS + 1


def first_difference_is_a_near_tie(model, prompt: list[int], got: list[int], want: list[int], eos: int) -> float:
    """Where two greedy continuations first part, the reference logits' gap between their picks."""
    k = next(i for i in range(len(want) + 1) if i == len(got) or i == len(want) or got[i] != want[i])
    picks = [got[k] if k < len(got) else eos, want[k] if k < len(want) else eos]
    logits = model(torch.tensor([prompt + want[:k]], device="cuda"))[0, -1].float()
    return (logits[picks[0]] - logits[picks[1]]).abs().item()


@pytest.mark.parametrize("compile_decode", [False, True])
def test_cuda_graph_greedy_bf16_equals_recompute_up_to_rounding_ties(compile_decode: bool) -> None:
    """In bf16 a different prompt padding changes the GEMM tiling and so the rounding: where the top two
    logits are that close, the cache and the recompute reference may pick differently. Anywhere else
    they must agree (a wrong slot or mask changes the logits by far more)."""
    model = cuda_model(torch.bfloat16)
    eos = eos_mid_way(model, 0, 10)
    kwargs = {"compile_decode": compile_decode, "cuda_graph": True, "batch_size": 4}
    for prompts in (PROMPTS, PROMPTS[::-1]):
        reference = generate_without_cache(model, prompts, max_new_tokens=40, eos_id=eos)
        got = generate(model, prompts, max_new_tokens=40, eos_id=eos, **kwargs)
        differing = [(p, g, w) for p, g, w in zip(prompts, got, reference) if g != w]
        gaps = [first_difference_is_a_near_tie(model, p, g, w, eos) for p, g, w in differing]
        assert all(gap < 0.1 for gap in gaps), gaps


def test_cuda_graph_sampling_equals_recompute() -> None:
    model = cuda_model(torch.float32)

    def sampled(fn, **kwargs) -> list[list[int]]:
        gen = torch.Generator().manual_seed(3)
        return fn(model, PROMPTS, max_new_tokens=16, eos_id=2, temperature=0.8, top_p=0.9, generator=gen, **kwargs)

    reference = sampled(generate_without_cache)
    assert reference != generate_without_cache(model, PROMPTS, max_new_tokens=16, eos_id=2)
    assert sampled(generate, compile_decode=True, cuda_graph=True, batch_size=4) == reference
