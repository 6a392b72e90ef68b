"""float8/recipe.py: the recipe table, its interpreter, and bitwise parity with explicit references.

The references below spell out, with plain torch ops, what each recipe computed before the
recipes became data (the branches of the former `_Float8Matmul`): every cast, layout and
GEMM in the same order, so the table-driven linear must match them bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from float8 import Float8Config, Float8Linear
from float8.gathered import Float8GatheredWeight
from float8.recipe import HIGH_PRECISION, RECIPES, Cast, Float8Recipe, Gemm
from tests.helpers import cpu_float8_emulated, linear_step

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SCALINGS = ["tensorwise", "rowwise", "rowwise_gw_hp"]


def _cast(t: torch.Tensor, dtype: torch.dtype, amax_dim: int | None = None, pow2: bool = False):
    amax = t.abs().max() if amax_dim is None else torch.amax(t.abs(), dim=amax_dim, keepdim=True)
    fmax = torch.finfo(dtype).max
    scale = fmax / torch.clamp(amax.to(torch.float32), min=1e-12)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype), scale


def _gemm(a, b, a_scale, b_scale, out_dtype, rowwise, emulate, fast_accum=False):
    """a (row-major) @ b (column-major), both float8, scales undone; rowwise GEMMs write bf16."""
    a_inv, b_inv = a_scale.reciprocal(), b_scale.reciprocal()
    gemm_dtype = torch.bfloat16 if rowwise else out_dtype
    if emulate:
        out = torch.mm(a.to(torch.float32), b.to(torch.float32)) * a_inv * b_inv
    elif a.device.type == "cpu":
        # What ATen's CPU kernel computes (float8/gemm.py calls it directly; its agreement
        # with torch._scaled_mm is test_cpu_gemm_is_torchs_scaled_mm).
        out = torch.mm(a.to(torch.float32) * a_inv, b.to(torch.float32) * b_inv).to(gemm_dtype)
    else:
        out = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=gemm_dtype, use_fast_accum=fast_accum)
    return out.to(gemm_dtype).to(out_dtype)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def reference(scaling: str, x, w, g, emulate: bool, w_cast=None):
    """(out, grad_x, grad_w) of x (M, K) @ w (N, K).T with output gradient g (M, N)."""
    dt, wdt = x.dtype, w.dtype
    if scaling == "tensorwise":
        xf, xs = _cast(x, E4M3)
        wf, ws = w_cast if w_cast is not None else _cast(w, E4M3)
        out = _gemm(xf, wf.t(), xs, ws, dt, False, emulate, fast_accum=True)
        gf, gs = _cast(g, E5M2)
        grad_x = _gemm(gf, _col_major(wf), gs, ws, dt, False, emulate)
        grad_w = _gemm(gf.t().contiguous(), _col_major(xf), gs, xs, wdt, False, emulate)
        return out, grad_x, grad_w
    # rowwise: one power-of-two e4m3 scale per row along each GEMM's contraction dim
    xf, xs = _cast(x, E4M3, -1, pow2=True)
    wf, ws = _cast(w, E4M3, -1, pow2=True)
    out = _gemm(xf, wf.t(), xs, ws.t(), dt, True, emulate, fast_accum=True)
    gf, gs = _cast(g, E4M3, -1, pow2=True)
    wcf, wcs = _cast(w, E4M3, 0, pow2=True)  # grad_x contracts over w's out dim: one scale per column
    grad_x = _gemm(gf, _col_major(wcf), gs, wcs, dt, True, emulate)
    if scaling == "rowwise_gw_hp":
        return out, grad_x, torch.mm(g.t(), x.to(g.dtype)).to(wdt)
    gcf, gcs = _cast(g, E4M3, 0, pow2=True)  # grad_w contracts over tokens
    xcf, xcs = _cast(x, E4M3, 0, pow2=True)
    grad_w = _gemm(gcf.t().contiguous(), _col_major(xcf), gcs.t(), xcs, wdt, True, emulate)
    return out, grad_x, grad_w


def _inputs(dtype: torch.dtype):
    torch.manual_seed(0)
    # 48 tokens (a multiple of 16: no padding of grad_w's contraction dim), uneven magnitudes
    # so that per-row and per-tensor scales differ.
    x = (torch.randn(3, 16, 64) * torch.logspace(-2, 2, 64)).to(dtype)
    w = (torch.randn(48, 64) * torch.logspace(1, -1, 48)[:, None] * torch.logspace(-1, 1, 64)).to(dtype)
    g = (torch.randn(3, 16, 48) * torch.logspace(-1, 1, 16)[:, None]).to(dtype)
    return x, w, g


def _linear(w: torch.Tensor, config: Float8Config) -> Float8Linear:
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    linear.weight = nn.Parameter(w.clone())
    return Float8Linear.from_float(linear, config)


def _emulations(scaling: str) -> list[bool]:
    return [True] if cpu_float8_emulated(scaling) else [True, False]


def _assert_bitwise(actual, expected) -> None:
    for name, a, e in zip(("out", "grad_x", "grad_w"), actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        assert torch.equal(a, e), f"{name} differs: max |diff| {(a.double() - e.double()).abs().max()}"


@pytest.mark.version_specific
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_table_driven_linear_matches_the_explicit_recipe_bitwise(scaling, dtype):
    x, w, g = _inputs(dtype)
    for emulate in _emulations(scaling):
        got = linear_step(_linear(w, Float8Config(scaling=scaling, emulate=emulate)), x, g)
        want = reference(scaling, x.reshape(-1, 64), w, g.reshape(-1, 48), emulate)
        _assert_bitwise((got[0].reshape(-1, 48), got[1].reshape(-1, 64), got[2]), want)


@pytest.mark.version_specific
def test_gathered_float8_weight_matches_the_explicit_recipe_bitwise():
    x, w, g = _inputs(torch.float32)
    x, g = x.reshape(-1, 64), g.reshape(-1, 48)
    w_cast = _cast(w, E4M3)
    for emulate in _emulations("tensorwise"):
        f8 = _linear(w, Float8Config(emulate=emulate))
        f8.weight = nn.Parameter(Float8GatheredWeight(*w_cast, torch.float32))
        _assert_bitwise(linear_step(f8, x, g), reference("tensorwise", x, w, g, emulate, w_cast=w_cast))


def _torchao_rowwise_with_gw_hp() -> Float8Recipe:
    """torchao's Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp"), as a table entry."""
    rows = lambda over: Cast(E4M3, amax_over=over, pow2=True)  # noqa: E731
    return Float8Recipe(
        output=Gemm(rows("in"), rows("in"), fast_accum=True),
        grad_input=Gemm(rows("out"), Cast(E4M3, pow2=True)),  # the weight: one scale per tensor
        grad_weight=Gemm(HIGH_PRECISION, HIGH_PRECISION),
    )


def test_a_new_recipe_is_an_object_passed_in_the_config():
    x, w, g = _inputs(torch.float32)
    x, g = x.reshape(-1, 64), g.reshape(-1, 48)
    ours = reference("rowwise_gw_hp", x, w, g, emulate=True)
    for emulate in _emulations("rowwise"):
        got = linear_step(_linear(w, Float8Config(scaling=_torchao_rowwise_with_gw_hp(), emulate=emulate)), x, g)
        # Only grad_x's weight cast differs from rowwise_gw_hp: one power-of-two scale per tensor.
        wf, ws = _cast(w, E4M3, pow2=True)
        gf, gs = _cast(g, E4M3, -1, pow2=True)
        grad_x = _gemm(gf, _col_major(wf), gs, ws.expand(1, 64), torch.float32, True, emulate)
        if emulate:
            assert torch.equal(got[0], ours[0]) and torch.equal(got[2], ours[2])
        assert torch.equal(got[1], grad_x)
        assert not torch.equal(got[1], ours[1])


@pytest.mark.version_specific
@pytest.mark.parametrize(
    ("gemm", "message"),
    [
        (Gemm(Cast(E4M3), HIGH_PRECISION), "both operands float8 or both high precision"),
        (Gemm(Cast(E4M3, amax_over="tokens"), Cast(E4M3)), "per-row scales must be over 'in'"),
    ],
)
def test_recipes_that_cannot_run_are_refused(gemm, message):
    tensorwise = RECIPES["tensorwise"]
    with pytest.raises(ValueError, match=message):
        Float8Recipe(output=gemm, grad_input=tensorwise.grad_input, grad_weight=tensorwise.grad_weight)


def test_what_each_recipe_allows():
    flags = {
        name: (r.rowwise_gemms, r.weight_gatherable_in_float8, r.activations_gatherable_in_float8)
        for name, r in RECIPES.items()
    }
    assert flags == {
        "tensorwise": (False, True, True),
        "rowwise": (True, False, False),
        "rowwise_gw_hp": (True, False, False),
        "blockwise": (False, True, False),  # its block-scaled GEMMs: tests/float8/test_blockwise.py
    }
    assert not _torchao_rowwise_with_gw_hp().weight_gatherable_in_float8


@pytest.mark.version_specific
@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_cpu_gemm_is_torchs_scaled_mm(rowwise, out_dtype):
    """The CPU float8 GEMM float8/gemm.py calls is torch._scaled_mm's value: bitwise where torch
    runs ATen's CPU kernel, within fp32 summation order where it sends the GEMM to oneDNN (AMX)."""
    if rowwise and cpu_float8_emulated("rowwise"):
        pytest.skip(f"torch {torch.__version__} has no CPU float8 GEMM with row-wise scales")
    from float8.gemm import scaled_mm_cpu

    torch.manual_seed(0)
    m, k, n = 48, 160, 80
    a = (torch.randn(m, k) * 40).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k) * 40).to(torch.float8_e4m3fn).t()
    a_inv = torch.rand(m, 1) + 0.3 if rowwise else torch.tensor(0.37)
    b_inv = torch.rand(1, n) + 0.3 if rowwise else torch.tensor(1.9)
    torchs = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
    ours = scaled_mm_cpu(a, b, a_inv, b_inv, out_dtype)
    assert ours.dtype == out_dtype and ours.shape == (m, n)
    # Summation order only: within a few fp32 ulps of the largest output (or one bf16 rounding).
    scale = torchs.float().abs().max().item()
    rtol, atol = (1e-5, 1e-6 * scale) if out_dtype == torch.float32 else (8e-3, 1e-6 * scale)
    torch.testing.assert_close(ours.float(), torchs.float(), rtol=rtol, atol=atol)
    assert not torch.equal(ours, torch.zeros_like(ours))
