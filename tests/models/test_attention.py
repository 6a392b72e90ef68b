"""Packed attention: flex_attention's block-sparse document mask against SDPA's dense mask.

torch has no flex_attention backward on CPU, so on CPU flex is compared in forward (eager,
where it is compiled on its own, and inside compiled blocks); gradients of the fused kernels
are compared on CUDA only.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention.flex_attention import create_block_mask

from models.llama import LlamaArgs, Transformer
from models.llama.attention import document_block_mask, resolve_attention
from tests.helpers import run_train
from trainer.config import build_config
from trainer.distributed.memory_plan import estimate
from trainer.errors import UserError
from trainer.model_setup import model_args_for

ARGS = LlamaArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=512
)
# Three 128-token tiles, the last one partial: tiles skipped, computed whole and masked.
SEQ = 300


def packed(*rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids, document_ids) of rows given as document lengths."""
    docs = [torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in rows]
    positions = [torch.cat([torch.arange(n) for n in row]) for row in rows]
    return torch.stack(positions), torch.stack(docs)


def models(device: str = "cpu") -> tuple[Transformer, Transformer]:
    """The same weights with SDPA's dense mask and with flex_attention."""
    torch.manual_seed(0)
    sdpa = Transformer(ARGS).to(device)
    sdpa.init_weights()
    with torch.no_grad():
        # Default inits attend almost uniformly: large embeddings make a leak visible.
        sdpa.tok_embeddings.weight.mul_(20)
    flex = Transformer(dataclasses.replace(ARGS, attention="flex")).to(device)
    flex.load_state_dict(sdpa.state_dict())
    return sdpa, flex


@pytest.mark.version_specific
@pytest.mark.parametrize(("layout", "seqlen"), [("packed", 384), ("unsorted", 384), ("packed", SEQ)])
def test_document_block_mask_equals_create_block_mask(layout: str, seqlen: int) -> None:
    if layout == "packed":
        _, docs = packed([50, 130, 100, seqlen - 280], [seqlen], [128, 128, seqlen - 256])
    else:
        docs = torch.randint(0, 3, (2, seqlen), generator=torch.Generator().manual_seed(0))
    ours = document_block_mask(docs)
    reference = create_block_mask(
        lambda b, h, q, kv: (kv <= q) & (docs[b, q] == docs[b, kv]), docs.shape[0], None, seqlen, seqlen,
        device="cpu",
    )
    assert torch.equal(ours.to_dense(), reference.to_dense())
    if seqlen % 128 == 0:
        # Which tiles skip mask_mod (create_block_mask calls the last tile of an unaligned
        # length partial, whatever its content: the kernels bound that tile either way).
        for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
            assert torch.equal(getattr(ours, name), getattr(reference, name)), name
    if layout == "packed":
        assert ours.full_kv_num_blocks.sum() > 0  # tiles within one document skip mask_mod
    # ... and mask_mod itself, on every (query, key) pair.
    q, kv = torch.meshgrid(torch.arange(seqlen), torch.arange(seqlen), indexing="ij")
    for b in range(docs.shape[0]):
        dense = (kv <= q) & (docs[b, q] == docs[b, kv])
        assert torch.equal(ours.mask_mod(torch.tensor(b), torch.tensor(0), q, kv), dense)


@pytest.mark.slow
@pytest.mark.version_specific
def test_flex_equals_dense_mask_eager() -> None:
    sdpa, flex = models()
    positions, docs = packed([50, 130, 100, 20], [128, 128, 44])
    tokens = torch.randint(0, ARGS.vocab_size, (2, SEQ))
    with torch.no_grad():
        ref = sdpa(tokens, positions, docs)
        out = flex(tokens, positions, docs)
        leaky = flex(tokens, positions)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # ... and the comparison would catch attention across documents.
    assert not torch.allclose(leaky, ref, atol=1e-2)


@pytest.mark.slow
@pytest.mark.version_specific
def test_flex_equals_dense_mask_in_compiled_blocks_without_recompiling() -> None:
    torch._dynamo.reset()
    sdpa, flex = models()
    counter = CompileCounterWithBackend("inductor")
    for name, block in flex.layers.items():
        flex.layers[name] = torch.compile(block, fullgraph=True, backend=counter)
    tokens = torch.randint(0, ARGS.vocab_size, (2, SEQ))
    with torch.no_grad():
        for rows in (([50, 130, 100, 20], [300]), ([10, 10, 280], [128, 128, 44])):
            positions, docs = packed(*rows)
            torch.testing.assert_close(flex(tokens, positions, docs), sdpa(tokens, positions, docs),
                                       atol=1e-4, rtol=1e-4)
    # One graph for both blocks and both document layouts: the mask is an input, not a constant.
    assert counter.frame_count == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention has no backward on CPU")
@pytest.mark.parametrize("compiled", [False, True])
def test_flex_gradients_equal_dense_mask_on_cuda(compiled: bool) -> None:
    torch._dynamo.reset()
    sdpa, flex = models("cuda")
    if compiled:
        for model in (sdpa, flex):
            for block in model.layers.values():
                block.compile(fullgraph=True)
    positions, docs = (t.cuda() for t in packed([50, 130, 100, 20], [128, 128, 44]))
    tokens = torch.randint(0, ARGS.vocab_size, (2, SEQ), device="cuda")
    for model in (sdpa, flex):
        model(tokens, positions, docs).float().square().mean().backward()
    for (name, p), p_ref in zip(flex.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_auto_is_flex_only_for_compiled_cuda_blocks() -> None:
    assert resolve_attention("auto", compiled=True, device_type="cuda") == "flex"
    assert resolve_attention("auto", compiled=False, device_type="cuda") == "sdpa"
    assert resolve_attention("auto", compiled=True, device_type="cpu") == "sdpa"
    assert resolve_attention("sdpa", compiled=True, device_type="cuda") == "sdpa"
    assert resolve_attention("flex", compiled=False, device_type="cuda") == "flex"
    cfg = build_config(["--config", "configs/debug_sft.toml", "--compile.mode", "block"])
    assert model_args_for(cfg, None, "cpu").attention == "sdpa"
    cfg = build_config(["--config", "configs/debug_sft.toml", "--model.attention", "flex"])
    with pytest.raises(UserError, match=r"model\.attention = 'flex' needs CUDA"):
        model_args_for(cfg, None, "cpu")


def test_flex_on_cpu_is_one_error_line(tmp_path) -> None:
    proc = run_train(["--config", "configs/debug_sft.toml", "--model.attention", "flex",
                      "--job.dump_folder", str(tmp_path)])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: model.attention = 'flex' needs CUDA (torch {torch.__version__} has no flex_attention "
        "backward on cpu); use 'auto' or 'sdpa'"
    ]


def test_memory_plan_counts_no_dense_mask_with_flex() -> None:
    args = dataclasses.replace(LlamaArgs(), n_layers=4)
    kw = {"batch_size": 2, "seq_len": 4096, "ac_mode": "none", "float8": True}
    unpacked = estimate(args, **kw)
    dense = estimate(args, **kw, packed=True, attention_kernel="sdpa")
    flex = estimate(args, **kw, packed=True, attention_kernel="flex")
    assert dense.activations - unpacked.activations == 2 * 4096**2
    # four int32 tables of 2 rows x 32 x 32 tiles
    assert flex.activations - unpacked.activations == 4 * 2 * 32 * 32 * 4


@pytest.mark.slow
def test_flex_under_tensor_parallel_and_activation_checkpointing() -> None:
    """TP=2 (heads sharded: flex sees each rank's local heads), full AC, FSDP wrapping: logits of
    flex and of the dense mask agree (forward, eager blocks: see tests/wrappers/flex_tp_forward.py)."""
    from tests.helpers import run_train

    proc = run_train([], nproc=2, timeout=900, script="tests/wrappers/flex_tp_forward.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "flex == sdpa under TP=2" in proc.stdout
