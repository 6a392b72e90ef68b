"""Float8 training linears on CPU: accuracy, dtypes, conversion, state dicts, compile."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from float8 import Float8Config, Float8Linear, convert_to_float8_training
from float8.gathered import Float8GatheredWeight
from float8.scaling import E4M3, E5M2, cast_rowwise, cast_tensorwise, from_float8
from tests.helpers import cpu_float8_emulated, linear_step, sqnr

SCALINGS = ["tensorwise", "rowwise", "rowwise_gw_hp"]
# blockwise needs 128-aligned features (its compiled and recipe tests: tests/float8/test_blockwise.py).
WITH_BLOCKWISE = [*SCALINGS, "blockwise"]


def pair(in_f=256, out_f=128, bias=False, dtype=torch.float32, **cfg):
    cfg.setdefault("emulate", cpu_float8_emulated(cfg.get("scaling", "tensorwise")))
    torch.manual_seed(0)
    ref = nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    f8 = Float8Linear.from_float(copy.deepcopy(ref), Float8Config(**cfg))
    return ref, f8


@pytest.mark.version_specific
@pytest.mark.parametrize("scaling", WITH_BLOCKWISE)
def test_sqnr_against_fp32(scaling):
    ref, f8 = pair(scaling=scaling)
    x, g = torch.randn(4, 48, 256), torch.randn(4, 48, 128)
    out_r, gx_r, gw_r = linear_step(ref, x, g)
    out_f, gx_f, gw_f = linear_step(f8, x, g)
    assert sqnr(out_r, out_f) >= 25
    assert sqnr(gx_r, gx_f) >= 20
    assert sqnr(gw_r, gw_f) >= (35 if scaling == "rowwise_gw_hp" else 20)


@pytest.mark.parametrize("rowwise", [False, True])
def test_single_cast_sqnr(rowwise):
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-2, 2, 256)
    for float8_dtype in (E4M3, E5M2):
        data, scale = cast_rowwise(x, -1, float8_dtype) if rowwise else cast_tensorwise(x, float8_dtype)
        assert data.dtype == float8_dtype
        assert sqnr(x, from_float8(data, scale, torch.float32)) >= 25


def test_rowwise_scales_are_powers_of_two():
    _, scale = cast_rowwise(torch.randn(8, 32) * 3, -1, E4M3)
    assert scale.shape == (8, 1)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)


@pytest.mark.version_specific
@pytest.mark.parametrize("scaling", WITH_BLOCKWISE)
def test_emulate_matches_scaled_mm(scaling):
    if cpu_float8_emulated(scaling):
        pytest.skip(f"torch {torch.__version__} has no CPU float8 GEMM for {scaling}")
    _, f8 = pair(scaling=scaling)
    _, emu = pair(scaling=scaling, emulate=True)
    x, g = torch.randn(40, 256), torch.randn(40, 128)
    for a, b in zip(linear_step(f8, x, g), linear_step(emu, x, g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.version_specific
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", WITH_BLOCKWISE)
def test_dtypes_bias_and_3d(dtype, scaling):
    # The reference is the fp32 layer whatever the float8 module's dtype.
    ref, f8 = pair(bias=True, scaling=scaling)
    f8.to(dtype)
    x, g = torch.randn(2, 24, 256), torch.randn(2, 24, 128)
    out_r, gx_r, gw_r = linear_step(ref, x, g)
    out_f, gx_f, gw_f = linear_step(f8, x.to(dtype), g)
    assert out_f.shape == (2, 24, 128) and out_f.dtype == dtype
    assert gx_f.dtype == dtype and gw_f.dtype == dtype and f8.bias.grad.dtype == dtype
    assert sqnr(out_r, out_f) >= 25
    assert sqnr(gx_r, gx_f) >= 20
    assert sqnr(gw_r, gw_f) >= (35 if scaling == "rowwise_gw_hp" else 20)
    assert sqnr(ref.bias.grad, f8.bias.grad) >= 35


@pytest.mark.version_specific
def test_autocast_computes_in_bf16_and_keeps_fp32_grads():
    ref, f8 = pair(bias=True)
    x = torch.randn(32, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = f8(x)
        out_ref = ref(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert f8.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert sqnr(out_ref.float(), out.float()) >= 20


def test_frozen_weight_gets_no_grad():
    _, f8 = pair()
    f8.weight.requires_grad_(False)
    x = torch.randn(16, 256, requires_grad=True)
    f8(x).sum().backward()
    assert f8.weight.grad is None and x.grad is not None


@pytest.mark.version_specific
@pytest.mark.parametrize("scaling", WITH_BLOCKWISE)
@pytest.mark.parametrize("magnitude", [0.0, 1e-30, 1e15])
def test_extreme_magnitudes_stay_finite(scaling, magnitude):
    _, f8 = pair(scaling=scaling)
    x = torch.randn(32, 256) * magnitude
    x.requires_grad_()
    out = f8(x)
    out.backward(torch.randn_like(out) * magnitude)
    for t in (out, x.grad, f8.weight.grad):
        assert torch.isfinite(t).all()
    if magnitude == 1e15:
        assert sqnr(x.detach() @ f8.weight.detach().t(), out) >= 20


@pytest.mark.version_specific
def test_padded_token_dim():
    # 37 tokens: the weight-gradient GEMM pads its contraction dim to a multiple of 16.
    ref, f8 = pair()
    x, g = torch.randn(37, 256), torch.randn(37, 128)
    assert sqnr(linear_step(ref, x, g)[2], linear_step(f8, x, g)[2]) >= 20


@pytest.mark.version_specific
def test_gathered_weight_matches_cast_path():
    # What FSDP's float8 all-gather hands the module: float8 data plus its scale.
    _, f8 = pair()
    x, g = torch.randn(32, 256), torch.randn(32, 128)
    expected = linear_step(f8, x, g)
    data, scale = cast_tensorwise(f8.weight.detach(), E4M3)
    gathered = copy.deepcopy(f8)
    gathered.weight = nn.Parameter(Float8GatheredWeight(data, scale, torch.float32))
    out, gx, gw = linear_step(gathered, x, g)
    torch.testing.assert_close(out, expected[0])
    torch.testing.assert_close(gx, expected[1])
    torch.testing.assert_close(gw, expected[2])
    assert type(gw) is torch.Tensor


class Block(nn.Module):
    def __init__(self, dim=64, hidden=160):
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.odd = nn.Linear(dim, 100)

    def forward(self, x):
        return self.odd(self.w2(torch.relu(self.w1(self.wq(x)))))


class Model(nn.Module):
    def __init__(self, n_layers=2, dim=64):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.output = nn.Linear(dim, 32, bias=False)


def test_report_names_and_reasons():
    model = nn.ModuleDict({
        "a": nn.Linear(128, 128),
        "b": nn.Linear(128, 128),
        "small": nn.Linear(32, 128),
        "odd": nn.Linear(100, 128),
        "output": nn.Linear(128, 128),
    })
    report = convert_to_float8_training(
        model,
        config=Float8Config(filter_fqns=["output"], min_features=64),
        module_filter_fn=lambda mod, fqn: fqn != "b",
    )
    assert report.converted == ["a"]
    assert dict(report.skipped) == {
        "b": "rejected by module_filter_fn",
        "small": "smaller than min_features",
        "odd": "in_features 100 not divisible by 16",
        "output": "filtered by filter_fqns",
    }
    assert isinstance(model["a"], Float8Linear)
    assert all(type(model[k]) is nn.Linear for k in ("b", "small", "odd", "output"))
    with pytest.raises(ValueError):
        convert_to_float8_training(nn.Linear(16, 16))


def test_conversion_keeps_mode_and_shared_modules():
    shared = nn.Linear(64, 64)
    model = nn.ModuleDict({"a": shared, "b": shared, "seq": nn.Sequential(shared)})
    model.eval()
    report = convert_to_float8_training(model)
    assert report.converted == ["a"]
    assert isinstance(model["a"], Float8Linear)
    assert model["b"] is model["a"] and model["seq"][0] is model["a"]
    assert not model["a"].training
    assert model["a"].weight is shared.weight


def test_report_string_is_short():
    model = Model(n_layers=32)
    report = convert_to_float8_training(model, config=Float8Config(filter_fqns=["output"]))
    text = str(report)
    assert text.startswith("96 converted (wq, w1, w2 x32); 33 skipped:")
    assert "output (filtered by filter_fqns)" in text
    assert "odd x32 (out_features 100 not divisible by 16)" in text
    assert len(text) < 200


def test_meta_conversion_allocates_nothing_and_keeps_parameters():
    with torch.device("meta"):
        model = Model()
    model.layers[0].wq.weight.requires_grad_(False)
    before = {n: p for n, p in model.named_parameters()}
    report = convert_to_float8_training(model)
    assert len(report.converted) == 6 and ("output", "filtered by filter_fqns") in report.skipped
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, p in after.items():
        assert p is before[name] and p.is_meta
    assert not model.layers[0].wq.weight.requires_grad
    model.to_empty(device="cpu")
    assert model.layers[0].w1.weight.device.type == "cpu"


@pytest.mark.version_specific
@pytest.mark.parametrize("all_gather", [False, True])
def test_state_dict_round_trip(all_gather):
    ref = Model()
    model = copy.deepcopy(ref)
    convert_to_float8_training(model, config=Float8Config(fsdp_float8_all_gather=all_gather))
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    for k in sd:
        assert type(sd[k]) is torch.Tensor
        assert torch.equal(sd[k], ref_sd[k])
    fresh = Model()
    convert_to_float8_training(fresh, config=Float8Config(fsdp_float8_all_gather=all_gather))
    fresh.load_state_dict(ref_sd)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, ref_sd[k])
    back = Model()
    back.load_state_dict(sd)


@pytest.mark.version_specific
def test_fsdp_all_gather_weight_trains_like_a_plain_weight():
    # Without FSDP the wrapper is inert: same numbers, and the optimizer steps it.
    _, plain = pair()
    _, wrapped = pair(fsdp_float8_all_gather=True)
    x, g = torch.randn(32, 256), torch.randn(32, 128)
    for a, b in zip(linear_step(plain, x, g), linear_step(wrapped, x, g)):
        torch.testing.assert_close(a, b)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.1)
    before = wrapped.weight.detach().clone()
    opt.step()
    assert not torch.equal(wrapped.state_dict()["weight"], before)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"scaling": "delayed"}, "scaling"),
        ({"emulate": "yes"}, "emulate"),
        ({"filter_fqns": "output"}, "filter_fqns"),
        ({"filter_fqns": None}, "filter_fqns"),
        ({"min_features": -1}, "min_features"),
        ({"scaling": "rowwise", "fsdp_float8_all_gather": True}, "fsdp_float8_all_gather"),
        ({"scaling": "tensorwise", "fsdp_unshard_as_stored": True}, "fsdp_unshard_as_stored"),
        ({"fsdp_unshard_as_stored": 1}, "fsdp_unshard_as_stored"),
        ({"eager_casts": "yes"}, "eager_casts"),
        ({"dynamo_recompile_limit": -1}, "dynamo_recompile_limit"),
    ],
)
def test_bad_config_raises(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Float8Config(**kwargs)


@pytest.mark.slow
@pytest.mark.version_specific
@pytest.mark.parametrize("scaling", SCALINGS)
def test_compiled_matches_eager_fullgraph(scaling, fresh_dynamo):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.SiLU(), nn.Linear(32, 64, bias=False))
    convert_to_float8_training(model, config=Float8Config(scaling=scaling, emulate=cpu_float8_emulated(scaling)))
    compiled = copy.deepcopy(model)
    compiled.compile(fullgraph=True)
    x, g = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    for m in (model, compiled):
        m.zero_grad()
    out_e, gx_e, _ = linear_step(model, x, g)
    out_c, gx_c, _ = linear_step(compiled, x, g)
    if cpu_float8_emulated(scaling) or scaling != "tensorwise":
        # Row-wise GEMMs on CPU (emulated on torch 2.11, ATen's fp32 formula on 2.13: see
        # float8/gemm.py `scaled_mm_cpu`) scale fp32 operands that inductor fuses with the
        # per-row casts differently, so compiled and eager differ by float8 noise, not more.
        assert sqnr(out_e, out_c) >= 30 and sqnr(gx_e, gx_c) >= 30
    else:
        torch.testing.assert_close(out_c, out_e, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(gx_c, gx_e, rtol=1e-2, atol=1e-2)
    for p_e, p_c in zip(model.parameters(), compiled.parameters()):
        assert sqnr(p_e.grad, p_c.grad) >= 30


@pytest.mark.slow
@pytest.mark.version_specific
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_self_compiled_casts_in_eager_match(scaling, fresh_dynamo):
    # "compiled" runs the eager casts as torch.compile'd kernels, on CPU too.
    _, plain = pair(in_f=64, out_f=32, scaling=scaling, eager_casts="plain")
    _, fused = pair(in_f=64, out_f=32, scaling=scaling, eager_casts="compiled")
    x, g = torch.randn(48, 64), torch.randn(48, 32)
    limit = torch._dynamo.config.recompile_limit
    for a, b in zip(linear_step(fused, x, g), linear_step(plain, x, g)):
        torch.testing.assert_close(a, b)
    # The casts compiled as they ran, and left torch's global settings alone.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    assert torch._dynamo.config.recompile_limit == limit


@pytest.mark.version_specific
def test_fsdp_pre_all_gather_pads_uneven_shards_and_round_trips():
    from types import SimpleNamespace

    from float8.fsdp import Float8TrainingWeight

    # 5 rows over 2 ranks: FSDP pads every shard to 3 rows; this rank holds 2.
    full = torch.randn(5, 32)
    scale = torch.tensor(448.0) / full.abs().max()
    shard = Float8TrainingWeight(full[3:], precomputed_scale=scale)
    mesh = SimpleNamespace(ndim=1, size=lambda: 2)
    (data,), (meta_scale,) = shard.fsdp_pre_all_gather(mesh, torch.Size([5, 32]), (32, 1), None, None)
    assert data.dtype == torch.uint8 and data.shape == (3, 32)
    assert torch.equal(data[2], torch.zeros(32, dtype=torch.uint8))
    gathered, inner = shard.fsdp_post_all_gather((data,), (meta_scale,), torch.bfloat16)
    assert isinstance(gathered, Float8GatheredWeight) and gathered.dtype == torch.bfloat16
    assert inner[0].dtype == E4M3
    assert sqnr(full[3:], from_float8(gathered._data[:2], gathered._scale, torch.float32)) >= 25


@pytest.mark.version_specific
@pytest.mark.parametrize("scaling", ["rowwise", "rowwise_gw_hp"])
def test_weight_read_as_stored_casts_like_its_bf16_copy(scaling):
    from float8.gathered import StoredWeight
    from float8.linear import float8_mm
    from float8.operands import amax_rows_and_columns

    config = Float8Config(scaling=scaling, emulate=cpu_float8_emulated(scaling))
    w32 = torch.randn(48, 64)
    # Row 5's and column 9's amaxes bf16 rounds down onto 1.75, where the power-of-two scale 448 / amax
    # steps: from the fp32 amaxes the scales would be half the copy's, and their other values, which
    # float8 holds at the copy's scale but only as subnormals at half of it, would lose bits. The
    # products read those values alone (x and g zero where they meet the amaxes).
    w32[5], w32[:, 9] = 1.125 * 2.0**-14, 1.125 * 2.0**-14
    w32[5, 3] = w32[7, 9] = 1.75 + 2.0**-12
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    g = torch.randn(32, 48, dtype=torch.bfloat16)
    x[:, 3], g[:, 7] = 0, 0
    results = []
    for weight in (w32.to(torch.bfloat16), StoredWeight(w32, torch.bfloat16, amax_rows_and_columns(w32, "plain"))):
        w, xi = nn.Parameter(weight), x.clone().requires_grad_()
        out = float8_mm(xi, w, config)
        out.backward(g)
        results.append((out, xi.grad, w.grad))
    # The bf16 copy's bytes, read from the fp32 weight: bitwise, gradients in bf16 as for the copy.
    for ref, got in zip(*results):
        assert got.dtype == torch.bfloat16 and torch.equal(ref, got)


@pytest.mark.version_specific
def test_weight_unsharded_as_stored_at_one_rank_only():
    from types import SimpleNamespace

    from float8.fsdp import Float8TrainingWeight
    from float8.gathered import StoredWeight

    w = torch.randn(8, 16)
    shard = Float8TrainingWeight(w, as_stored=True)
    assert shard.fsdp_all_gather_input_is_kept
    one_rank = SimpleNamespace(ndim=1, size=lambda: 1)
    (data,), metadata = shard.fsdp_pre_all_gather(one_rank)
    assert data is w
    # The rows' and columns' amaxes ride along: read at the unshard, or those set after the optimizer step.
    assert torch.equal(metadata[0], torch.cat([w.abs().amax(1), w.abs().amax(0)]))
    shard._amax = known = torch.ones(24)
    _, metadata = shard.fsdp_pre_all_gather(one_rank)
    assert metadata[0] is known
    unsharded, _ = shard.fsdp_post_all_gather((data,), metadata, torch.bfloat16)
    assert isinstance(unsharded, StoredWeight) and unsharded.dtype == torch.bfloat16 and unsharded._data is w
    assert unsharded._amax is known
    with pytest.raises(ValueError, match="one rank, got 2"):
        shard.fsdp_pre_all_gather(SimpleNamespace(ndim=1, size=lambda: 2))
