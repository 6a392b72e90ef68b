"""LLaMA-2 decoder (Touvron et al., 2023), written to be parallelized and compiled from outside.

Module names match torchtitan's (``layers.N.attention.wq``, ``feed_forward.w1``, ...) so tensor
parallel plans, FSDP wrapping and float8 conversion address them by name, and so that Meta's
consolidated checkpoints load without renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from .args import LlamaArgs
from .attention import document_block_mask, document_causal_mask, flex_document_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics: bf16 sums of squares lose too much precision over 4096 channels.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def precompute_rope(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """(max_seq_len, head_dim) table: cos of every position/frequency, then sin.

    Real-valued on purpose: inductor and DTensor handle complex tensors poorly.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rotary_emb(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) like Meta's complex ``apply_rotary_emb``.

    x: (B, S, H, head_dim). rope: (S, head_dim) or (B, S, head_dim) rows of the rope table.
    """
    # Pointwise, with the pair swap a flip: out[2i] = x[2i] cos - x[2i+1] sin, out[2i+1] = x[2i+1] cos
    # + x[2i] sin, the same bits as the pairwise formula; its backward is pointwise too, where a
    # stack/unbind's backward made inductor's kernel load every element twice, masked.
    cos, sin = rope.unsqueeze(-2).float().chunk(2, dim=-1)
    cos, sin = torch.stack([cos, cos], dim=-1).flatten(-2), torch.stack([-sin, sin], dim=-1).flatten(-2)
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (xf * cos + swapped * sin).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, S, n_kv, D) -> (B, S, n_kv * n_rep, D), each KV head serving n_rep query heads."""
    if n_rep == 1:
        return x
    bs, seqlen, n_kv, head_dim = x.shape
    return (
        x.unsqueeze(3).expand(bs, seqlen, n_kv, n_rep, head_dim).reshape(bs, seqlen, -1, head_dim)
    )


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        # The ratio survives tensor parallelism (both head counts shard by the same degree),
        # so the local head counts are never stored: views use -1.
        self.n_rep = args.n_heads // args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def project_qkv(
        self, x: torch.Tensor, rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, S, dim) -> q (B, S, H, D), k and v (B, S, H_kv, D), q and k rotated."""
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        return apply_rotary_emb(q, rope), apply_rotary_emb(k, rope), v

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, attn_mask: torch.Tensor | BlockMask | None = None
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q, k, v = self.project_qkv(x, rope)
        if isinstance(attn_mask, BlockMask):
            out = flex_document_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask)
        else:
            k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            # No mask lets SDPA pick the flash kernel; a document mask needs the masked kernels.
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None
            )
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: LlamaArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # Read only by init_weights, never by forward: blocks stay interchangeable for
        # torch.compile, which then compiles one block and reuses the code for all of them.
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, attn_mask: torch.Tensor | BlockMask | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, attn_mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Transformer(nn.Module):
    def __init__(self, model_args: LlamaArgs) -> None:
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, model_args) for i in range(model_args.n_layers)}
        )
        self.norm = RMSNorm(model_args.dim, model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        # Non-persistent: derived from the args, so checkpoints stay weights-only.
        self.register_buffer("rope_cache", self._precompute_rope(), persistent=False)

    def _precompute_rope(self) -> torch.Tensor:
        args = self.model_args
        return precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta)

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialize every parameter in place and rebuild the rope table.

        Works after ``to_empty`` (the table then holds garbage) and on DTensor parameters.
        """
        buffer_device = buffer_device or self.rope_cache.device
        with torch.device(buffer_device):
            self.rope_cache = self._precompute_rope()
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        std = self.model_args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, S) -> logits (B, S, vocab_size).

        position_ids (B, S): RoPE positions, for packed samples whose positions restart.
        document_ids (B, S): restrict attention to earlier tokens of the same document, through
        a dense SDPA mask or flex_attention's block mask (``model_args.attention``).
        """
        if position_ids is None:
            rope = self.rope_cache[: tokens.shape[1]]
        else:
            rope = self.rope_cache[position_ids]
        attn_mask: torch.Tensor | BlockMask | None = None
        if document_ids is not None:
            # Built once here, outside the compiled blocks, and shared by all of them.
            if self.model_args.attention == "flex":
                attn_mask = document_block_mask(document_ids)
            else:
                attn_mask = document_causal_mask(document_ids)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, rope, attn_mask)
        return self.output(self.norm(h))


def seeded_init(model: Transformer, seed: int, device: torch.device | str) -> None:
    """The weight-init recipe of an allocated (possibly sharded) model: seed, then init_weights."""
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=device)


def initialized_model(args: LlamaArgs, seed: int, device: torch.device | str = "cpu") -> Transformer:
    """A whole model with the trainer's initial weights for `seed`.

    On CPU it seeds before building (the constructor draws from the generator too), which
    is what a one-process CPU run starts from, bitwise. Elsewhere it is built on meta and
    materialised on `device` (a 7B never needs a CPU copy), as a GPU run does.
    """
    if torch.device(device).type == "cpu":
        torch.manual_seed(seed)
        model = Transformer(args)
        with torch.no_grad():
            model.init_weights()
        return model
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    seeded_init(model, seed, device)
    return model


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Parameter count (global sizes for sharded DTensors); optionally without tok_embeddings."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embedding:
        total -= model.tok_embeddings.weight.numel()
    return total
