"""trainer/distributed/memory_plan.py: the estimate against GPU measurements, and plans refused before the model is built."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from models.llama.args import LLAMA2_FLAVORS
from tests.helpers import ROOT, run_train
from trainer.config import build_config
from trainer.distributed.memory_plan import (
    GIB,
    Float8Memory,
    capacity,
    check_fits,
    estimate,
    estimate_for,
    fit_error,
    n_params,
)
from trainer.errors import UserError
from trainer.float8_seam.seam import float8_memory
from trainer.loss import choose_loss_compile
from trainer.model_setup import model_args_for
from trainer.precision import resolve_param_precision

CONFIGS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.toml"))
H200_BYTES = 141e9

# Peak active memory (GiB) on one H200, torch 2.11: LLaMA-2-7B dims, 4 layers, batch 8 x seq
# 4096, per-block compile; float8 is tensorwise.
MEASURED = {
    ("none", True): 36.81, ("full", True): 25.96, ("selective", True): 36.35,
    ("none", False): 41.22, ("full", False): 26.14, ("selective", False): 36.53,
}


def test_parameter_count_matches_the_model():
    from models.llama import num_params
    from trainer.model_setup import build_meta_model

    args = dataclasses.replace(LLAMA2_FLAVORS["7B"], n_layers=4)
    total, block = n_params(args)
    model = build_meta_model(args)
    assert total == num_params(model) == 1_071_681_536
    assert block == sum(p.numel() for p in model.layers["0"].parameters())


@pytest.mark.parametrize(("mode", "float8"), sorted(MEASURED))
def test_estimate_is_within_15_percent_of_the_h200_measurements(mode, float8):
    args = dataclasses.replace(LLAMA2_FLAVORS["7B"], n_layers=4)
    est = estimate(args, batch_size=8, seq_len=4096, ac_mode=mode, float8=float8)
    assert est.total / GIB == pytest.approx(MEASURED[(mode, float8)], rel=0.15)


def test_estimate_scales_with_the_layout_and_the_cpu_attention():
    args = LLAMA2_FLAVORS["7B"]
    one = estimate(args, batch_size=2, seq_len=4096, ac_mode="none", float8=True)
    eight = estimate(args, batch_size=2, seq_len=4096, ac_mode="none", float8=True, dp=8)
    assert eight.state < one.state / 6 and eight.activations == one.activations
    tp = estimate(args, batch_size=2, seq_len=4096, ac_mode="none", float8=True, tp=2)
    assert tp.activations == pytest.approx(one.activations / 2)
    cpu = estimate(args, batch_size=2, seq_len=4096, ac_mode="none", float8=True, device_type="cpu")
    assert cpu.activations - one.activations == 2 * 32 * 4096**2 * 4  # one layer's scores
    packed = estimate(args, batch_size=2, seq_len=4096, ac_mode="none", float8=True, packed=True)
    assert packed.activations - one.activations == 2 * 4096**2  # the bool document mask
    full = estimate(args, batch_size=2, seq_len=4096, ac_mode="full", float8=True)
    assert full.activations < one.activations / 3
    # Rowwise weights read as stored: each layer's transposed float8 weight until its backward, 1 byte a parameter.
    _, block = n_params(args)
    kept = estimate(args, batch_size=2, seq_len=4096, ac_mode="none", float8=True, float8_weights_for_backward=True)
    assert kept.activations - one.activations == 32 * block
    kept_full = estimate(args, batch_size=2, seq_len=4096, ac_mode="full", float8=True, float8_weights_for_backward=True)
    assert kept_full.activations - full.activations == block


def test_refusal_is_one_line_with_the_numbers():
    args = LLAMA2_FLAVORS["7B"]
    est = estimate(args, batch_size=8, seq_len=100000, ac_mode="none", float8=True)
    message = fit_error(est, "NVIDIA H200", 139.8 * GIB)
    assert message is not None and "\n" not in message
    assert message.startswith(f"the plan needs about {est.total / GIB:.1f} GiB per GPU (weights and AdamW ")
    assert "at batch 8 x seq 100000, activation_checkpoint none) but NVIDIA H200 has 139.8 GiB" in message
    assert "lower training.batch_size or training.seq_len, or set activation_checkpoint.mode = full" in message
    small = estimate(args, batch_size=1, seq_len=1024, ac_mode="full", float8=True, dp=8)
    assert fit_error(small, "NVIDIA H200", 139.8 * GIB) is None
    # The refusal fires above 95% of the capacity, not at it.
    assert fit_error(small, "x", small.total / 0.94) is None
    assert fit_error(small, "x", small.total / 0.96) is not None


def test_check_fits_raises_a_user_error(monkeypatch):
    cfg = build_config(["--config", "configs/debug.toml", "--training.seq_len", "100000", "--model.max_seq_len", "100000"])
    est = estimate_for(cfg, model_args_for(cfg, None, "cpu"), "cpu", 1, 1, "float32", False, False, Float8Memory())
    monkeypatch.setattr("trainer.distributed.memory_plan.capacity", lambda device: ("this host", 16 * GIB))
    with pytest.raises(UserError, match=r"needs about \d+\.\d GiB per GPU .* but this host has 16\.0 GiB"):
        check_fits(est, torch.device("cpu"))
    error = check_fits(est, torch.device("cpu"), refuse=False)
    assert error is not None and est.total > 16 * GIB


def test_cpu_capacity_is_shared_by_the_local_processes(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    _, alone = capacity(torch.device("cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    what, shared = capacity(torch.device("cpu"))
    assert "4 processes" in what and shared == pytest.approx(alone / 4, rel=0.2)


@pytest.mark.parametrize("path", CONFIGS)
def test_shipped_configs_fit_an_h200(path):
    cfg = build_config(["--config", path])
    args = model_args_for(cfg, None, "cpu")
    param_dtype = resolve_param_precision(cfg.training.mixed_precision_param, "cuda").dtype
    tp = cfg.parallelism.tensor_parallel_degree
    vocab_sharded = tp > 1 and cfg.parallelism.loss_parallel
    loss_compiled, _ = choose_loss_compile(cfg.compile.mode, cfg.compile.loss, vocab_sharded)
    est = estimate_for(cfg, args, "cuda", 1, tp, param_dtype, vocab_sharded, loss_compiled, float8_memory(cfg.float8))
    assert fit_error(est, "H200", H200_BYTES) is None, est.summary()


@pytest.mark.parametrize("path", [p for p in CONFIGS if "debug" in p])
def test_debug_configs_fit_this_cpu(path):
    cfg = build_config(["--config", path])
    args = model_args_for(cfg, None, "cpu")
    param_dtype = resolve_param_precision(cfg.training.mixed_precision_param, "cpu").dtype
    est = estimate_for(cfg, args, "cpu", 1, 1, param_dtype, False, False, float8_memory(cfg.float8))
    assert check_fits(est, torch.device("cpu"), refuse=False) is None and est.total < 1 * GIB


@pytest.mark.slow
def test_a_plan_that_cannot_fit_is_refused_before_the_model_is_built(tmp_path):
    start = time.monotonic()
    result = run_train([
        "--config", "configs/debug.toml", "--training.seq_len", "100000", "--model.max_seq_len", "100000",
        "--training.device", "cpu", "--job.dump_folder", str(tmp_path / "dump"),
    ], timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the plan needs about "), result.stderr
    assert "at batch 4 x seq 100000, activation_checkpoint none) but this host's available memory has" in lines[0]
    assert "model llama2" not in result.stdout  # no startup summary: the model was never built
    assert elapsed < 60


@pytest.mark.slow
def test_dry_run_prints_the_estimate_and_refuses_on_its_device(tmp_path):
    ok = run_train(["--config", "configs/debug.toml", "--job.dry_run", "true"])
    assert ok.returncode == 0, ok.stderr
    assert "  memory estimate   0." in ok.stdout and "GiB per GPU (state " in ok.stdout
    big = run_train([
        "--config", "configs/debug.toml", "--training.seq_len", "100000", "--model.max_seq_len", "100000",
        "--training.device", "cpu", "--job.dry_run", "true",
    ])
    assert big.returncode == 2 and big.stderr.startswith("error: the plan needs about "), big.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for hosts without a GPU")
def test_dry_run_of_a_gpu_plan_on_a_cpu_host_warns():
    result = run_train(["--config", "configs/7b_fp8.toml", "--job.dry_run", "true"])
    assert result.returncode == 0, result.stderr
    assert "  memory estimate   " in result.stdout
    assert "warning: on this host (no GPU) the plan needs about" in result.stdout


@pytest.mark.slow
def test_startup_summary_shows_the_estimate(tmp_path):
    result = run_train([
        "--config", "configs/debug.toml", "--training.steps", "1", "--job.dump_folder", str(tmp_path / "dump"),
    ], timeout=300)
    assert result.returncode == 0, result.stderr
    assert "memory estimate 0." in result.stdout and "GiB per GPU (state " in result.stdout
