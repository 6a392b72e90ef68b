"""float8/kernels compiled for a GPU: every byte, scale and inverse scale bitwise those of
float8/scaling.py's reference casts (NaN and inf inputs included), and Float8Linear with
eager_casts="triton" bitwise the plain and the compiled eager casts. Skipped without CUDA;
tests/float8/test_kernels.py runs the same kernels in Triton's interpreter on a CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from float8 import Float8Config, Float8Linear
from float8.operands import cast_weight_with_scale, eager_backend
from float8.scaling import (
    E4M3,
    E5M2,
    cast_colwise_t,
    cast_rowwise,
    cast_tensorwise,
    cast_with_scale,
)
from tests.helpers import linear_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHAPES = [(1, 17), (1000, 1030), (8192, 4096), (4096, 11008)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same_scales(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise, NaN payloads included."""
    return got.shape == want.shape and torch.equal(got.reshape(-1).view(torch.int32), want.reshape(-1).view(torch.int32))


def _inputs(shape, case: str, dtype=torch.bfloat16) -> torch.Tensor:
    torch.manual_seed(sum(shape))
    x = torch.randn(shape, device="cuda") * 3
    if case == "zeros":
        x.zero_()
    elif case == "nonfinite":
        x[0, 0] = float("nan")
        x[-1, -1] = float("inf")
        x.view(-1)[x.numel() // 2] = -float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("case", ["random", "zeros", "nonfinite"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape", SHAPES)
def test_tensorwise_kernels_bitwise(shape, dtype, pow2, case):
    from float8.kernels import cast as kernels

    x = _inputs(shape, case)
    data, data_t, scale, inv = kernels.cast_tensorwise_layouts(x, dtype, pow2, transposed=True)
    ref, ref_scale = cast_tensorwise(x, dtype, pow2, fused=False)
    assert _same_scales(scale, ref_scale) and _same_scales(inv, ref_scale.reciprocal())
    assert torch.equal(_bytes(data), _bytes(ref))
    assert torch.equal(_bytes(data_t), _bytes(ref.t()))


@pytest.mark.parametrize("case", ["random", "zeros", "nonfinite"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape", SHAPES)
def test_rowwise_kernels_bitwise(shape, dtype, case):
    from float8.kernels import cast as kernels

    x = _inputs(shape, case)
    data, data_t, row_scale, row_inv, col_scale, col_inv = kernels.cast_rowwise_layouts(x, dtype, True, transposed=True)
    ref_rows, ref_row_scale = cast_rowwise(x, -1, dtype, True, fused=False)
    ref_cols, ref_col_scale = cast_colwise_t(x, dtype, True, fused=False)
    assert _same_scales(row_scale, ref_row_scale) and _same_scales(col_scale, ref_col_scale)
    assert _same_scales(row_inv, ref_row_scale.reciprocal()) and _same_scales(col_inv, ref_col_scale.reciprocal())
    assert torch.equal(_bytes(data), _bytes(ref_rows))
    assert torch.equal(_bytes(data_t), _bytes(ref_cols))


@pytest.mark.parametrize("shape", [(4096, 4096), (11008, 4096), (3, 100)])
def test_weight_cast_and_transpose_bitwise(shape):
    from float8.kernels import cast as kernels

    w = _inputs(shape, "random", torch.float32)
    scale = torch.tensor(448.0, device="cuda") / w.abs().max()
    assert eager_backend("cuda", "auto") == "triton"
    data = cast_weight_with_scale(w, scale, E4M3)
    ref = cast_with_scale(w, scale, E4M3)
    assert torch.equal(_bytes(data), _bytes(ref))
    assert torch.equal(_bytes(kernels.transpose(data)), _bytes(ref.t()))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "rowwise_gw_hp"])
def test_linear_with_kernels_is_bitwise_the_plain_and_compiled_casts(scaling):
    torch.manual_seed(0)
    ref = nn.Linear(4096, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 2048, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(2, 2048, 1024, device="cuda", dtype=torch.bfloat16)
    results = {
        c: linear_step(Float8Linear.from_float(copy.deepcopy(ref), Float8Config(scaling=scaling, eager_casts=c)), x, g)
        for c in ("plain", "compiled", "triton")
    }
    for got, want in zip(results["triton"], results["plain"]):
        assert torch.equal(got, want)
    # Inductor's division rounds a scale 1 ulp off torch's now and then (measured on an H200,
    # torch 2.11: e5m2 scale 3423.5225 against 3423.5222), so the compiled casts are close, not equal.
    for got, want in zip(results["compiled"], results["plain"]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-1)


@pytest.mark.parametrize("scaling", ["rowwise", "rowwise_gw_hp"])
def test_compiled_rowwise_linear_is_the_eager_one_bitwise(scaling):
    # Compiled, the per-row casts into a transposed layout are the kernels' op and the row-major ones
    # inductor's (power-of-two scales: its division's 1-ulp slips round to the same scale): as in eager.
    torch.manual_seed(0)
    ref = nn.Linear(4096, 11008, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4094, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(4094, 11008, device="cuda", dtype=torch.bfloat16)
    eager, compiled = (
        linear_step(wrap(Float8Linear.from_float(copy.deepcopy(ref), Float8Config(scaling=scaling))), x, g)
        for wrap in (lambda m: m, lambda m: torch.compile(m, fullgraph=True))
    )
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.mark.parametrize("scaling", ["rowwise", "rowwise_gw_hp"])
def test_weight_read_as_stored_is_its_bf16_copy_bitwise(scaling):
    # The one-GPU unshard hands rowwise linears the fp32 shard (float8/fsdp.py, as_stored): eager (the
    # kernels round as they read) and compiled (inductor's rounding, the op's in-kernel one), the copy's bytes.
    from float8.gathered import StoredWeight
    from float8.operands import amax_rows_and_columns

    torch.manual_seed(0)
    w32 = torch.randn(11008, 4096, device="cuda") * 0.02
    x = torch.randn(4094, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(4094, 11008, device="cuda", dtype=torch.bfloat16)

    def step(weight: torch.Tensor, compiled: bool):
        with torch.device("meta"):
            linear = Float8Linear(4096, 11008, bias=False, config=Float8Config(scaling=scaling))
        linear.weight = nn.Parameter(weight)
        return linear_step(torch.compile(linear, fullgraph=True) if compiled else linear, x, g)

    for compiled in (False, True):
        stored = StoredWeight(w32, torch.bfloat16, amax_rows_and_columns(w32, "triton"))
        copy_, read = step(w32.to(torch.bfloat16), compiled), step(stored, compiled)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(copy_, read)), compiled
