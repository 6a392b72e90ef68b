"""float8/kernels under the Triton interpreter, on CPU tensors (no GPU: tests/conftest.py): amaxes, scales, inverse scales,
masks and both layouts exactly as float8/scaling.py's reference casts; and Float8Linear with
eager_casts="triton" wired exactly as the plain casts. The interpreter rounds to float8 its own
way (values just below a power of two even lose their carry), so the float8 bytes are compared
with the interpreter's own rounding of the reference's fp32 values, and the Float8Linear test
uses values every cast represents exactly. tests/float8/test_kernels_cuda.py compares the
compiled kernels with the reference bit for bit on a GPU."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from float8 import Float8Config, Float8Linear
from float8.scaling import (
    E4M3,
    E5M2,
    cast_colwise_t,
    cast_rowwise,
    cast_tensorwise,
    cast_with_scale,
)
from tests.helpers import assert_compiles_for_hopper, cpu_float8_emulated, linear_step

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the kernels in Triton's interpreter (tests/conftest.py sets it without a GPU)", allow_module_level=True)

pytestmark = pytest.mark.version_specific

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from float8.kernels import cast as kernels  # noqa: E402

SHAPES = [(1, 1), (1, 17), (100, 70), (128, 64), (65, 130)]
DTYPES = [E4M3, E5M2]


@triton.jit
def _convert(x_ptr, out_ptr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n).to(DTYPE), mask=offs < n)


def rounding(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The interpreter's fp32 -> float8 rounding, the one the kernels' stores use."""
    y = y.float().contiguous()
    out = torch.empty(y.shape, dtype=dtype)
    if y.numel():
        _convert[(triton.cdiv(y.numel(), 1024),)](y, out, y.numel(), DTYPE=kernels._TRITON_DTYPES[dtype], BLOCK=1024)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_same_float8(got: torch.Tensor, scaled: torch.Tensor, dtype: torch.dtype) -> None:
    """`got` holds the interpreter's rounding of the reference's fp32 values `scaled`, except
    where those are NaN: the interpreter turns a NaN into a number that depends on its payload
    (the GPU test checks those bytes)."""
    finite = ~scaled.isnan()
    assert torch.equal(_bytes(got)[finite], _bytes(rounding(scaled, dtype))[finite])


def _scaled(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cast_with_scale's fp32 values before its float8 rounding."""
    fmax = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-fmax, fmax)


def _assert_same_scales(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def _inputs(shape, case: str) -> torch.Tensor:
    torch.manual_seed(sum(shape))
    x = torch.randn(shape) * 3
    if case == "zeros":
        x.zero_()
    elif case == "nonfinite":
        x.view(-1)[0] = float("nan")
        x.view(-1)[-1] = float("inf")
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("case", ["random", "zeros", "nonfinite"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_tensorwise_kernels_match_reference(shape, dtype, pow2, case):
    x = _inputs(shape, case)
    data, data_t, scale, inv = kernels.cast_tensorwise_layouts(x, dtype, pow2, transposed=True)
    _, ref_scale = cast_tensorwise(x, dtype, pow2, fused=False)
    _assert_same_scales(scale, ref_scale)
    _assert_same_scales(inv, ref_scale.reciprocal())
    # cuBLAS float8 GEMMs refuse scales that do not start 16-byte aligned.
    assert scale.data_ptr() % 16 == 0 and inv.data_ptr() % 16 == 0
    scaled = _scaled(x, ref_scale, dtype)
    _assert_same_float8(data, scaled, dtype)
    _assert_same_float8(data_t, scaled.t(), dtype)
    # With the scale given: no amax pass, either layout alone.
    only_rows, none_t, given, no_inv = kernels.cast_tensorwise_layouts(x, dtype, scale=ref_scale)
    assert none_t is None and no_inv is None and given is ref_scale
    _assert_same_float8(only_rows, scaled, dtype)
    _, only_t, _, _ = kernels.cast_tensorwise_layouts(x, dtype, scale=ref_scale, rowmajor=False, transposed=True)
    _assert_same_float8(only_t, scaled.t(), dtype)


@pytest.mark.parametrize("case", ["random", "zeros", "nonfinite"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rowwise_kernels_match_reference(shape, dtype, case):
    x = _inputs(shape, case)
    data, data_t, row_scale, row_inv, col_scale, col_inv = kernels.cast_rowwise_layouts(x, dtype, True, transposed=True)
    _, ref_rows = cast_rowwise(x, -1, dtype, True, fused=False)
    _, ref_cols = cast_colwise_t(x, dtype, True, fused=False)
    _assert_same_scales(row_scale, ref_rows)
    _assert_same_scales(col_scale, ref_cols)
    _assert_same_scales(row_inv, ref_rows.reciprocal())
    _assert_same_scales(col_inv, ref_cols.reciprocal())
    assert all(t.data_ptr() % 16 == 0 for t in (row_scale, row_inv, col_scale, col_inv))
    _assert_same_float8(data, _scaled(x, ref_rows, dtype), dtype)
    _assert_same_float8(data_t, _scaled(x, ref_cols.t(), dtype).t(), dtype)
    # One layout alone: the same bytes and scales as that half of the pair.
    rows_only = kernels.cast_rowwise_layouts(x, dtype, True)
    assert rows_only[1] is None and rows_only[4] is None
    assert torch.equal(_bytes(rows_only[0]), _bytes(data))
    _assert_same_scales(rows_only[2], row_scale)
    cols_only = kernels.cast_rowwise_layouts(x, dtype, True, rowmajor=False, transposed=True)
    assert cols_only[0] is None and cols_only[2] is None
    assert torch.equal(_bytes(cols_only[1]), _bytes(data_t))
    _assert_same_scales(cols_only[4], col_scale)


@pytest.mark.parametrize("shape", [(1, 1), (3, 200), (129, 65), (64, 64)])
def test_transpose_kernel(shape):
    data = torch.randint(0, 256, shape, dtype=torch.uint8).view(E4M3)
    assert torch.equal(_bytes(kernels.transpose(data)), _bytes(data.t()))


def test_kernels_refuse_what_they_do_not_index():
    with pytest.raises(ValueError, match="contiguous 2-D"):
        kernels.cast_tensorwise_layouts(torch.zeros(4, 8).t(), E4M3)
    with pytest.raises(ValueError, match="contiguous 2-D"):
        kernels.transpose(torch.zeros(2, 2, 2, dtype=torch.uint8))


def _exact_values(shape, dtype=torch.float32) -> torch.Tensor:
    """Values every cast here represents exactly, with 448 (e4m3's maximum) in every row and
    column: signed 2**e * (1 + m/4), e in [-3, 8) (on e5m2's grid, and on e4m3's), so scales
    are powers of two (e4m3 1, e5m2 128) and no float8 rounding happens."""
    torch.manual_seed(shape[0] * 131 + shape[1])
    mantissa = 1 + torch.randint(0, 4, shape) / 4
    values = torch.exp2(torch.randint(-3, 8, shape).float()) * mantissa
    values *= torch.randint(0, 2, shape) * 2 - 1
    rows = torch.arange(max(shape))
    values[rows % shape[0], rows % shape[1]] = 448.0
    return values.to(dtype)


@pytest.fixture
def triton_casts():
    """eager_casts="triton" on this CPU (the interpreter is on: eager_backend allows it)."""
    from float8.operands import eager_backend

    eager_backend.cache_clear()
    yield
    eager_backend.cache_clear()


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "rowwise_gw_hp"])
def test_float8_linear_with_kernels_is_the_plain_linear(triton_casts, scaling):
    """Every operand's layout, scale and inverse wired as the plain casts wire them: out,
    grad_x and grad_w bitwise equal."""
    emulate = cpu_float8_emulated(scaling)
    ref = nn.Linear(96, 80, bias=False)
    with torch.no_grad():
        ref.weight.copy_(_exact_values((80, 96)))
    x, g = _exact_values((48, 96)), _exact_values((48, 80))
    plain, with_kernels = (
        linear_step(Float8Linear.from_float(copy.deepcopy(ref), Float8Config(scaling=scaling, emulate=emulate, eager_casts=c)), x, g)
        for c in ("plain", "triton")
    )
    assert all(torch.equal(a, b) for a, b in zip(plain, with_kernels))


def _graphs_compiled(graphs: list[torch.fx.GraphModule]):
    """A torch.compile backend that runs AOTAutograd's forward and backward graphs as they are (no
    inductor: seconds instead of a minute) and keeps them in `graphs`."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(graph: torch.fx.GraphModule, _):
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


@pytest.mark.parametrize(("scaling", "ops"), [("rowwise", [1, 2]), ("rowwise_gw_hp", [0, 1])])
def test_compiled_rowwise_linear_calls_the_kernels_op(triton_casts, scaling, ops, fresh_dynamo):
    """Compiled, the per-row casts that write a transposed layout are the kernels' op (forward: x in
    both layouts; backward: g in both, w transposed), the rest traced: out, grad_x and grad_w bitwise
    those of the linear compiled with every cast traced (inductor's code on a GPU:
    tests/float8/test_kernels_cuda.py)."""
    ref = nn.Linear(96, 80, bias=False)
    with torch.no_grad():
        ref.weight.copy_(_exact_values((80, 96)))
    x, g = _exact_values((48, 96)), _exact_values((48, 80))
    results, counts = [], []
    for eager_casts in ("plain", "triton"):
        config = Float8Config(scaling=scaling, emulate=cpu_float8_emulated(scaling), eager_casts=eager_casts)
        graphs: list[torch.fx.GraphModule] = []
        f8 = torch.compile(Float8Linear.from_float(copy.deepcopy(ref), config), fullgraph=True, backend=_graphs_compiled(graphs))
        results.append(linear_step(f8, x, g))
        counts.append([sum(n.target is torch.ops.float8_training.cast_rows.default for n in gm.graph.nodes) for gm in graphs])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert counts == [[0, 0], ops]


def test_fsdp_weight_cast_uses_the_kernel(triton_casts, monkeypatch):
    import float8.operands as operands

    monkeypatch.setattr(operands, "eager_backend", lambda device_type, mode: "triton")
    calls = []
    monkeypatch.setattr(operands, "_kernels", lambda: calls.append(1) or kernels)
    shard = _exact_values((40, 64))
    scale = torch.tensor(1.0)
    assert torch.equal(_bytes(operands.cast_weight_with_scale(shard, scale, E4M3)), _bytes(cast_with_scale(shard, scale, E4M3)))
    assert calls
    # The kept shard is rewritten in place: the same storage, the new values.
    kept = torch.empty(40, 64, dtype=E4M3)
    written = operands.cast_weight_with_scale(2 * shard, scale, E4M3, out=kept)
    assert written.data_ptr() == kept.data_ptr()
    assert torch.equal(_bytes(kept), _bytes(cast_with_scale(2 * shard, scale, E4M3)))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        kernels.cast_tensorwise_layouts(shard, E4M3, scale=scale, out=kept[:20])
    # An empty shard (more ranks than rows) takes the reference path.
    assert operands.cast_weight_with_scale(shard[:0], scale, E4M3).shape == (0, 64)


def test_triton_backend_refused_where_it_cannot_run(monkeypatch):
    import float8.operands as operands

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    operands.eager_backend.cache_clear()
    try:
        with pytest.raises(ValueError, match="eager_casts='triton' needs Triton and a CUDA device"):
            operands.eager_backend("cpu", "triton")
        assert operands.eager_backend("cpu", "auto") == "plain"
    finally:
        operands.eager_backend.cache_clear()


_COMPILE_FOR_HOPPER = '''
import itertools

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from float8.kernels import cast as kernels

def compile(fn, signature, constexprs):
    for name in constexprs:
        signature[name] = "constexpr"
    triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", 90, 32))

def all_pairs(*choices):
    """Rows in which every two choices of any two factors meet at least once (greedy)."""
    rows = list(itertools.product(*choices))
    factor_pairs = list(itertools.combinations(range(len(choices)), 2))
    unmet = {(i, row[i], j, row[j]) for row in rows for i, j in factor_pairs}
    while unmet:
        row = max(rows, key=lambda r: sum((i, r[i], j, r[j]) in unmet for i, j in factor_pairs))
        unmet -= {(i, row[i], j, row[j]) for i, j in factor_pairs}
        yield row

tile = {"BM": kernels.BLOCK_M, "BK": kernels.BLOCK_K}
# All pairs of choices rather than all 144 combinations: a kernel's constexpr branches meet at most
# two at a time, and each Hopper compile takes 2-3 s on a CPU. (fp32, True): an fp32 weight read as its bf16 copy.
for (dtype, name, fmax), (rowwise, given), pow2, layouts, (x, bf16_first) in all_pairs(
    [(tl.float8e4nv, "fp8e4nv", 448.0), (tl.float8e5, "fp8e5", 57344.0)],
    [(False, False), (False, True), (True, False)], [False, True],
    [(True, False), (False, True), (True, True)], [("bf16", False), ("fp32", False), ("fp32", True)],
):
    compile(kernels._cast_kernel,
            {"x_ptr": f"*{x}", "out_ptr": f"*{name}", "out_t_ptr": f"*{name}", "amax_ptr": "*i32", "scales_ptr": "*fp32",
             "M": "i32", "K": "i32"},
            {"ROWWISE": rowwise, "SCALE_GIVEN": given, "WRITE": layouts[0], "WRITE_T": layouts[1], "DTYPE": dtype,
             "FMAX": fmax, "POW2": pow2, "EXACT": True, "BF16_FIRST": bf16_first, **tile})
compile(kernels._amax_flat_kernel, {"x_ptr": "*bf16", "amax_ptr": "*i32", "n": "i32"}, {"BLOCK": kernels.AMAX_BLOCK})
for rows, cols, x in [(True, False, "bf16"), (False, True, "bf16"), (True, True, "bf16"), (True, True, "fp32")]:
    compile(kernels._amax_2d_kernel, {"x_ptr": f"*{x}", "amax_ptr": "*i32", "M": "i32", "K": "i32"},
            {"ROWS": rows, "COLS": cols, **tile})
compile(kernels._transpose_kernel, {"x_ptr": "*u8", "out_ptr": "*u8", "M": "i32", "K": "i32"}, tile)
print("compiled")
'''


def test_kernels_compile_for_hopper():
    """Every kernel variant the launchers use compiles to sm_90 code with the GPU's own
    compiler passes (Triton ships ptxas; no GPU needed): the interpreter checks none of what
    only the compiler does, such as that kernels read globals only as constexprs."""
    assert_compiles_for_hopper(_COMPILE_FOR_HOPPER)


@pytest.mark.parametrize("shape", [(100, 70), (65, 130)])
def test_rowwise_kernels_read_fp32_as_its_bf16_copy(shape):
    x = torch.randn(shape)
    # A value that bf16 rounds onto an e4m3 tie (1 + 1/16 + 2^-10 -> 1.0625): cast from fp32 it rounds up instead.
    x[::3, ::5] = 1.0625 + 2.0**-10
    # A row's and a column's amax that bf16 rounds down onto 1.75, where the power-of-two scale 448 / amax
    # steps: the amaxes of x as stored, given, must be rounded as the values are.
    x[1], x[:, 2] = 0.01 * x[1], 0.01 * x[:, 2]
    x[1, 3] = x[4, 2] = 1.75 + 2.0**-12
    amax = kernels.amax_rows_and_columns(x)
    assert torch.equal(amax, torch.cat([x.abs().amax(1), x.abs().amax(0)]))
    for rowmajor, transposed in ((True, False), (False, True), (True, True)):
        layouts = {"rowmajor": rowmajor, "transposed": transposed}
        copy_cast = kernels.cast_rowwise_layouts(x.to(torch.bfloat16), E4M3, True, **layouts)
        read_cast = kernels.cast_rowwise_layouts(x, E4M3, True, bf16_first=True, **layouts)
        read_with_amax = kernels.cast_rowwise_layouts(x, E4M3, True, bf16_first=True, amax=amax, **layouts)
        fp32_cast = kernels.cast_rowwise_layouts(x, E4M3, True, **layouts)
        for copy_part, read_part, amax_part, fp32_part in zip(copy_cast, read_cast, read_with_amax, fp32_cast):
            assert (copy_part is None) == (read_part is None) == (amax_part is None)
            if copy_part is not None and copy_part.dtype == E4M3:
                assert torch.equal(_bytes(read_part), _bytes(copy_part))
                assert torch.equal(_bytes(amax_part), _bytes(copy_part))
                assert not torch.equal(_bytes(fp32_part), _bytes(copy_part))
            elif copy_part is not None:
                assert torch.equal(read_part, copy_part) and torch.equal(amax_part, copy_part)


def test_weight_read_as_stored_is_cast_for_both_gemms_in_one_forward_op():
    # With its amaxes known, a weight read as stored is cast per row and per column transposed by one op in
    # the forward (one read of the fp32 weight); the backward casts only the gradient.
    import functools

    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from float8.gathered import StoredWeight
    from float8.linear import float8_mm

    casts = {}

    def counting(name):
        def compiler(gm, _inputs):
            casts[name] = sum(n.target is torch.ops.float8_training.cast_rows.default for n in gm.graph.nodes)
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=counting("forward"), bw_compiler=counting("backward"),
                           partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))
    config = Float8Config(scaling="rowwise", eager_casts="triton")
    mm = torch.compile(lambda x, w: float8_mm(x, w, config), backend=backend, fullgraph=True)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w32 = torch.randn(48, 64)
    w = StoredWeight(w32, torch.bfloat16, kernels.amax_rows_and_columns(w32)).requires_grad_()
    mm(x, w).sum().backward()
    # x's and the weight's casts (both layouts each) in the forward, the gradient's in the backward.
    assert casts == {"forward": 2, "backward": 1}
