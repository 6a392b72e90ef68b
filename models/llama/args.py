"""LLaMA-2 hyperparameters and the standard flavours."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaArgs:
    """Shape of a LLaMA-2 model. Frozen: derive variants with ``dataclasses.replace``."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    # None means multi-head attention (as many KV heads as query heads).
    n_kv_heads: int | None = None
    vocab_size: int = 32000
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    # torchtitan's depth init: output projections of layer i get std 0.02 / sqrt(2 (i + 1))
    # instead of one std for all layers, 0.02 / sqrt(2 n_layers).
    depth_init: bool = True
    # Kernel for packed samples (document_ids): "sdpa" with a dense (B, 1, S, S) mask, or
    # "flex" (flex_attention with a block-sparse mask). Unpacked batches always use SDPA's
    # causal kernel. Not part of the weights: checkpoints load whatever this is.
    attention: str = "sdpa"

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
            )
        if self.attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be 'sdpa' or 'flex', got {self.attention!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim (same FLOPs as a plain 4*dim MLP), scaled, rounded up."""
        return meta_ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)


def meta_ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Meta's FFN width rule (llama/model.py, FeedForward.__init__)."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


LLAMA2_FLAVORS: dict[str, LlamaArgs] = {
    "debug": LlamaArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, max_seq_len=2048
    ),
    "7B": LlamaArgs(dim=4096, n_layers=32, n_heads=32),
    "13B": LlamaArgs(dim=5120, n_layers=40, n_heads=40),
    "70B": LlamaArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096
    ),
}
