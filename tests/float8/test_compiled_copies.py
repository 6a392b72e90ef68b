"""Under torch.compile, one transposed float8 copy of an input that several linears read (float8/operands.py,
`one_buffer`): wq, wk and wv's weight gradients read one copy of the attention norm's output.

Counted in inductor's code on CPU, with the float8 GEMMs as `torch._scaled_mm` extern kernels, as on CUDA.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import float8.gemm
import float8.operands
from float8 import Float8Config, convert_to_float8_training

pytestmark = [pytest.mark.slow, pytest.mark.version_specific]

T, D = 48, 64  # tokens and features differ, so a (T, D) buffer is an activation's, never a weight's


class NormThenThree(nn.Module):
    """An RMS norm read by three projections, as attention's wq, wk and wv read theirs."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.rand(D) + 0.5)
        self.wq, self.wk, self.wv = (nn.Linear(D, D, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * self.norm
        return self.wq(x) * self.wk(x) + self.wv(x)


def _compiled_grads(force: bool, monkeypatch) -> tuple[int, list[torch.Tensor]]:
    """(transposed float8 (T, D) buffers the compiled backward writes, gradients of x and the parameters)."""
    if not force:
        monkeypatch.setattr(float8.operands, "_stride_forcing_registered", lambda: False)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = NormThenThree().to(torch.bfloat16)
    convert_to_float8_training(model, config=Float8Config(scaling="tensorwise"))
    model.compile(backend="inductor", fullgraph=True)
    x = torch.randn(T, D, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, D, dtype=torch.bfloat16)
    _, (_, backward) = run_and_get_code(lambda: model(x).backward(g))
    transposed = re.findall(rf"empty_strided_cpu\(\((?:{T}, {D}\), \(1, {T}|{D}, {T}\), \({T}, 1)\), torch\.float8_e4m3fn\)",
                            backward)
    return len(transposed), [x.grad, *(p.grad for p in model.parameters())]


def test_linears_reading_one_input_share_its_transposed_float8_copy(monkeypatch):
    monkeypatch.setattr(float8.gemm, "scaled_mm_cpu", lambda a, b, a_inv, b_inv, dtype:
                        torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=dtype))
    copies, grads = _compiled_grads(True, monkeypatch)
    inlined, ref = _compiled_grads(False, monkeypatch)
    assert (copies, inlined) == (1, 3), f"transposed float8 copies of the shared input: {copies} forced, {inlined} left to inductor"
    for got, want in zip(grads, ref):
        assert torch.equal(got, want), "one copy changed a gradient's value"
