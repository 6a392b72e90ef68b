"""Autoregressive generation: a static KV cache (prefill once, then one token per step) and
the recompute-everything reference it must agree with.

Batches are left-padded: row i of width W holds ``W - n_i`` padding slots, then its prompt.
Each row's RoPE positions restart at its first token and its padding is a document of its
own, so every row computes what it would alone. The cache has fixed shapes, (B, H_kv,
slots, D) per layer, written in place at the current slot, so the decode step compiles to
one graph that every step reuses (``compile_decode``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .model import Transformer


class KVCache:
    """Keys and values of every layer for ``slots`` positions of ``batch`` rows."""

    def __init__(self, model: Transformer, batch: int, slots: int) -> None:
        args = model.model_args
        weight = model.output.weight
        shape = (batch, args.n_kv_heads, slots, args.head_dim)
        self.keys = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in range(args.n_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]


def _forward_cached(
    model: Transformer,
    cache: KVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Logits (B, vocab) of the last of ``tokens`` (B, S), whose keys and values go to ``slots`` (S,).

    mask (B, 1, S, K): which of the first K cache slots each new token sees.
    """
    bs, seqlen = tokens.shape
    kv_len = mask.shape[-1]
    rope = model.rope_cache[positions]
    h = model.tok_embeddings(tokens)
    for layer, block in enumerate(model.layers.values()):
        attn = block.attention
        q, k, v = attn.project_qkv(block.attention_norm(h), rope)
        cache.keys[layer].index_copy_(2, slots, k.transpose(1, 2))
        cache.values[layer].index_copy_(2, slots, v.transpose(1, 2))
        keys, values = cache.keys[layer][:, :, :kv_len], cache.values[layer][:, :, :kv_len]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=attn.n_rep > 1
        )
        h = h + attn.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
        h = h + block.feed_forward(block.ffn_norm(h))
    return model.output(model.norm(h[:, -1]))


def _decode_step(
    model: Transformer, cache: KVCache, tokens: torch.Tensor, slot: torch.Tensor, pad: torch.Tensor
) -> torch.Tensor:
    """Logits (B, vocab) after ``tokens`` (B,) at ``slot`` (a 0-d tensor: no recompile per step).

    pad (B,): padding slots in front of each row; a token sees its row's slots from there on.
    """
    seen = torch.arange(cache.keys[0].shape[2], device=tokens.device)
    mask = (seen <= slot) & (seen.unsqueeze(0) >= pad.unsqueeze(1))
    positions = (slot - pad).clamp(max=model.model_args.max_seq_len - 1).unsqueeze(1)
    return _forward_cached(model, cache, tokens.unsqueeze(1), positions, slot.reshape(1), mask[:, None, None])


@functools.cache
def _compiled_decode_step():
    return torch.compile(_decode_step, fullgraph=True)


def sample(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row of logits (B, vocab): argmax at temperature 0, else nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
    sorted_probs[(sorted_probs.cumsum(-1) - sorted_probs) >= top_p] = 0.0
    choice = torch.multinomial(sorted_probs.cpu(), 1, generator=generator).to(logits.device)
    return order.gather(-1, choice).squeeze(-1)


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    compile_decode: bool = False,
) -> list[list[int]]:
    """New tokens for each prompt (EOS excluded), batched, with a KV cache; temperature 0 is greedy.

    A row stops at EOS, after max_new_tokens, or when it reaches the model's max_seq_len.
    ``compile_decode`` compiles the one-token step (the first call pays the compilation).
    """
    limit = model.model_args.max_seq_len
    out: list[list[int]] = [[] for _ in prompts]
    rows = [i for i, p in enumerate(prompts) if 0 < len(p) < limit]
    if not rows or max_new_tokens <= 0:
        return out
    device = model.output.weight.device
    lengths = [len(prompts[i]) for i in rows]
    width = max(lengths)
    steps = min(max_new_tokens, limit - min(lengths))
    cache = KVCache(model, len(rows), width + steps)

    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (i, n) in enumerate(zip(rows, lengths)):
        tokens[r, width - n:] = torch.tensor(prompts[i])
    pad = torch.tensor([width - n for n in lengths], device=device)
    slot = torch.arange(width, device=device)
    in_prompt = slot.unsqueeze(0) >= pad.unsqueeze(1)
    # Prefill: padding sees padding, prompt tokens see their prompt, both causally.
    mask = (slot.unsqueeze(1) >= slot) & (in_prompt.unsqueeze(2) == in_prompt.unsqueeze(1))
    positions = (slot - pad.unsqueeze(1)).clamp(min=0)
    logits = _forward_cached(model, cache, tokens.to(device), positions, slot, mask.unsqueeze(1))

    step_fn = _compiled_decode_step() if compile_decode else _decode_step
    alive = list(range(len(rows)))
    for step in range(steps):
        chosen = sample(logits[alive], temperature, top_p, generator).tolist()
        still = []
        for r, token in zip(alive, chosen):
            if token == eos_id:
                continue
            out[rows[r]].append(token)
            if lengths[r] + len(out[rows[r]]) < limit:
                still.append(r)
        alive = still
        if not alive or step == steps - 1:
            break
        # Finished rows keep decoding (fixed shapes); what they compute is never read.
        last = torch.tensor([out[i][-1] if out[i] else 0 for i in rows], device=device)
        logits = step_fn(model, cache, last, torch.tensor(width + step, device=device), pad)
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
        chosen = sample(logits[:, -1], temperature, top_p, generator).tolist()
        still = []
        for i, token in zip(active, chosen):
            if token == eos_id:
                continue
            seqs[i].append(token)
            out[i].append(token)
            still.append(i)
        active = still
    return out
