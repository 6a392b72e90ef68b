"""Autoregressive generation: batched decoding from a static KV cache, and the
recompute-everything reference it must agree with.

Batches are left-padded: row i of width W holds ``W - n_i`` padding slots, then its prompt.
Each row's RoPE positions restart at its first token and its padding is a document of its
own, so every row computes what it would alone. ``generate`` decodes ``batch_size`` prompts
at a time with a ``StaticDecoder`` (models/llama/static_decoder.py): every batch has the
same shapes (the last one is filled with dummy rows), the prompt width is padded to a
bucket, and the tokens stay on the device, the host looking at them only every
``STOP_CHECK_EVERY`` tokens to stop once every row has ended. Rows go on decoding after
their EOS until then; what they produce there is cut off afterwards, so the output is what
stopping at once would give.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from .model import Transformer
from .static_decoder import StaticDecoder, prompt_bucket, sample

__all__ = ["STOP_CHECK_EVERY", "generate", "generate_without_cache", "sample"]

# One host sync per this many tokens; up to this many - 1 steps run after the last row ends.
STOP_CHECK_EVERY = 8
# Cache slots are rounded up to a multiple of this, so that calls with nearby prompt widths
# share one decoder and its compiled, captured step.
SLOT_MULTIPLE = 128

# The last decoder of each model, reused while calls ask for the same shapes; only one is
# kept since each holds a whole KV cache.
_decoders: weakref.WeakKeyDictionary[Transformer, tuple[tuple, StaticDecoder]] = weakref.WeakKeyDictionary()


def _decoder(model: Transformer, batch: int, slots: int, compile_decode: bool | str, cuda_graph: bool) -> StaticDecoder:
    backend = "inductor" if compile_decode is True else compile_decode or None
    key = (batch, slots, backend, cuda_graph)
    held = _decoders.get(model)
    if held is None or held[0] != key:
        # Freed before the next one is allocated: two 7B caches need not fit at once.
        _decoders.pop(model, None)
        held = (key, StaticDecoder(model, batch, slots, backend, cuda_graph))
        _decoders[model] = held
    return held[1]


def _draws(steps: int, rows: int, generator: torch.Generator | None) -> torch.Tensor:
    """(steps, rows) uniforms: token k of row i samples with draw (k, i), whichever path runs."""
    return torch.stack([torch.rand(rows, generator=generator) for _ in range(steps)])


def _decode_batch(
    decoder: StaticDecoder,
    prompts: list[list[int]],
    budgets: list[int],
    eos_id: int,
    uniforms: torch.Tensor | None,
    temperature: float,
    top_p: float,
) -> list[list[int]]:
    """New tokens of up to ``decoder.batch`` prompts, row i ending at EOS or after budgets[i]."""
    device = decoder.out.device
    width = prompt_bucket(max(len(p) for p in prompts))
    steps = max(budgets)
    # Dummy rows (a one-token prompt) fill the batch; their budget 0 ends them at once.
    tokens = torch.zeros(decoder.batch, width, dtype=torch.long)
    pad = [width - 1] * decoder.batch
    for r, prompt in enumerate(prompts):
        tokens[r, width - len(prompt):] = torch.tensor(prompt)
        pad[r] = width - len(prompt)
    budget = torch.tensor(budgets + [0] * (decoder.batch - len(prompts)), device=device)
    if uniforms is not None:
        uniforms = torch.cat([uniforms[:steps], uniforms.new_zeros(steps, decoder.batch - len(prompts))], 1)
    decoder.prefill(tokens, torch.tensor(pad), uniforms, temperature, top_p)
    produced = 1
    while produced < steps:
        decoder.decode(temperature, top_p)
        produced += 1
        if produced % STOP_CHECK_EVERY == 0:
            ended = (decoder.out[:, :produced] == eos_id).any(1) | (budget <= produced)
            if ended.all().item():
                break
    out = []
    for row, n in zip(decoder.out[: len(prompts), :produced].tolist(), budgets):
        row = row[:n]
        out.append(row[: row.index(eos_id)] if eos_id in row else row)
    return out


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    compile_decode: bool | str = False,
    cuda_graph: bool = False,
    batch_size: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[int]]:
    """New tokens for each prompt (EOS excluded), with a static KV cache; temperature 0 is greedy.

    A row stops at EOS, after max_new_tokens, or when it reaches the model's max_seq_len.
    Prompts are decoded ``batch_size`` at a time (default: all at once). ``compile_decode``
    compiles the blocks, with inductor or the torch.compile backend it names (the first call
    of a shape pays the compilation); ``cuda_graph``
    replays each token's step as a CUDA graph (model on CUDA). ``progress(prompts, tokens)``
    is called after each batch with the number of prompts and of new tokens done so far.
    """
    limit = model.model_args.max_seq_len
    out: list[list[int]] = [[] for _ in prompts]
    rows = [i for i, p in enumerate(prompts) if 0 < len(p) < limit]
    if not rows or max_new_tokens <= 0:
        return out
    batch = batch_size or len(rows)
    batches = [rows[k : k + batch] for k in range(0, len(rows), batch)]
    budgets = {i: min(max_new_tokens, limit - len(prompts[i])) for i in rows}
    # One decoder for the whole call: its slots fit the widest bucket and the longest run.
    needed = max(prompt_bucket(max(len(prompts[i]) for i in b)) + max(budgets[i] for i in b) for b in batches)
    decoder = _decoder(model, batch, SLOT_MULTIPLE * -(-needed // SLOT_MULTIPLE), compile_decode, cuda_graph)
    uniforms = _draws(max(budgets.values()), len(prompts), generator) if temperature > 0 else None
    # Prompts that generate nothing (empty, or too long) count as done from the start.
    done_rows, done_tokens = len(prompts) - len(rows), 0
    for b in batches:
        draws = None if uniforms is None else uniforms[:, b]
        new = _decode_batch(decoder, [prompts[i] for i in b], [budgets[i] for i in b], eos_id, draws,
                            temperature, top_p)
        for i, tokens in zip(b, new):
            out[i] = tokens
        done_rows, done_tokens = done_rows + len(b), done_tokens + sum(map(len, new))
        if progress is not None:
            progress(done_rows, done_tokens)
    return out


@torch.no_grad()
def generate_without_cache(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """What ``generate`` computes, running the whole sequence through the model for every token.

    The reference for the cache (tests) and its baseline (scripts/bench_generate.py).
    """
    device = model.output.weight.device
    limit = model.model_args.max_seq_len
    seqs = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    active = [i for i, p in enumerate(prompts) if p]
    for _ in range(max_new_tokens):
        active = [i for i in active if len(seqs[i]) < limit]
        if not active:
            break
        width = max(len(seqs[i]) for i in active)
        tokens = torch.zeros(len(active), width, dtype=torch.long)
        positions = torch.zeros_like(tokens)
        documents = torch.zeros_like(tokens)
        for row, i in enumerate(active):
            n = len(seqs[i])
            tokens[row, width - n:] = torch.tensor(seqs[i])
            positions[row, width - n:] = torch.arange(n)
            documents[row, width - n:] = 1
        logits = model(tokens.to(device), position_ids=positions.to(device), document_ids=documents.to(device))
        uniform = _draws(1, len(prompts), generator)[0, active] if temperature > 0 else None
        chosen = sample(logits[:, -1], temperature, top_p, uniform).tolist()
        still = []
        for i, token in zip(active, chosen):
            if token == eos_id:
                continue
            seqs[i].append(token)
            out[i].append(token)
            still.append(i)
        active = still
    return out
