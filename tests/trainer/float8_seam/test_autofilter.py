"""`[float8] filter = "auto"` (float8/autofilter.py and the trainer's seam): converts and keeps
what the timings say (stub timers), agrees across ranks, and on CPU and in the dry run falls back
to the rules and says so. The real timer on a GPU: tests/float8/test_cuda.py."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import train
from float8 import (
    AutoFilter,
    Float8Config,
    Float8Linear,
    KeepHighPrecision,
    ShapeTiming,
    convert_to_float8_training,
    linear_shapes,
    time_linear_shapes,
)
from float8.autofilter import AUTO_RULE, time_linear_shape
from float8.convert import ALIGNMENT, FILTER_FQNS, MODULE_FILTER
from models.llama import LLAMA2_FLAVORS
from tests.helpers import free_port, run_train
from trainer.config import Config
from trainer.float8_seam.ours import OursFloat8Training
from trainer.float8_seam.rules import Float8RunContext
from trainer.float8_seam.seam import build_seam
from trainer.model_setup import build_meta_model

CPU = torch.device("cpu")
# 64->64: float8 slower; 128->256: float8 faster (milliseconds).
TIMINGS = {(64, 64): ShapeTiming(bf16_ms=1.0, float8_ms=1.5), (128, 256): ShapeTiming(bf16_ms=2.0, float8_ms=1.0)}


class StubTimer:
    """A Timer that answers from a table and records what it was asked."""

    def __init__(self, timings: dict) -> None:
        self.timings = timings
        self.calls: list[tuple] = []

    def __call__(self, shape, tokens, config, compiled, device) -> ShapeTiming:
        self.calls.append((shape, tokens, compiled, device.type))
        return self.timings[shape]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(64, 64)
        self.big = nn.Linear(128, 256)
        self.small_again = nn.Linear(64, 64)
        self.unaligned = nn.Linear(64, 40)
        self.output = nn.Linear(256, 64)


def _auto_convert(timer: StubTimer, tokens: int = 512) -> tuple[nn.Module, object]:
    with torch.device("meta"):
        model = Net()
    config = Float8Config()
    shapes = linear_shapes(model, config)
    timings = time_linear_shapes(shapes.values(), tokens, config, compiled=True, device=CPU, timer=timer)
    return model, convert_to_float8_training(model, config, AutoFilter(timings, tokens))


def test_stub_timings_decide_which_linears_are_converted():
    timer = StubTimer(TIMINGS)
    model, report = _auto_convert(timer)
    # Each distinct shape the rules would convert, timed once: not the unaligned or filtered ones.
    assert timer.calls == [((64, 64), 512, True, "cpu"), ((128, 256), 512, True, "cpu")]
    assert report.converted == ["big"]
    assert isinstance(model.big, Float8Linear) and type(model.small) is nn.Linear
    reason = "auto: 64->64 float8 1.50 ms vs bf16 1.00 ms at 512 tokens, not 3% faster"
    assert report.skipped == [
        ("small", reason), ("small_again", reason), ("unaligned", "out_features 40 not divisible by 16"),
        ("output", "filtered by filter_fqns"),
    ]
    # Which rule kept each, for code that acts on it (the seam's advice), without parsing the why.
    assert report.kept_by == {"small": AUTO_RULE, "small_again": AUTO_RULE, "unaligned": ALIGNMENT, "output": FILTER_FQNS}
    assert f"small, small_again ({reason})" in str(report)


def test_a_tie_keeps_high_precision_and_untimed_shapes_keep_the_rules():
    # Within 3 % is a tie, within timing noise; 4 % faster converts.
    auto = AutoFilter({(64, 64): ShapeTiming(1.0, 0.98), (128, 64): ShapeTiming(1.0, 0.96)}, tokens=64)
    assert auto.keep_reason((64, 64)) == "auto: 64->64 float8 0.98 ms vs bf16 1.00 ms at 64 tokens, not 3% faster"
    assert auto.keep_reason((128, 64)) is None
    assert auto(nn.Linear(128, 128, device="meta"), "other") is True


def test_module_filter_fn_reasons():
    with torch.device("meta"):
        model = Net()
    kept = convert_to_float8_training(model, Float8Config(), lambda m, fqn: KeepHighPrecision("mine") if fqn == "big" else True)
    assert ("big", "mine") in kept.skipped and "small" in kept.converted and kept.kept_by["big"] == MODULE_FILTER
    with torch.device("meta"):
        model = Net()
    named = convert_to_float8_training(model, Float8Config(), lambda m, fqn: KeepHighPrecision("mine", rule="my rule"))
    assert named.kept_by["big"] == "my rule"
    with torch.device("meta"):
        model = Net()
    rejected = convert_to_float8_training(model, Float8Config(), lambda m, fqn: fqn != "big")
    assert ("big", "rejected by module_filter_fn") in rejected.skipped
    assert not KeepHighPrecision("falsy, like False")


def test_the_real_timer_needs_cuda():
    with pytest.raises(ValueError, match=r"^time_linear_shape times with CUDA events: device must be CUDA, got cpu$"):
        time_linear_shape((64, 64), 64, Float8Config(), False, CPU)


# ---------------------------------------------------------------- the trainer's seam


def _seam(device_type: str, timer: StubTimer | None = None, filter: str = "auto") -> OursFloat8Training:
    cfg = Config()
    cfg.float8.enabled, cfg.float8.filter, cfg.compile.mode = True, filter, "block"
    return build_seam(cfg.float8, Float8RunContext.for_run(cfg, device_type, "bfloat16"), timer)


@pytest.fixture
def fake_h100(monkeypatch):
    # The seam refuses GPUs without float8 GEMMs before it times: it only asks the capability.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_seam_times_on_cuda_and_the_summary_says_why(fake_h100):
    # The debug model's shapes; 256->256 (wq, wo) is slower in float8.
    timer = StubTimer({
        (256, 128): ShapeTiming(0.30, 0.20), (256, 256): ShapeTiming(0.40, 0.45),
        (256, 768): ShapeTiming(1.00, 0.60), (768, 256): ShapeTiming(1.00, 0.70),
    })
    seam = _seam("cuda", timer)
    with torch._dynamo.config.patch(recompile_limit=8):
        report = seam.convert(build_meta_model(LLAMA2_FLAVORS["debug"]))
    tokens = Config().training.batch_size * Config().training.seq_len
    assert [c[1:] for c in timer.calls] == [(tokens, True, "cuda")] * 4
    assert len(report.converted) == 4 * 5
    kept = [fqn for fqn, why in report.skipped if why.startswith("auto: 256->256 float8 0.45 ms vs bf16 0.40 ms")]
    assert kept == [f"layers.{i}.attention.{w}" for i in range(4) for w in ("wq", "wo")]
    lines = seam.summary_lines()
    assert lines[0] == f"float8: {report}"
    assert lines[1] == (
        f"float8: filter auto timed 4 linear shapes at {tokens:,} tokens per micro-batch, compiled: "
        "256->128 (wk, wv x4): bf16 0.30 ms, float8 0.20 ms, float8; "
        "256->256 (wq, wo x4): bf16 0.40 ms, float8 0.45 ms, kept in bf16; "
        "256->768 (w1, w3 x4): bf16 1.00 ms, float8 0.60 ms, float8; "
        "768->256 (w2 x4): bf16 1.00 ms, float8 0.70 ms, float8"
    )
    # Listed with the timings already: no "stay in high precision" warning on top.
    assert not [n for n in seam.advice(torch.device("cuda", 0), 1, 1) if "stay in high precision" in n]


def test_on_cpu_auto_converts_what_the_rules_convert():
    rules = _seam("cpu", filter="rules").convert(build_meta_model(LLAMA2_FLAVORS["debug"]))
    seam = _seam("cpu", StubTimer({}))
    assert seam.convert(build_meta_model(LLAMA2_FLAVORS["debug"])) == rules
    assert seam.timer.calls == []
    assert seam.summary_lines()[1] == (
        "float8: filter auto: auto-timing needs a GPU, so this cpu run converts what filter = 'rules' converts"
    )
    assert _seam("cpu", filter="rules").filter_note is None


@pytest.mark.slow
def test_trainer_on_the_debug_config_says_auto_needs_a_gpu(tmp_path):
    result = run_train([
        "--config", "configs/debug.toml", "--float8.enabled", "true", "--float8.filter", "auto",
        "--training.steps", "1", "--validation.enable", "false",
        "--metrics.enable_tensorboard", "false", "--training.device", "cpu", "--job.dump_folder", str(tmp_path),
    ])
    assert result.returncode == 0, result.stderr[-3000:]
    rules = _seam("cpu", filter="rules").convert(build_meta_model(LLAMA2_FLAVORS["debug"]))
    assert f"float8: {rules}\n" in result.stdout
    assert "float8: filter auto: auto-timing needs a GPU, so this cpu run converts what filter = 'rules' converts" in result.stdout


def test_bad_filter_is_one_line_and_exit_2():
    result = run_train(["--float8.filter", "fastest"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == "error: float8.filter = 'fastest' is not one of rules, auto"


def test_dry_run_lists_what_it_would_time(capsys):
    args = ["--float8.enabled", "true", "--training.device", "cpu", "--job.dry_run", "true"]
    assert train.main([*args, "--float8.filter", "auto"]) == 0
    out = capsys.readouterr().out
    assert (
        "  float8 filter     auto: at start-up would time 4 linear shapes at 1,024 tokens per micro-batch, eager: "
        "256->128 (wk, wv x4); 256->256 (wq, wo x4); 256->768 (w1, w3 x4); 768->256 (w2 x4); the dry run never "
        "times (and cannot without a GPU): the linears above are what filter = 'rules' converts\n"
    ) in out
    assert "float8 linears    28 converted" in out
    assert train.main(args) == 0
    assert "float8 filter" not in capsys.readouterr().out


# ---------------------------------------------------------------- ranks agree


def _rank_entry(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # Rank 0 measures float8 faster, rank 1 slower: the slowest of each time decides on both.
        mine = {0: ShapeTiming(2.0, 1.0), 1: ShapeTiming(2.5, 3.0)}[rank]
        timings = time_linear_shapes([(64, 64)], 64, Float8Config(), False, CPU, timer=lambda *_: mine)
        decision = AutoFilter(timings, 64).keep_reason((64, 64))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps([dataclasses.asdict(timings[(64, 64)]), decision]))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)


@pytest.mark.slow
def test_ranks_that_time_differently_take_the_same_decision(tmp_path):
    mp.spawn(_rank_entry, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0] == results[1] == [
        {"bf16_ms": 2.5, "float8_ms": 3.0}, "auto: 64->64 float8 3.00 ms vs bf16 2.50 ms at 64 tokens, not 3% faster"
    ]
