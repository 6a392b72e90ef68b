"""LLaMA-2 model: flavours, RoPE, attention masking, GQA and initialisation on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.llama import LLAMA2_FLAVORS, LlamaArgs, Transformer, num_params
from models.llama.model import Attention, apply_rotary_emb, precompute_rope

TINY = LlamaArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=64
)


def tiny_model(args: LlamaArgs = TINY, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    # Init leaves norms at 1 and keeps logits small; random norms and a larger embedding make
    # every component (incl. the final norm) affect the output noticeably.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        model.tok_embeddings.weight.mul_(20)
    return model.eval()


@pytest.mark.parametrize(
    ("flavor", "expected", "hidden"),
    [
        ("7B", 6_738_415_616, 11008),
        ("13B", 13_015_864_320, 13824),
        ("70B", 68_976_648_192, 28672),
        ("debug", 4_196_608, 768),
    ],
)
def test_flavour_param_counts_on_meta(flavor: str, expected: int, hidden: int) -> None:
    args = LLAMA2_FLAVORS[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert num_params(model) == expected
    assert num_params(model, exclude_embedding=True) == expected - args.vocab_size * args.dim
    assert args.hidden_dim == hidden
    block = model.layers["0"]
    kv_dim = args.n_kv_heads * args.head_dim
    assert block.attention.wk.weight.shape == (kv_dim, args.dim)
    assert block.feed_forward.w2.weight.shape == (args.dim, hidden)
    assert list(model.layers) == [str(i) for i in range(args.n_layers)]
    logits = model(torch.zeros(2, 16, dtype=torch.long, device="meta"))
    assert logits.shape == (2, 16, args.vocab_size)


def test_debug_flavour_exercises_gqa() -> None:
    args = LLAMA2_FLAVORS["debug"]
    assert args.vocab_size == 2048
    assert args.n_kv_heads < args.n_heads


def test_args_are_validated() -> None:
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaArgs(dim=64, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="attention must be 'sdpa' or 'flex'"):
        LlamaArgs(attention="auto")  # resolved before the model is built


def meta_reference_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta's precompute_freqs_cis + apply_rotary_emb (complex numbers), indexed by positions."""
    head_dim = x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(int(positions.max()) + 1), freqs).float()
    freqs_cis = torch.polar(torch.ones_like(angles), angles)[positions].unsqueeze(-2)
    x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_complex * freqs_cis).flatten(3).type_as(x)


def test_rope_matches_meta_complex_reference() -> None:
    torch.manual_seed(0)
    bs, seqlen, heads, head_dim, theta = 2, 12, 3, 16, 10000.0
    x = torch.randn(bs, seqlen, heads, head_dim)
    table = precompute_rope(head_dim, 64, theta)

    default = apply_rotary_emb(x, table[:seqlen])
    expected = meta_reference_rope(x, torch.arange(seqlen).expand(bs, seqlen), theta)
    torch.testing.assert_close(default, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(default, x, atol=1e-3)

    positions = torch.stack(
        [torch.arange(seqlen) + 40, torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1])]
    )
    custom = apply_rotary_emb(x, table[positions])
    torch.testing.assert_close(
        custom, meta_reference_rope(x, positions, theta), atol=1e-5, rtol=1e-5
    )


def _pairwise_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """The rotation pair by pair: (x0 cos - x1 sin, x0 sin + x1 cos)."""
    cos, sin = rope.unsqueeze(-2).float().chunk(2, dim=-1)
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_rope_is_the_pairwise_formula_bitwise(dtype) -> None:
    torch.manual_seed(0)
    x = (torch.randn(2, 24, 3, 16) * 10).to(dtype)
    g = torch.randn(2, 24, 3, 16).to(dtype)
    rope = precompute_rope(16, 64, 10000.0)[torch.randint(0, 64, (2, 24))]
    results = []
    for rotate in (_pairwise_rope, apply_rotary_emb):
        xi = x.clone().requires_grad_()
        out = rotate(xi, rope)
        out.backward(g)
        results.append((out, xi.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_rope_preserves_bf16() -> None:
    x = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    assert apply_rotary_emb(x, precompute_rope(8, 4, 10000.0)).dtype == torch.bfloat16


def test_gqa_equals_explicitly_repeated_kv_heads() -> None:
    torch.manual_seed(0)
    gqa = Attention(TINY)
    mha = Attention(dataclasses.replace(TINY, n_kv_heads=TINY.n_heads))
    n_rep, head_dim = TINY.n_heads // TINY.n_kv_heads, TINY.head_dim
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):
            # KV head j serves query heads j*n_rep ... (j+1)*n_rep - 1, as in Meta's repeat_kv.
            heads = getattr(gqa, name).weight.view(TINY.n_kv_heads, head_dim, TINY.dim)
            getattr(mha, name).weight.copy_(heads.repeat_interleave(n_rep, dim=0).flatten(0, 1))
    x = torch.randn(2, 10, TINY.dim)
    rope = precompute_rope(head_dim, 10, TINY.rope_theta)
    torch.testing.assert_close(gqa(x, rope), mha(x, rope), atol=1e-5, rtol=1e-5)


def test_attention_is_causal() -> None:
    model = tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    changed = tokens.clone()
    changed[:, 9] = (tokens[:, 9] + 1) % TINY.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(before[:, 9:], after[:, 9:], atol=1e-3)


def test_document_ids_isolate_packed_documents() -> None:
    model = tiny_model()
    doc_a = torch.randint(0, TINY.vocab_size, (1, 5))
    doc_b = torch.randint(0, TINY.vocab_size, (1, 7))
    packed = torch.cat([doc_a, doc_b], dim=1)
    position_ids = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)
    document_ids = torch.tensor([[0] * 5 + [1] * 7])
    with torch.no_grad():
        separate = torch.cat([model(doc_a), model(doc_b)], dim=1)
        isolated = model(packed, position_ids=position_ids, document_ids=document_ids)
        leaky = model(packed, position_ids=position_ids)
    torch.testing.assert_close(isolated, separate, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(leaky[:, 5:], separate[:, 5:], atol=1e-3)


def test_init_weights_after_meta_and_to_empty() -> None:
    args = dataclasses.replace(TINY, n_layers=4)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()

    assert "rope_cache" not in model.state_dict()
    torch.testing.assert_close(
        model.rope_cache, precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta)
    )
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert p.std() > 0, name
    # Depth-scaled output projections: deeper layers start smaller.
    std = [model.layers[str(i)].attention.wo.weight.std().item() for i in (0, 3)]
    assert std[0] == pytest.approx(0.02 / 2**0.5, rel=0.1)
    assert std[1] == pytest.approx(0.02 / 8**0.5, rel=0.1)
    assert model.output.weight.std().item() == pytest.approx(args.dim**-0.5, rel=0.1)
    assert model.output.weight.abs().max().item() <= 3 * args.dim**-0.5
    logits = model(torch.randint(0, args.vocab_size, (1, 8)))
    assert torch.isfinite(logits).all()


def test_init_weights_moves_rope_cache_to_buffer_device() -> None:
    with torch.device("meta"):
        model = Transformer(TINY)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device="cpu")
    assert model.rope_cache.device.type == "cpu"
    assert torch.isfinite(model.rope_cache).all()


def test_logits_follow_parameter_dtype() -> None:
    model = tiny_model().to(torch.bfloat16)
    assert model(torch.randint(0, TINY.vocab_size, (1, 4))).dtype == torch.bfloat16
