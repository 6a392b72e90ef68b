"""Per-block torch.compile: one full graph, shared by every block."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from models.llama import LlamaArgs, Transformer

TINY = LlamaArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=64
)


@pytest.mark.slow
@pytest.mark.version_specific
def test_blocks_compile_fullgraph_once_and_match_eager() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = Transformer(TINY)
    eager.init_weights()
    compiled = Transformer(TINY)
    compiled.load_state_dict(eager.state_dict())
    counter = CompileCounterWithBackend("inductor")
    for name, block in compiled.layers.items():
        compiled.layers[name] = torch.compile(block, fullgraph=True, backend=counter)

    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    out = compiled(tokens)
    ref = eager(tokens)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # Identical blocks: dynamo traces the first and reuses its code for the second.
    assert counter.frame_count == 1

    out.float().square().mean().backward()
    ref.float().square().mean().backward()
    for (name, p), p_ref in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-4, rtol=1e-3, msg=name)
    assert counter.frame_count == 1
