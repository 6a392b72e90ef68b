"""The blockwise recipe on a GPU (sm_90: H100/H200): cuBLAS's block-scaled GEMM through
`aten._scaled_mm_v2` against the emulated one (the same float8 values and scales, dequantized and
multiplied in fp32) at LLaMA-2-7B shapes, K = 11008 (86 blocks: the weight scales' padding) and
a token count that is not a multiple of 4 included; the Triton block casts bitwise the reference
casts; the blockwise linear's SQNR against fp32, eager and compiled, and compiled bitwise eager. Skipped without CUDA;
tests/float8/test_blockwise.py and tests/float8/test_kernels_blocks.py are the CPU side."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from float8 import Float8Config, Float8Linear
from float8.blocks import cast_blockwise, cast_blockwise_t
from float8.gemm import blockwise_gemm_supported, blockwise_mm
from float8.operands import eager_backend
from tests.helpers import linear_step, sqnr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not blockwise_gemm_supported(torch.device("cuda")),
                       reason="needs a CUDA GPU with block-scaled float8 GEMMs (sm_90)"),
]

E4M3 = torch.float8_e4m3fn
B = 128
CUDA = torch.device("cuda")


def _operands(m: int, k: int, n: int, b_block: tuple[int, int]):
    torch.manual_seed(m + k + n)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16) * torch.logspace(-2, 2, k, device=CUDA).to(torch.bfloat16)
    w = torch.randn(n, k, device=CUDA, dtype=torch.bfloat16)
    a, a_scale = cast_blockwise(x, (1, B), E4M3, fused=False)
    b, b_scale = cast_blockwise(w, b_block, E4M3, fused=False)
    return a, b, a_scale.reciprocal(), b_scale.reciprocal()


@pytest.mark.parametrize(("m", "k", "n"), [(8192, 4096, 4096), (8192, 4096, 11008), (8192, 11008, 4096), (1030, 256, 384)])
@pytest.mark.parametrize("b_block", [(B, B), (1, B)])
def test_cublas_gemm_is_the_emulated_one(m, k, n, b_block):
    # Same float8 values and scales: the two differ by fp32 summation order and then bf16 rounding only.
    # (torch._scaled_mm with these scales returned -70 dB for K = 11008, without an error.)
    a, b, a_inv, b_inv = _operands(m, k, n, b_block)
    real = blockwise_mm(a, b, a_inv, b_inv, (1, B), b_block, torch.bfloat16, emulate=False)
    emulated = blockwise_mm(a, b, a_inv, b_inv, (1, B), b_block, torch.bfloat16, emulate=True)
    assert real.shape == (m, n) and sqnr(emulated.float(), real.float()) >= 45


def test_cublas_gemm_compiles_fullgraph():
    a, b, a_inv, b_inv = _operands(1024, 11008, 512, (B, B))

    def gemm(a, b, a_inv, b_inv):
        return blockwise_mm(a, b, a_inv, b_inv, (1, B), (B, B), torch.bfloat16, emulate=False)

    compiled = torch.compile(gemm, fullgraph=True)
    assert sqnr(gemm(a, b, a_inv, b_inv).float(), compiled(a, b, a_inv, b_inv).float()) >= 60


@pytest.mark.parametrize("block", [(1, B), (B, B)])
@pytest.mark.parametrize("shape", [(1, 17), (1030, 4096), (8192, 11008), (4096, 11008)])
def test_block_kernels_are_the_reference_casts_bitwise(shape, block):
    from float8.kernels.blocks import cast_blockwise_layouts

    x = torch.randn(shape, device=CUDA, dtype=torch.bfloat16) * 3
    x[:, :B] = 0
    data, data_t, scale, inv, scale_t, inv_t = cast_blockwise_layouts(x, block, E4M3, transposed=True)
    ref, ref_scale = cast_blockwise(x, block, E4M3, fused=False)
    ref_t, ref_scale_t = cast_blockwise_t(x, block, E4M3, fused=False)
    assert torch.equal(data.view(torch.uint8), ref.view(torch.uint8)) and torch.equal(scale, ref_scale)
    assert torch.equal(data_t.view(torch.uint8), ref_t.view(torch.uint8)) and torch.equal(scale_t, ref_scale_t)
    assert torch.equal(inv, ref_scale.reciprocal()) and torch.equal(inv_t, ref_scale_t.reciprocal())


@pytest.mark.parametrize("compiled", [False, True])
def test_blockwise_linear_sqnr_on_cuda(compiled):
    torch.manual_seed(0)
    ref = nn.Linear(4096, 11008, bias=False, device=CUDA)
    f8 = Float8Linear.from_float(copy.deepcopy(ref).to(torch.bfloat16), Float8Config(scaling="blockwise"))
    assert eager_backend("cuda", "auto") == "triton"
    if compiled:
        f8.compile(fullgraph=True)
    x, g = torch.randn(4094, 4096, device=CUDA), torch.randn(4094, 11008, device=CUDA)
    exact, got = (linear_step(module, x, g, dtype) for module, dtype in ((ref, torch.float32), (f8, torch.bfloat16)))
    dbs = [sqnr(e.float(), a.float()) for e, a in zip(exact, got)]
    assert dbs[0] >= 28 and dbs[1] >= 25 and dbs[2] >= 25, dbs


def test_compiled_blockwise_linear_is_the_eager_one_bitwise():
    # Compiled, the block casts are the kernels' op (float8/operands.py, "graph"), the GEMMs cuBLAS's: as in eager.
    torch.manual_seed(0)
    ref = nn.Linear(4096, 11008, bias=False, device=CUDA, dtype=torch.bfloat16)
    x, g = torch.randn(4094, 4096, device=CUDA, dtype=torch.bfloat16), torch.randn(4094, 11008, device=CUDA, dtype=torch.bfloat16)
    eager, compiled = (
        linear_step(wrap(Float8Linear.from_float(copy.deepcopy(ref), Float8Config(scaling="blockwise"))), x, g)
        for wrap in (lambda m: m, lambda m: torch.compile(m, fullgraph=True))  # the compiled module's weight is m's
    )
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
