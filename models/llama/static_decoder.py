"""Decoding with fixed shapes: a static KV cache, a prefill per prompt-width bucket and a
one-token step whose shapes never change, so it compiles once and replays as a CUDA graph.

A decoder holds, for ``batch`` rows and ``slots`` cache positions: the cache, (B, H_kv,
slots, D) per layer, and the device state the step reads and advances in place (the last
token of each row, the slot it writes, the index of the token it produces, each row's left
padding, the tokens produced so far and the sampling draws). Nothing in the step depends on
a Python value that changes from token to token, so the host only launches it: one graph
replay per token on CUDA, and a sync only when the caller checks for EOS.

Compiled decoders compile one transformer block, not the model: every block has the same
shapes, so dynamo reuses the one graph for all layers (the parameters are its inputs), and
compile time does not grow with depth. The prefill block compiles once per (batch, prompt
width, slots); the prompt widths are padded up to a power of two (``prompt_bucket``), so a
run sees a handful of them.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .model import Transformer, TransformerBlock

# Prompt widths are padded up to a power of two, at least this: one prefill compile per bucket.
MIN_PROMPT_BUCKET = 32
# Untimed steps before capture: the first compiles and lets Triton pick its kernel configs.
WARMUP_STEPS = 3


def prompt_bucket(width: int) -> int:
    """The padded prefill width of prompts up to ``width`` tokens: a power of two, >= 32."""
    return max(MIN_PROMPT_BUCKET, 1 << (width - 1).bit_length())


def _block_forward(
    block: TransformerBlock,
    h: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rope: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """One block over h (B, S, dim) whose keys and values go to cache ``slots`` (S,).

    mask (B, 1, S, K): which of the first K cache slots each of the S tokens sees.
    """
    bs, seqlen, _ = h.shape
    attn = block.attention
    q, k, v = attn.project_qkv(block.attention_norm(h), rope)
    keys.index_copy_(2, slots, k.transpose(1, 2))
    values.index_copy_(2, slots, v.transpose(1, 2))
    kv_len = mask.shape[-1]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys[:, :, :kv_len], values[:, :, :kv_len], attn_mask=mask,
        enable_gqa=attn.n_rep > 1,
    )
    h = h + attn.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
    return h + block.feed_forward(block.ffn_norm(h))


# Two functions, two dynamo caches: the prefill's per-bucket graphs never push the decode
# step's graph towards the recompile limit.
def _prefill_block(*args: torch.Tensor) -> torch.Tensor:
    return _block_forward(*args)


def _decode_block(*args: torch.Tensor) -> torch.Tensor:
    return _block_forward(*args)


@functools.cache
def compiled_blocks(backend: str = "inductor") -> tuple[Callable, Callable]:
    """(prefill, decode) block functions compiled with ``backend``, shapes static."""
    # Coordinate descent tuning makes inductor turn matrix-vector products (batch 1) into
    # Triton reductions tuned for bandwidth, which beat cuBLAS there (4.3 against 5.0 ms per
    # 7B token on an H200). It lengthens the compilation, so the prefill does without.
    options = {"coordinate_descent_tuning": True} if backend == "inductor" else None
    return (torch.compile(_prefill_block, backend=backend, fullgraph=True, dynamic=False),
            torch.compile(_decode_block, backend=backend, fullgraph=True, dynamic=False, options=options))


def sample(
    logits: torch.Tensor, temperature: float, top_p: float, uniform: torch.Tensor | None
) -> torch.Tensor:
    """One token per row of logits (B, vocab): argmax at temperature 0, else nucleus sampling.

    uniform (B,) in [0, 1): row i takes the first token, in order of probability, where the
    kept mass reaches ``uniform[i]`` of the total. The draws come from the caller, so
    sampling needs no random generator on the device (nor in a CUDA graph) and every path
    that gets the same draws picks the same tokens.
    """
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
    kept = sorted_probs.masked_fill(sorted_probs.cumsum(-1) - sorted_probs >= top_p, 0.0)
    cdf = kept.cumsum(-1)
    target = (uniform.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    choice = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)
    return order.gather(-1, choice).squeeze(-1)


class StaticDecoder:
    """Prefill and one-token steps for up to ``batch`` rows in ``slots`` cache positions.

    ``compile_backend`` compiles the blocks (None: eager); ``cuda_graph`` replays each
    token's step as a CUDA graph captured on first use of a sampling setting.
    """

    def __init__(
        self, model: Transformer, batch: int, slots: int, compile_backend: str | None, cuda_graph: bool
    ) -> None:
        weight = model.output.weight
        if cuda_graph and weight.device.type != "cuda":
            raise ValueError(f"a CUDA graph needs the model on CUDA, not {weight.device}")
        # Weak: callers cache decoders per model, and the cache must not keep the model alive.
        self._model = weakref.ref(model)
        self.batch, self.slots, self.cuda_graph = batch, slots, cuda_graph
        args, device = model.model_args, weight.device
        shape = (batch, args.n_kv_heads, slots, args.head_dim)
        self.keys = [torch.zeros(shape, dtype=weight.dtype, device=device) for _ in range(args.n_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        # The step's state, read and advanced in place (the graph reads these addresses).
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.slot = torch.zeros((), dtype=torch.long, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)
        self.pad = torch.zeros(batch, dtype=torch.long, device=device)
        self.out = torch.zeros(batch, slots, dtype=torch.long, device=device)
        self.uniforms = torch.zeros(slots, batch, device=device)
        if compile_backend is None:
            self._prefill_block, self._decode_block = _prefill_block, _decode_block
        else:
            self._prefill_block, self._decode_block = compiled_blocks(compile_backend)
        self._graphs: dict[tuple[float, float], torch.cuda.CUDAGraph] = {}

    @property
    def model(self) -> Transformer:
        model = self._model()
        if model is None:
            raise RuntimeError("the decoder's model was freed")
        return model

    def _logits(self, block_fn: Callable, tokens: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        model = self.model
        rope = model.rope_cache[positions]
        h = model.tok_embeddings(tokens)
        for block, keys, values in zip(model.layers.values(), self.keys, self.values):
            h = block_fn(block, h, keys, values, rope, slots, mask)
        return model.output(model.norm(h[:, -1]))

    def _record(self, logits: torch.Tensor, temperature: float, top_p: float) -> None:
        """Sample the token at index ``step``; it is the next step's input."""
        step = self.step.reshape(1)
        uniform = self.uniforms.index_select(0, step).squeeze(0) if temperature > 0 else None
        token = sample(logits, temperature, top_p, uniform)
        self.tokens.copy_(token)
        self.out.index_copy_(1, step, token.unsqueeze(1))
        self.step.add_(1)

    @torch.no_grad()
    def prefill(
        self, tokens: torch.Tensor, pad: torch.Tensor, uniforms: torch.Tensor | None,
        temperature: float = 0.0, top_p: float = 1.0,
    ) -> None:
        """Run the left-padded prompts (B, W) and sample token 0 (W: a ``prompt_bucket``, so
        that the prefill compiles once per bucket; W plus the tokens to come fit in ``slots``).

        pad (B,): padding slots in front of each row. uniforms (steps, B): the draws of the
        coming tokens (None when greedy).
        """
        width = tokens.shape[1]
        if self.cuda_graph and (temperature, top_p) not in self._graphs:
            # Captured before the prefill: the warm-up steps advance the state.
            self._graphs[(temperature, top_p)] = self._capture(temperature, top_p)
        device = self.tokens.device
        self.pad.copy_(pad)
        if uniforms is not None:
            self.uniforms[: len(uniforms)].copy_(uniforms)
        slot = torch.arange(width, device=device)
        in_prompt = slot.unsqueeze(0) >= self.pad.unsqueeze(1)
        # Padding sees padding, prompt tokens see their prompt, both causally.
        mask = (slot.unsqueeze(1) >= slot) & (in_prompt.unsqueeze(2) == in_prompt.unsqueeze(1))
        positions = (slot - self.pad.unsqueeze(1)).clamp(min=0)
        logits = self._logits(self._prefill_block, tokens.to(device), positions, slot, mask.unsqueeze(1))
        self.step.zero_()
        self._record(logits, temperature, top_p)
        self.slot.fill_(width)

    def _decode_step(self, temperature: float, top_p: float) -> None:
        # The mask and positions come from the slot tensor on the device: same shapes every step.
        seen = torch.arange(self.slots, device=self.slot.device)
        mask = (seen <= self.slot) & (seen.unsqueeze(0) >= self.pad.unsqueeze(1))
        positions = (self.slot - self.pad).clamp(0, self.model.model_args.max_seq_len - 1)
        logits = self._logits(
            self._decode_block, self.tokens.unsqueeze(1), positions.unsqueeze(1), self.slot.reshape(1),
            mask[:, None, None],
        )
        self._record(logits, temperature, top_p)
        self.slot.add_(1)

    def _capture(self, temperature: float, top_p: float) -> torch.cuda.CUDAGraph:
        # The warm-up steps write wherever the state points: start it where they stay in bounds.
        self.slot.zero_()
        self.step.zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._decode_step(temperature, top_p)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._decode_step(temperature, top_p)
        return graph

    @torch.no_grad()
    def decode(self, temperature: float = 0.0, top_p: float = 1.0) -> None:
        """One token per row after the last: replays the CUDA graph, or runs the step."""
        if self.cuda_graph:
            self._graphs[(temperature, top_p)].replay()
        else:
            self._decode_step(temperature, top_p)
