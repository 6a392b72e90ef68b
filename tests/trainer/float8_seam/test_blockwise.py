"""The blockwise recipe in the trainer: the seam's conversion under TP (shards of whole blocks) and with
filter = "auto", its advice and refusals, float8 health from block casts, and the config checks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from float8 import Float8Config, ShapeTiming, convert_to_float8_training
from float8.blocks import cast_blockwise
from float8.health import Float8HealthMonitor
from models.llama import LLAMA2_FLAVORS
from trainer.config import Config, build_config
from trainer.errors import UserError
from trainer.float8_seam.ours import BLOCKWISE_NOTE
from trainer.float8_seam.rules import Float8RunContext
from trainer.float8_seam.seam import build_seam
from trainer.model_setup import build_meta_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def _seam(device_type: str = "cpu", tp: int = 1, timer=None, **float8):
    cfg = Config()
    cfg.float8.enabled, cfg.float8.scaling, cfg.float8.fsdp_float8_all_gather = True, "blockwise", True
    cfg.compile.mode, cfg.parallelism.tensor_parallel_degree = "block", tp
    for key, value in float8.items():
        setattr(cfg.float8, key, value)
    return build_seam(cfg.float8, Float8RunContext.for_run(cfg, device_type, "bfloat16"), timer)


def _leaves(fqns: list[str]) -> set[str]:
    return {fqn.rsplit(".", 1)[-1] for fqn in fqns}


def test_debug_model_at_tp_2_keeps_the_linears_whose_shards_cut_blocks():
    # The debug model: dim 256, 8 heads of 32 with 4 KV heads (wk, wv: 256 -> 128), hidden 768;
    # every feature a multiple of 128. At TP 2 wk/wv hold 64 rows per rank: kept in bf16, and said.
    assert _leaves(_seam().convert(build_meta_model(LLAMA2_FLAVORS["debug"])).converted) == {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}
    seam = _seam(tp=2)
    report = seam.convert(build_meta_model(LLAMA2_FLAVORS["debug"]))
    assert _leaves(report.converted) == {"wq", "wo", "w1", "w2", "w3"}
    assert {why for fqn, why in report.skipped if "output" not in fqn} == {"out_features 128 / TP 2 not divisible by 128"}
    notes = [n for n in seam.advice(CPU, dp_degree=1, tp_degree=2) if "stay in high precision" in n]
    assert len(notes) == 1 and "layers.0.attention.wk (out_features 128 / TP 2 not divisible by 128)" in notes[0]


def test_filter_auto_times_the_blockwise_linears(monkeypatch):
    class Timer:
        def __call__(self, shape, tokens, config, compiled, device):
            assert config.recipe.name == "blockwise"
            return ShapeTiming(1.0, 0.5 if shape == (256, 768) else 1.5)

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    report = _seam("cuda", tp=2, timer=Timer(), filter="auto").convert(build_meta_model(LLAMA2_FLAVORS["debug"]))
    assert _leaves(report.converted) == {"w1", "w3"}
    assert {report.kept_by[f"layers.0.attention.{w}"] for w in ("wk", "wq")} == {"alignment", "auto"}


def test_advice_says_when_to_pick_it_and_refuses_gpus_without_its_gemms(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    with pytest.raises(UserError, match=r"block-scaled float8 GEMMs, which torch runs on sm_90 \(H100/H200\) only, not NVIDIA L40S") as e:
        _seam("cuda").advice(CUDA, 1, 1)
    assert "\n" not in str(e.value)
    assert BLOCKWISE_NOTE not in _seam("cuda", emulate=True).advice(CUDA, 1, 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert BLOCKWISE_NOTE in _seam("cuda").advice(CUDA, 1, 1)
    assert "0.64-0.92x tensorwise" in BLOCKWISE_NOTE
    # Any CPU runs the GEMM as its formula: nothing to refuse or say.
    assert _seam().advice(CPU, 2, 1) == []


def test_config_takes_blockwise_and_torchao_refuses_it():
    cfg = build_config(["--float8.enabled", "true", "--float8.scaling", "blockwise"])
    assert cfg.float8.scaling == "blockwise"
    with pytest.raises(UserError, match=r"float8\.scaling = 'blockwise' is this repository's float8 package's"):
        build_config(["--float8.enabled", "true", "--float8.scaling", "blockwise", "--float8.impl", "torchao"])


def test_health_reads_the_block_casts_and_changes_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128, bias=False))
    convert_to_float8_training(model, config=Float8Config(scaling="blockwise", filter_fqns=[]))
    twin = copy.deepcopy(model)
    x = torch.randn(64, 256)
    x[0, 0] = 1e4  # an outlier: its tile's scale is the smallest, the other tiles keep theirs
    x[1, 1] = 1e-30  # below e4m3's range at any scale its tile gets: flushed
    monitor = Float8HealthMonitor(model, CPU)
    monitor.arm()
    for m in (model, twin):
        m(x).sum().backward()
    metrics = monitor.collect().metrics
    assert torch.equal(model[0].weight.grad, twin[0].weight.grad)
    data, scales = cast_blockwise(x, (1, 128), torch.float8_e4m3fn)
    assert metrics["float8/0/input/amax"] == 1e4 and metrics["float8/0/input/scale"] == scales.min().item()
    flushed = (data.float() == 0) & (x != 0)
    # The 1e-30, and the outlier's tile-mates below 2**-10 / 2**-5: no value of any other tile.
    assert flushed[1, 1] and flushed[2:].sum() == 0 and flushed[0, 128:].sum() == 0
    assert metrics["float8/0/input/underflow"] == flushed.sum().item() / (x != 0).sum().item()
    w_scales = cast_blockwise(twin[0].weight.detach(), (128, 128), torch.float8_e4m3fn)[1]
    assert metrics["float8/0/weight/scale"] == w_scales.min().item() and metrics["float8/0/weight/saturation"] == 0
    assert metrics["float8/0/grad_output/amax"] == 1.0  # sum()'s gradient


def test_health_of_a_gathered_block_scaled_weight():
    # Under the float8 all-gather the linear sees the weight's bytes and block scales only.
    from float8.gathered import Float8GatheredWeight

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128, bias=False))
    convert_to_float8_training(model, config=Float8Config(scaling="blockwise", filter_fqns=[]))
    w = model[0].weight.detach()
    data, scales = cast_blockwise(w, (128, 128), torch.float8_e4m3fn)
    model[0].weight = nn.Parameter(Float8GatheredWeight(data, scales, torch.float32, (128, 128)), requires_grad=False)
    assert torch.equal(model[0].weight.dequantized(), data.float() / scales.repeat_interleave(128, 0).repeat_interleave(128, 1))
    monitor = Float8HealthMonitor(model, CPU)
    monitor.arm()
    model(torch.randn(8, 256, requires_grad=True)).sum().backward()
    metrics = monitor.collect().metrics
    assert metrics["float8/0/weight/amax"] == pytest.approx(w.abs().max().item(), rel=2**-3)
    assert metrics["float8/0/weight/scale"] == scales.min().item()
    assert metrics["float8/0/weight/underflow_norm_share"] != metrics["float8/0/weight/underflow_norm_share"]  # NaN
