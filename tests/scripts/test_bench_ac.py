"""scripts/bench_ac.py: its train.py options, one cell read through scripts/harness/cells.py's runner
(the subprocess faked), the table, and one small CPU run of the real thing."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from scripts import bench_ac
from tests.helpers import run_script
from trainer.config import build_config


def _opts(tmp_path: Path, *extra: str) -> argparse.Namespace:
    return argparse.Namespace(config="configs/7b_fp8.toml", flavor="debug", n_layers=2, batch_size=2,
                              seq_len=64, steps=3, out=str(tmp_path), timeout=60, extra=list(extra))


def _fake_run(monkeypatch, rc: int = 0, stderr: list[str] | None = None, records: list[dict] | None = None):
    def run_logged(cmd, log_path, timeout=None, cwd=None):
        if records is not None:
            lines = [json.dumps(r) for r in records]
            (log_path.parent / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        return rc, stderr or []

    monkeypatch.setattr(bench_ac, "run_logged", run_logged)


def test_cell_args_make_the_cell_and_leave_the_last_word_to_the_user(tmp_path):
    base = _opts(tmp_path, "--training.steps", "4")
    cfg = build_config(bench_ac.cell_args(base, "rowwise", "block", "selective", tmp_path))
    assert cfg.float8.enabled and cfg.float8.scaling == "rowwise" and not cfg.float8.fsdp_float8_all_gather
    assert cfg.compile.mode == "block" and cfg.activation_checkpoint.mode == "selective"
    assert (cfg.model.n_layers, cfg.training.batch_size, cfg.training.seq_len) == (2, 2, 64)
    assert cfg.training.steps == 4  # the arguments after `--` come last
    assert not cfg.metrics.enable_tensorboard and not cfg.checkpoint.enable and not cfg.profiling.enable
    bf16 = build_config(bench_ac.cell_args(_opts(tmp_path), "bf16", "none", "none", tmp_path))
    assert not bf16.float8.enabled and bf16.training.steps == 3 and bf16.metrics.log_freq == 1


def test_run_cell_reads_step_time_memory_and_loss(tmp_path, monkeypatch):
    records = [{"step": s, "step_time_s": t, "memory/peak_active_gib": m, "loss": loss}
               for s, t, m, loss in [(3, 0.3, 2.5, 4.0), (1, 9.0, 1.0, 6.0), (2, 0.1, 2.0, 5.0)]]
    _fake_run(monkeypatch, records=records)
    cell = bench_ac.run_cell(_opts(tmp_path), "tensorwise", "none", "full")
    assert cell["ok"] and cell["step_ms"] == pytest.approx(200.0)  # median after the compile step
    assert (cell["peak_gib"], cell["loss"]) == (2.5, 4.0)  # the last step's
    assert (tmp_path / "tensorwise-none-full").is_dir()


def test_run_cell_failures_name_the_reason(tmp_path, monkeypatch):
    _fake_run(monkeypatch, rc=1, stderr=["warning: slow\n", "error: training.seq_len must be positive\n"])
    cell = bench_ac.run_cell(_opts(tmp_path), "bf16", "none", "none")
    assert not cell["ok"] and cell["reason"] == "error: training.seq_len must be positive"
    _fake_run(monkeypatch)
    cell = bench_ac.run_cell(_opts(tmp_path), "bf16", "none", "full")
    assert not cell["ok"] and cell["reason"].endswith("metrics.jsonl was not written")

    def timed_out(cmd, log_path, timeout=None, cwd=None):
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(bench_ac, "run_logged", timed_out)
    cell = bench_ac.run_cell(_opts(tmp_path), "bf16", "none", "selective")
    assert cell == {"precision": "bf16", "compile": "none", "ac": "selective", "ok": False,
                    "reason": "timed out after 60 s"}


def test_render_compares_each_mode_with_no_ac():
    cells = [
        {"precision": "bf16", "compile": "none", "ac": "none", "ok": True, "step_ms": 100.0, "peak_gib": 4.0,
         "loss": 5.0},
        {"precision": "bf16", "compile": "none", "ac": "full", "ok": True, "step_ms": 130.0, "peak_gib": 2.0,
         "loss": 5.0},
        {"precision": "bf16", "compile": "block", "ac": "full", "ok": False, "reason": "RuntimeError: boom"},
    ]
    lines = bench_ac.render(cells).splitlines()
    assert lines[2] == "| bf16 | none | none | 100 | 4.00 | 1.00x | 1.00x | 5.0000 |"
    assert lines[3] == "| bf16 | none | full | 130 | 2.00 | 0.50x | 1.30x | 5.0000 |"
    assert lines[4] == "| bf16 | block | full | failed: RuntimeError: boom | | | | |"


@pytest.mark.slow
def test_cpu_smoke_run(tmp_path):
    out = tmp_path / "ac"
    proc = run_script("scripts/bench_ac.py", [
        "--flavor", "debug", "--n-layers", "1", "--batch-size", "1", "--seq-len", "32", "--steps", "2", "--precisions",
        "bf16", "--compile", "none", "--ac", "none,full", "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert [(c["ac"], c["ok"]) for c in cells] == [("none", True), ("full", True)], cells
    assert (out / "bf16-none-full" / "log.txt").read_text().startswith("$ python train.py --config")
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| bf16 | none | full |")
