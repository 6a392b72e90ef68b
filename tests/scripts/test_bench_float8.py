"""scripts/bench_float8.py: ours against the reference library (torchao) on the --smoke CPU path,
the profile by kernel class, and one-line errors."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from float8.gemm import scaled_mm_supported
from models.llama import LLAMA2_FLAVORS
from models.llama.model import precompute_rope
from scripts import bench_float8 as bench
from tests.helpers import run_script
from trainer.cli import run_command

SMOKE_ARGS = dataclasses.replace(LLAMA2_FLAVORS["debug"], dim=64, n_heads=4, n_kv_heads=4, max_seq_len=64)
# torch 2.11's CPU _scaled_mm takes per-tensor scales only; the bench does not emulate the rest.
RECIPES = ["tensorwise", "rowwise"] if scaled_mm_supported(True, "cpu") else ["tensorwise"]


def _sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    return (20 * torch.log10(ref.float().norm() / (ref.float() - x.float()).norm().clamp_min(1e-30))).item()


def _step(mode: str, impl: str) -> tuple[torch.Tensor, ...]:
    """Output, input gradient, a weight and its gradient of the smoke blocks after one step."""
    blocks = bench.build_blocks(SMOKE_ARGS, 2, mode, impl, "eager", torch.device("cpu"))
    rope = precompute_rope(SMOKE_ARGS.head_dim, SMOKE_ARGS.max_seq_len, SMOKE_ARGS.rope_theta)[:32]
    x = torch.randn(2, 32, SMOKE_ARGS.dim, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    h = x
    for block in blocks:
        h = block(h, rope, None)
    h.backward(torch.ones_like(h))
    wq = blocks[0].attention.wq.weight
    return h.detach(), x.grad, wq.grad, wq.detach()


@pytest.mark.parametrize("mode", RECIPES)
def test_ours_and_torchao_agree(mode):
    pytest.importorskip("torchao.float8")
    bf16 = _step("bf16", "-")
    ours, theirs = _step(mode, "ours"), _step(mode, "torchao")
    assert type(bench.build_blocks(SMOKE_ARGS, 1, mode, "torchao", "eager", torch.device("cpu"))[0]
                .attention.wq).__module__.startswith("torchao.float8")
    assert torch.equal(ours[3], theirs[3]) and torch.equal(ours[3], bf16[3])  # same initial weights
    # The same recipe in two implementations differs by less than float8 differs from bf16
    # (torch 2.13: bitwise equal; 2.11's CPU kernel: gradients 32-33 dB apart, 19-23 dB from bf16).
    for a, b, ref in zip(ours[:3], theirs[:3], bf16[:3]):
        assert _sqnr(a, b) >= max(30.0, _sqnr(ref, a), _sqnr(ref, b))
        assert min(_sqnr(ref, a), _sqnr(ref, b)) >= 15.0


@pytest.mark.slow
def test_smoke_runs_both_implementations(tmp_path):
    pytest.importorskip("torchao.float8")
    out = tmp_path / "bench.json"
    result = run_script("scripts/bench_float8.py", [
        "--smoke", "--impl", "both", "--only", "blocks", "--variants", "eager", "--modes", ",".join(["bf16", *RECIPES]),
        "--out", str(out)])
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["impls"] == ["ours", "torchao"] and report["torchao"] and report["failures"] == []
    cells = {(r["mode"], r["impl"]): r for r in report["results"]}
    assert set(cells) == {("bf16", "-")} | {(mode, impl) for mode in RECIPES for impl in ("ours", "torchao")}
    for r in cells.values():
        assert r["ms"] > 0 and r["speedup"] == pytest.approx(cells[("bf16", "-")]["ms"] / r["ms"])
    side_by_side = [line for line in result.stdout.splitlines() if "torchao's speed" in line]
    assert [line.split(":")[0] for line in side_by_side] == [
        f"blocks 2 blocks dim=64 b=2 s=32 eager {mode}" for mode in RECIPES]


def test_missing_torchao_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao` raise ImportError
    assert run_command(lambda: bench.main(["--smoke", "--impl", "torchao"])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --impl torchao needs the reference library torchao")
    assert err.rstrip().endswith('pip install -e ".[reference]"') and len(err.splitlines()) == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--modes", "bf16,fp4"], "error: --modes: unknown name 'fp4'"),
    (["--impl", "fast"], "error: argument --impl: invalid choice: 'fast'"),
])
def test_bad_arguments_are_one_line(capsys, args, message):
    code = run_command(lambda: bench.main(["--smoke", *args]))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(message) and len(err.splitlines()) == 1


def test_profile_is_read_by_the_trace_summary():
    a = torch.randn(64, 64)
    profile = bench.profile_step(lambda: torch.relu(a @ a), torch.device("cpu"))
    assert set(profile) == {"GEMM", "other elementwise/reduction"}
    assert all(ms > 0 for ms in profile.values())


def test_cast_bench_needs_a_gpu_and_times_what_the_linear_runs(monkeypatch, capsys):
    from float8.blocks import cast_blockwise_t
    from float8.recipe import RECIPES
    from float8.scaling import cast_colwise_t, cast_tensorwise
    from scripts import bench_float8_casts

    monkeypatch.setattr(sys, "argv", ["bench_float8_casts.py"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        bench_float8_casts.main()
    assert exit_info.value.code == 2 and capsys.readouterr().err == "error: needs a CUDA GPU\n"
    # A timed cell ends with the layout the weight-gradient GEMM reads, as the linear makes it.
    x = torch.randn(48, 32)
    data_t = bench_float8_casts.both_layouts(x, "tensorwise", "plain")().data
    data, _ = cast_tensorwise(x, RECIPES["tensorwise"].grad_weight.rhs.dtype, fused=False)
    assert torch.equal(data_t.view(torch.uint8), data.t().contiguous().view(torch.uint8))
    data_t = bench_float8_casts.both_layouts(x, "rowwise", "plain")().data
    assert torch.equal(data_t.view(torch.uint8), cast_colwise_t(x, RECIPES["rowwise"].grad_weight.rhs.dtype, fused=False)[0].view(torch.uint8))
    x = torch.randn(256, 384)
    spec = RECIPES["blockwise"].grad_weight.rhs
    data_t = bench_float8_casts.both_layouts(x, "blockwise", "plain")().data
    assert torch.equal(data_t.view(torch.uint8), cast_blockwise_t(x, spec.block, spec.dtype, fused=False)[0].view(torch.uint8))
