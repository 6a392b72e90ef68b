"""float8/kernels/blocks.py under the Triton interpreter, on CPU tensors: per-tile scales and inverses
bitwise float8/blocks.py's reference casts, in the layouts cuBLAS reads (1x128 tile scales stored
column by column, 128x128 block scales in rows padded to 4), both layouts from one launch, and the
float8 bytes the interpreter's rounding of the reference's fp32 values (as tests/float8/test_kernels.py
compares the other kernels; tests/float8/test_blockwise_cuda.py compares them bit for bit on a GPU);
and Float8Linear with eager_casts="triton" bitwise the plain one."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from float8 import Float8Config, Float8Linear
from float8.blocks import cast_blockwise, cast_blockwise_t

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the kernels in Triton's interpreter (tests/conftest.py sets it without a GPU)", allow_module_level=True)

pytestmark = pytest.mark.version_specific

pytest.importorskip("triton")

from float8.kernels.blocks import cast_blockwise_layouts  # noqa: E402
from tests.float8.test_kernels import _exact_values, rounding  # noqa: E402
from tests.helpers import linear_step  # noqa: E402

E4M3 = torch.float8_e4m3fn
B = 128


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _reference_values(x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The reference cast's fp32 values before the float8 rounding."""
    full = scale.repeat_interleave(block[0], 0)[: x.shape[0]].repeat_interleave(block[1], 1)[:, : x.shape[1]]
    return (x.float() * full).clamp(-448, 448)


def _inputs(shape: tuple[int, int]) -> torch.Tensor:
    torch.manual_seed(shape[0] + shape[1])
    x = torch.randn(shape) * torch.logspace(-4, 4, shape[1])
    x[: min(3, shape[0]), : min(B, shape[1])] = 0  # an all-zero 1x128 tile (and, for 3 rows or fewer, block)
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("block", [(1, B), (B, B)])
@pytest.mark.parametrize("shape", [(1, 17), (3, 300), (130, 256), (256, 128)])
def test_block_kernels_match_reference(shape, block):
    x = _inputs(shape)
    data, data_t, scale, inv, scale_t, inv_t = cast_blockwise_layouts(x, block, E4M3, transposed=True)
    _, ref = cast_blockwise(x, block, E4M3, fused=False)
    _, ref_t = cast_blockwise_t(x, block, E4M3, fused=False)
    for got, want in ((scale, ref), (inv, ref.reciprocal()), (scale_t, ref_t), (inv_t, ref_t.reciprocal())):
        assert torch.equal(got, want)
    assert torch.equal(_bytes(data), _bytes(rounding(_reference_values(x, ref, block), E4M3)))
    assert torch.equal(_bytes(data_t), _bytes(rounding(_reference_values(x.t(), ref_t, block), E4M3)))
    m, k = shape
    if block == (1, B):  # stored as cuBLAS's 1x128 operands take them: column by column
        assert (scale.stride(), scale_t.stride()) == ((1, m), (1, k))
    else:  # rows of the padded buffer cuBLAS's 128x128 operand reads: (blocks, round_up(blocks, 4))
        def padded_blocks(n: int) -> int:
            return (n + 4 * B - 1) // (4 * B) * 4
        assert (scale.stride(0), scale_t.stride(0)) == (padded_blocks(k), padded_blocks(m))
    # One layout alone: the same bytes and scales as that half of the pair.
    rows = cast_blockwise_layouts(x, block, E4M3)
    assert rows[1] is None and rows[4] is None and torch.equal(_bytes(rows[0]), _bytes(data)) and torch.equal(rows[2], scale)
    cols = cast_blockwise_layouts(x, block, E4M3, rowmajor=False, transposed=True)
    assert cols[0] is None and cols[2] is None and torch.equal(_bytes(cols[1]), _bytes(data_t)) and torch.equal(cols[4], scale_t)


def test_weight_recast_with_known_block_scales():
    # backward's transposed weight: the forward's block scales, no amax, the transposed bytes alone.
    x = _inputs((256, 384))
    data, _, scale, *_ = cast_blockwise_layouts(x, (B, B), E4M3)
    _, data_t, *rest = cast_blockwise_layouts(x, (B, B), E4M3, scale=scale, rowmajor=False, transposed=True)
    assert rest == [None] * 4 and torch.equal(_bytes(data_t), _bytes(data.t()))


def test_block_kernels_refuse_tiles_they_do_not_index():
    with pytest.raises(ValueError, match="1 x B or B x B tiles"):
        cast_blockwise_layouts(torch.zeros(4, 8), (2, 128), E4M3)


@pytest.fixture
def triton_casts():
    from float8.operands import eager_backend

    eager_backend.cache_clear()
    yield
    eager_backend.cache_clear()


def test_float8_linear_with_block_kernels_is_the_plain_linear(triton_casts):
    """Every operand's tiles, scales and layouts wired as the plain casts wire them (with values every
    cast represents exactly, so the interpreter's float8 rounding plays no part): bitwise equal, in
    eager and compiled by inductor, whose code calls the kernels' op for every block cast. In bf16:
    inductor leaves out a float32 result's round trip through bf16, which eager makes."""
    from torch._inductor.utils import run_and_get_code

    ref = nn.Linear(128, 256, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(_exact_values((256, 128)))
    x, g = _exact_values((136, 128)).bfloat16(), _exact_values((136, 256)).bfloat16()
    results, codes = [], []
    for eager_casts, compiled in (("plain", False), ("triton", False), ("triton", True)):
        f8 = Float8Linear.from_float(copy.deepcopy(ref), Float8Config(scaling="blockwise", eager_casts=eager_casts))
        if compiled:
            result, code = run_and_get_code(linear_step, torch.compile(f8, fullgraph=True), x, g)
            codes += code
        else:
            result = linear_step(f8, x, g)
        results.append(result)
    for plain, *with_kernels in zip(*results):
        assert all(torch.equal(plain, t) for t in with_kernels)
    # forward: x (both layouts) and w; backward: g (both layouts) and w recast with its scales.
    assert [c.count("torch.ops.float8_training.cast_blocks.default(") for c in codes] == [2, 2]
