"""Attention kernels: SDPA, and flex_attention with a block-sparse document-causal mask.

Packed samples (``document_ids``) must not attend across documents. SDPA can only express
that as a dense (B, 1, S, S) boolean mask, which sends it to its masked kernels (no flash
attention on CUDA) and costs B x S x S bytes. flex_attention takes a ``BlockMask`` instead:
per 128 x 128 tile, whether it is skipped, computed without a mask, or masked by
``mask_mod``; its fused kernel skips the tiles that cross documents.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

ATTENTION_CHOICES = ("auto", "sdpa", "flex")

# flex_attention's tile: query and key/value blocks of this many tokens.
FLEX_BLOCK_SIZE = 128


def resolve_attention(choice: str, compiled: bool, device_type: str) -> str:
    """The kernel for packed samples, "sdpa" or "flex"; ``auto`` picks flex for compiled CUDA blocks.

    flex_attention is a fused kernel only when compiled: in compiled blocks it is traced into
    the block's graph. Eager blocks would have to compile it on their own (``flex`` does),
    adding a compilation to a run that asked for none, so ``auto`` keeps SDPA with the dense
    mask there. On CPU torch has no flex_attention backward, so ``auto`` keeps SDPA.
    """
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {choice!r}")
    if choice == "auto":
        return "flex" if compiled and device_type == "cuda" else "sdpa"
    return choice


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, S, S) boolean SDPA mask: a token sees earlier tokens of its own document only."""
    seqlen = document_ids.shape[1]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=document_ids.device).tril()
    same_doc = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)
    return (causal & same_doc).unsqueeze(1)


def _document_causal(
    document_ids: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
) -> torch.Tensor:
    return (kv_idx <= q_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) of the True tiles of each query row, indices of True tiles first."""
    count = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count.unsqueeze(1), indices.unsqueeze(1)


def document_block_mask(document_ids: torch.Tensor, block_size: int = FLEX_BLOCK_SIZE) -> BlockMask:
    """flex_attention's document-causal BlockMask, built from per-tile document ranges.

    A tile is skipped when its query and key tiles share no document or lie wholly above
    the diagonal, computed without a mask when both hold one and the same document below
    the diagonal, and masked by ``mask_mod`` otherwise. Nothing of size S x S is built
    (``create_block_mask`` would evaluate mask_mod densely first); any document ids work,
    not only sorted ones.
    """
    bs, seqlen = document_ids.shape
    n_blocks = -(-seqlen // block_size)
    # Tail padding repeats the last id: a tile's id range stays that of its real tokens, and
    # mask_mod may index the padded positions of the last tile.
    pad = n_blocks * block_size - seqlen
    docs = torch.cat([document_ids, document_ids[:, -1:].expand(bs, pad)], dim=1)
    tiles = docs.view(bs, n_blocks, block_size)
    lo, hi = tiles.amin(-1), tiles.amax(-1)
    q_lo, q_hi, kv_lo, kv_hi = lo.unsqueeze(2), hi.unsqueeze(2), lo.unsqueeze(1), hi.unsqueeze(1)
    block = torch.arange(n_blocks, device=document_ids.device)
    below = block.unsqueeze(1) > block.unsqueeze(0)
    on_or_below = below | torch.eye(n_blocks, dtype=torch.bool, device=document_ids.device)
    visible = on_or_below & (q_lo <= kv_hi) & (kv_lo <= q_hi)
    full = below & (q_lo == q_hi) & (kv_lo == kv_hi) & (q_lo == kv_lo)
    kv_num_blocks, kv_indices = _ordered(visible & ~full)
    full_kv_num_blocks, full_kv_indices = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
        BLOCK_SIZE=block_size, mask_mod=functools.partial(_document_causal, docs), seq_lengths=(seqlen, seqlen),
    )


@functools.cache
def _standalone_flex_attention():
    # Outside a compiled region flex_attention runs an unfused reference that builds the
    # whole score matrix; compiled on its own it is the fused kernel.
    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask
) -> torch.Tensor:
    """q (B, H, S, D), k and v (B, H_kv, S, D) -> (B, H, S, D), attending within ``block_mask``.

    Each key/value head serves H / H_kv query heads inside the kernel, as ``repeat_kv``
    would arrange them, without copying it.
    """
    flex = flex_attention if torch.compiler.is_compiling() else _standalone_flex_attention()
    if q.device.type == "cpu":
        # Inductor's CPU flex template fails on strided views of tensors computed in the same
        # graph ("too many values to unpack", torch 2.11 and 2.13); CUDA takes them as they are.
        q, k, v = (t.contiguous() for t in (q, k, v))
    return flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
