"""scripts/gpu_check.py: verdicts, table, skip logic, options; one small CPU run of the real thing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from scripts import convert_weights
from scripts import gpu_check as gc
from scripts.harness.gpu_check import checks, runs
from scripts.harness.gpu_check.report import Row, render_table
from tests.helpers import run_script
from trainer.errors import UserError


def _rows(losses: list[float], grad_norms: list[float] | None = None, first: int = 1) -> list[dict]:
    grad_norms = grad_norms or [1.0] * len(losses)
    return [{"step": first + i, "loss": loss, "grad_norm": g}
            for i, (loss, g) in enumerate(zip(losses, grad_norms))]


def _cli(*args: str):
    return gc.parse_args(["--out", "/tmp/gpu_check_unused", *args])


# -- verdicts --------------------------------------------------------------------------------------


def test_parity_passes_within_tolerance_and_reports_the_differences():
    fsdp = _rows([10.0, 9.0, 8.0], [2.0, 2.0, 2.0])
    tp = _rows([10.01, 9.0, 8.0], [2.0, 2.05, 2.0])
    ok, note = checks.parity_verdict(fsdp, tp)
    assert ok
    assert note == "max rel diff steps 1-3: loss 1.0e-03, grad_norm 2.4e-02"


@pytest.mark.parametrize("loss,grad", [(10.5, 2.0), (10.0, 2.3), (math.nan, 2.0), (10.0, math.inf)])
def test_parity_fails_beyond_tolerance_or_on_non_finite_values(loss, grad):
    ok, _ = checks.parity_verdict(_rows([10.0, 9.0, 8.0], [2.0] * 3), _rows([loss, 9.0, 8.0], [grad, 2.0, 2.0]))
    assert not ok


def test_parity_fails_when_a_step_is_missing():
    ok, note = checks.parity_verdict(_rows([10.0, 9.0, 8.0]), _rows([10.0, 9.0]))
    assert not ok and note == "steps [3] missing"


def test_resume_bitwise_equal_rows_pass():
    reference = _rows([10.0, 9.0, 8.0, 7.0, 6.5, 6.0], [3.0, 2.9, 2.8, 2.7, 2.6, 2.5])
    # A resumed metrics.jsonl: the killed run's rows up to the checkpoint, then the rerun's.
    resumed = reference[:3] + [dict(r) for r in reference[3:]]
    ok, note = checks.resume_verdict(reference, resumed, after=3, last=6)
    assert ok and note == "steps 4-6 bitwise equal to the reference"


def test_resume_only_compares_the_steps_after_the_checkpoint():
    reference = _rows([10.0, 9.0, 8.0, 7.0, 6.5, 6.0])
    resumed = _rows([11.0, 11.0, 11.0]) + reference[3:]  # steps 1-3 differ: not compared
    assert checks.resume_verdict(reference, resumed, after=3, last=6)[0]


def test_resume_small_difference_passes_as_not_bitwise_large_one_fails():
    reference = _rows([10.0, 9.0, 8.0, 7.0, 6.5, 6.0])
    close = reference[:5] + _rows([6.0 * (1 + 5e-4)], first=6)
    ok, note = checks.resume_verdict(reference, close, after=3, last=6)
    assert ok and note.startswith("steps 4-6 not bitwise: max rel diff loss 5.0e-04")
    far = reference[:5] + _rows([6.1], first=6)
    assert not checks.resume_verdict(reference, far, after=3, last=6)[0]


def test_resume_fails_on_missing_steps_or_a_resume_at_the_last_step():
    reference = _rows([10.0, 9.0, 8.0, 7.0, 6.5, 6.0])
    ok, note = checks.resume_verdict(reference, reference[:5], after=3, last=6)
    assert not ok and note == "steps 4-6: steps [6] missing"
    ok, note = checks.resume_verdict(reference, reference, after=6, last=6)
    assert not ok and "no steps left" in note


def test_check_records():
    assert checks.check_records(_rows([3.0, 2.0]), 2) is None
    assert checks.check_records(_rows([3.0, 2.0]), 3) == "metrics end at step 2 of 3"
    assert checks.check_records(_rows([3.0, math.nan]), 2) == "non-finite loss at steps [2]"


# -- rows, skipping and the table ------------------------------------------------------------


def test_one_process_skips_tp_and_parity_and_runs_the_rest():
    cli = _cli("--nproc", "1")
    table = gc.build_rows(cli, list(gc.GROUPS))
    gc.skip_rows(table, cli.nproc)
    skipped = {r.name for r in table if r.result == "skipped"}
    assert skipped == {r.name for r in table if r.name.startswith(("tp-", "parity-"))}
    assert len(skipped) == 2 * 5 * 2  # TP and parity rows: 5 precisions x 2 compile modes
    assert {r.reason for r in table if r.result == "skipped"} == {"needs 2 GPUs"}
    assert [r.name for r in table if r.group != "layouts" and r.result != "skipped"] == [
        "ac-full", "ac-selective", "compile-model", "resume-sync", "resume-async", "sft-hf", "sft-dcp"]
    # Parity alone on one GPU runs nothing (no layouts rows); on two it brings the layouts rows.
    assert {r.group for r in gc.build_rows(cli, ["parity"])} == {"parity"}
    two = _cli("--nproc", "2", "--precisions", "bf16", "--compile", "none")
    rows = gc.build_rows(two, ["parity"])
    gc.skip_rows(rows, two.nproc)
    assert [(r.name, r.layout, r.result) for r in rows] == [
        ("fsdp-bf16-none", "FSDP 2", ""), ("tp-bf16-none", "TP 2", ""),
        ("parity-bf16-none", "FSDP 2 vs TP 2", "")]


def test_render_table_shows_results_metrics_and_skip_reasons():
    rows = [
        Row("fsdp-bf16-none", "layouts", "FSDP 1", "bf16", "none", result="pass", tps=123456.7,
            peak_gib=13.93, first_step_s=2.01, notes=["a", "b"]),
        Row("tp-bf16-none", "layouts", "TP 2", "bf16", "none", needs=2, result="skipped",
            reason="needs 2 GPUs"),
        Row("resume-sync", "resume", "FSDP 1", "tensorwise", "block").fail("x | y"),
    ]
    lines = render_table(rows).splitlines()
    assert lines[0].startswith("| row | layout | precision | compile | result | tokens/s/GPU")
    assert lines[2] == "| fsdp-bf16-none | FSDP 1 | bf16 | none | pass | 123,457 | 13.93 | 2.01 | a; b |"
    assert lines[3] == "| tp-bf16-none | TP 2 | bf16 | none | skipped (needs 2 GPUs) |  |  |  |  |"
    assert lines[4] == "| resume-sync | FSDP 1 | tensorwise | block | FAIL: x / y |  |  |  |  |"


def test_options_defaults_and_errors():
    cli = _cli("--nproc", "1")
    assert (cli.batch_size, cli.seq_len, cli.layers, cli.steps, cli.sft_layers) == (2, 4096, 2, 6, 8)
    assert cli.sft_layers_note == " of 32 on one GPU (--sft-layers 32 for all)"
    assert _cli("--nproc", "2").sft_layers == 32
    debug = _cli("--flavor", "debug", "--device", "cpu", "--", "--float8.emulate", "true")
    assert (debug.seq_len, debug.sft_layers, debug.extras) == (128, 4, ["--float8.emulate", "true"])
    for bad, message in [(["--only", "layout"], "unknown name 'layout'"),
                         (["--steps", "3"], "--steps must be > 3"),
                         (["--", "--training.steps", "9"], "--training.steps after `--` is set")]:
        with pytest.raises(UserError, match=message):
            _cli(*bad)


def test_last_wins_keeps_each_option_once_with_its_last_value():
    args = ["--a", "1", "--b", "2", "--a", "3"]
    assert runs.last_wins(args) == ["--a", "3", "--b", "2"]


def test_children_finds_a_child_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in runs._children(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_convert_weights_random_source_writes_the_flavor_in_bf16(tmp_path):
    from models.llama.weight_files import read_weights

    assert convert_weights.main(["--from", "random", "--to", "hf", "--flavor", "debug", "--dtype", "bf16",
                                 "--n-layers", "2", str(tmp_path / "hf")]) == 0
    args, sd = read_weights("hf", tmp_path / "hf")
    assert (args.n_layers, args.vocab_size, args.dim) == (2, 2048, 256)
    assert {t.dtype for t in sd.values()} == {convert_weights.torch.bfloat16}
    # Seeded: the same seed gives the same weights, another seed other weights.
    _, again = convert_weights.random_weights("debug", 2, 42, convert_weights.torch.bfloat16)
    _, other = convert_weights.random_weights("debug", 2, 7, convert_weights.torch.bfloat16)
    key = "layers.1.feed_forward.w2.weight"
    assert sd[key].equal(again[key]) and not sd[key].equal(other[key])


# -- a real run on CPU ------------------------------------------------------------------------------


@pytest.mark.slow
def test_cpu_smoke_run_layouts_and_resume(tmp_path):
    out = tmp_path / "gc"
    proc = run_script("scripts/gpu_check.py", [
        "--device", "cpu", "--flavor", "debug", "--nproc", "1", "--only", "layouts,resume", "--precisions",
        "bf16,tensorwise", "--compile", "none", "--seq-len", "64", "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    table = render_table([]).splitlines()[0]
    assert table in lines and all(line.startswith("|") for line in lines[lines.index(table):])
    report = json.loads((out / "gpu_check.json").read_text())
    results = {r["name"]: r for r in report["rows"]}
    assert {n: r["result"] for n, r in results.items()} == {
        "fsdp-bf16-none": "pass", "fsdp-tensorwise-none": "pass", "tp-bf16-none": "skipped",
        "tp-tensorwise-none": "skipped", "resume-sync": "pass", "resume-async": "pass"}
    for name in ("resume-sync", "resume-async"):
        notes = "; ".join(results[name]["notes"])
        assert "SIGKILL to pid" in notes and "resumed at step 3" in notes
        assert "steps 4-6 bitwise equal to the reference" in notes
        assert (out / "runs" / name / "log-resume.txt").is_file()
        assert not (out / "runs" / name / "checkpoints").exists()
    assert results["fsdp-bf16-none"]["tps"] > 0
    assert (out / "runs" / "fsdp-bf16-none" / "log.txt").is_file()
    md = (out / "gpu_check.md").read_text()
    assert "skipped (needs 2 processes)" in md and "- command: `python scripts/gpu_check.py --device cpu" in md
