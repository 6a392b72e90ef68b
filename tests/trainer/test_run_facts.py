import dataclasses

import pytest

from trainer.config import Layout, build_config
from trainer.float8_seam.rules import Float8RunContext
from trainer.float8_seam.seam import build_seam
from trainer.run_facts import RunFacts, startup_summary

FSDP4_TP2 = Layout(1, 4, 2)


def _facts(args, layout=FSDP4_TP2, param_dtype="bfloat16"):
    cfg = build_config(["--config", "configs/debug.toml", *args])
    precision = build_seam(cfg.float8, Float8RunContext.for_run(cfg, "cpu", param_dtype)).run_name_precision(param_dtype)
    return cfg, RunFacts.for_run(cfg, layout, param_dtype, precision, n_params=1000, flops_per_token=6000)


def test_batch_and_token_counts_follow_the_layout():
    _, facts = _facts(["--training.batch_size", "3", "--training.seq_len", "64",
                       "--training.gradient_accumulation_steps", "2"])
    assert facts.global_batch == 3 * 2 * 4
    assert facts.tokens_per_step == 3 * 64 * 2 * 4
    assert facts.tokens_per_gpu == 3 * 64 * 2 / 2  # a TP pair shares its DP rank's tokens
    assert facts.tokens_per_step_text() == "1,536 (batch 3 x seq 64 x accum 2 x dp 4)"


@pytest.mark.parametrize(
    ("args", "param_dtype", "name"),
    [
        ([], "bfloat16", "debug-bf16-none"),
        (["--compile.mode", "block"], "float32", "debug-fp32-block"),
        (["--float8.enabled", "--float8.scaling", "rowwise"], "bfloat16", "debug-rowwise-none"),
        (["--job.run_name", "mine", "--float8.enabled"], "bfloat16", "mine"),
    ],
)
def test_run_name_and_precision_label(args, param_dtype, name):
    _, facts = _facts(args, param_dtype=param_dtype)
    assert facts.run_name == name


def test_facts_are_frozen_and_the_summary_uses_them():
    cfg, facts = _facts(["--job.description", "a test"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.layout = Layout(1, 1, 1)
    lines = startup_summary(facts, cfg, 4, "sdpa", "cpu (no known peak)", "params bfloat16", "1 GiB", "none")
    assert lines[0] == "run debug-bf16-none: a test"
    assert "1,000 params, 4 layers, 0.00 GFLOP/token" in lines[1]
    assert lines[2] == "device cpu (no known peak) x 8; mesh dp=4 tp=2"
    assert lines[4] == f"tokens per step {facts.tokens_per_step_text()}"


@pytest.mark.parametrize("switch", ["true", "false"])
def test_summary_and_dry_run_say_whether_the_single_rank_fast_path_is_on(switch, capsys):
    from trainer.distributed.single_rank_fast_path import choose_fast_path
    from trainer.dry_run import print_plan

    cfg, facts = _facts(["--parallelism.single_rank_fast_path", switch, "--training.device", "cpu"], Layout(1, 1, 1))
    fast_path = choose_fast_path(cfg.parallelism.single_rank_fast_path, facts.dp).text
    assert fast_path.startswith("single-rank fast path")  # its wording: tests/trainer/distributed/test_single_rank_fast_path.py
    lines = startup_summary(facts, cfg, 4, "sdpa", "cpu (no known peak)", "params bfloat16", "1 GiB", "none", fast_path)
    assert lines[2] == f"device cpu (no known peak) x 1; mesh dp=1 tp=1; {fast_path}"
    print_plan(cfg)
    layout = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  layout "))
    assert layout.endswith(f"; {fast_path}")
